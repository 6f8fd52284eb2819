"""KV pairing out of the box: the README's defaults, with and without the engines' KV events.

A real registry, 3 sim prefills and 1 sim decode started as the README starts them (no
flag), and the default router (`--policy kv`). 12 documents of 1,000 characters (the
reference tokenizer: one token a byte), each sent 3 times with a different question, one
request at a time. Hits are the engines' own counters
(`pdreg:engine_prefix_cache_hit_tokens_total`), against the ideal: every repeat finds its
whole document cached (its full 16-token blocks). Then the same with `--no-kv-events`,
what every engine did before KV events were its default.

    .venv/bin/python bench/bench_kv_default.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # pdreg; the engine helpers

from reference_helpers import metrics, start_engines, stop_all  # noqa: E402

from pdreg.testing import wait_until  # noqa: E402
from registry.client import MembershipView  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402
from router.guard import LOOPBACK_ALLOW  # noqa: E402
from router.service import RouterConfig, RouterServer  # noqa: E402
from wire.protocol import MemberState  # noqa: E402

DOCUMENTS = 12
DOCUMENT_CHARS = 1000
REPEATS = 3
BLOCK = 16  # the reference engine's default block size
QUESTION = " Question "  # after the document, before what differs per repeat
WAIT_S = 60.0


def prompt(document: str, repeat: int, i: int) -> str:
    return f"{document}{QUESTION}{repeat}-{i}?"


def hits(engine_flags: list[str]) -> tuple[float, int]:
    """(hit tokens the prefills counted, the ideal) for one fresh cluster."""
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0)).start()
    view = MembershipView(registry.control_address).start()
    control = registry.control_address
    handles = start_engines(
        [{"role": "prefill", "registry": control, "extra_args": engine_flags}] * 3
        + [{"role": "decode", "registry": control}])
    router = RouterServer(RouterConfig(port=0, allow_upstream=LOOPBACK_ALLOW), view).start()
    try:
        assert view.wait_for(lambda m: sum(x.record.state is MemberState.READY
                                           for x in m.values()) == len(handles), WAIT_S)
        if not engine_flags:  # the router follows all 3 publishers before the first request
            assert wait_until(lambda: len(httpx.get(router.url + "/v1/kv").json()[
                "members"]) == 3, WAIT_S)
        rng = random.Random(1)
        documents = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ")
                             for _ in range(DOCUMENT_CHARS)) for _ in range(DOCUMENTS)]
        with httpx.Client(timeout=WAIT_S) as http:
            for repeat in range(REPEATS):
                for i, document in enumerate(documents):
                    r = http.post(router.url + "/v1/completions", json={
                        "model": "tiny", "prompt": prompt(document, repeat, i),
                        "max_tokens": 1})
                    r.raise_for_status()
        found = sum(metrics(h.url)["pdreg:engine_prefix_cache_hit_tokens_total"]
                    for h in handles[:3])
        # BOS + what the repeats share (the document and " Question "): its full blocks,
        # found by every repeat after the first.
        shared = 1 + DOCUMENT_CHARS + len(QUESTION)
        ideal = DOCUMENTS * (REPEATS - 1) * (shared // BLOCK) * BLOCK
        return found, ideal
    finally:
        router.close()
        stop_all(handles)
        view.close()
        registry.close()


def main() -> None:
    for flags in ([], ["--no-kv-events"]):
        found, ideal = hits(flags)
        print(f"engines {' '.join(flags) or '(no flag)'}: {found:.0f} hit tokens of "
              f"{ideal} ideal = {100 * found / ideal:.0f}%")


if __name__ == "__main__":
    main()
