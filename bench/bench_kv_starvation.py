"""Tokenizer starvation: a small request's TTFT while another client sends prompts that
cost the `kv` router to tokenize, against the same router with no attack, for this tree
and (side by side, same run) a baseline commit.

One fleet (a real registry, one sim prefill publishing KV events, one sim decode); each
router is a `pdreg router --policy kv --tokenizer tiny=DIR` process, DIR a word-level
tokenizer.json (tests/test_kv_tokenizer.py's). Per router: --requests small streamed
requests one after another, alone, then while 3 attacker threads send, as fast as the
router answers, 4 MB prompts, 480 KB prompts (80,001 tokens) and a 102,400-message chat.

    .venv/bin/python bench/bench_kv_starvation.py [--baseline COMMIT] [--requests 30]

Reports each router's small-request TTFT p50 alone and under attack, and their ratio
(the goal: <= 2x), and the same for `GET /v1/models`, which the router answers itself:
the completion's TTFT also waits for engines that the attack's requests load (they
parse and refuse 4 MB prompts), on the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from reference_helpers import start_engines  # noqa: E402
from test_kv_tokenizer import make_hf_tokenizer  # noqa: E402

from bench.load import first_token_s  # noqa: E402
from bench.procs import remove_tree, router_process, source_tree  # noqa: E402
from pdreg.testing import wait_until  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402
from router.guard import LOOPBACK_ALLOW  # noqa: E402

SMALL = {"model": "tiny", "prompt": "hello world " * 20, "max_tokens": 2, "ignore_eos": True}
ATTACKS = [("/v1/completions", {"prompt": "hello world " * 350_000}),
           ("/v1/completions", {"prompt": "hello world " * 40_000}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]
                                     * 102_400})]
READY_S = 60.0


def attack(url: str, stop: threading.Event) -> list[threading.Thread]:
    def loop(path: str, body: dict) -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):  # answered or not, go on
                    http.post(url + path, json={"model": "tiny", "max_tokens": 1, **body})

    threads = [threading.Thread(target=loop, args=a, daemon=True) for a in ATTACKS]
    for t in threads:
        t.start()
    return threads


def small_ttfts(url: str, n: int) -> tuple[float, float]:
    """p50s (ms) of n small completions' TTFT and of n `GET /v1/models` (answered by the
    router alone: its own starvation, without the engines the attack also loads)."""
    ttfts, models = [], []
    with httpx.Client(timeout=120) as http:
        for _ in range(n):
            ttfts.append(first_token_s(http, url, SMALL))
            started = time.monotonic()
            http.get(url + "/v1/models").raise_for_status()
            models.append(time.monotonic() - started)
    return 1000 * statistics.median(ttfts), 1000 * statistics.median(models)


def measure(url: str, n: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Small-request p50s alone, then under attack."""
    small_ttfts(url, 3)  # warm connections
    alone = small_ttfts(url, n)
    stop = threading.Event()
    threads = attack(url, stop)
    try:
        small_ttfts(url, 2)  # the attack under way
        attacked = small_ttfts(url, n)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    return alone, attacked


def run(name: str, src: Path, control: str, tokenizer: Path, n: int,
        report: Callable[[str], None]) -> None:
    flags = ["--drain-delay", "0", "--allow-upstream", LOOPBACK_ALLOW,
             "--tokenizer", f"tiny={tokenizer}"]
    with router_process(control, "kv", flags=flags, src=src) as router:
        assert wait_until(lambda: httpx.get(router.url + "/v1/models").json()["data"], READY_S)
        (alone, models_alone), (attacked, models_attacked) = measure(router.url, n)
    report(f"| {name} | {alone:.1f} ms | {attacked:.1f} ms | {attacked / alone:.1f}x | "
           f"{models_alone:.1f} ms | {models_attacked:.1f} ms | "
           f"{models_attacked / models_alone:.1f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="a commit to compare with")
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0,
                                             heartbeat_interval_s=0.5, lease_s=3.0)).start()
    handles = []
    baseline = source_tree(args.baseline) if args.baseline else None
    try:
        control = registry.control_address
        handles = start_engines([{"role": "prefill", "registry": control,
                                  "extra_args": ["--kv-events"]},
                                 {"role": "decode", "registry": control}])
        with tempfile.TemporaryDirectory() as tokenizer:
            make_hf_tokenizer(Path(tokenizer))
            print("| router | small TTFT p50 alone | under attack | ratio | /v1/models p50 "
                  "alone | under attack | ratio |\n|---|---:|---:|---:|---:|---:|---:|",
                  flush=True)
            if baseline is not None:
                run(f"kv @ {args.baseline}", Path(baseline), control, Path(tokenizer),
                    args.requests, lambda line: print(line, flush=True))
            run("kv (this tree)", REPO, control, Path(tokenizer), args.requests,
                lambda line: print(line, flush=True))
    finally:
        for h in handles:
            h.stop(timeout_s=10)
        registry.close()
        remove_tree(baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
