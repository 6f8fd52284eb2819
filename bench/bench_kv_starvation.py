"""Tokenizer starvation: a small request's TTFT while another client sends prompts that
cost the `kv` router to tokenize, against the same router with no attack, for this tree
and (side by side, same run) a baseline commit.

One fleet (a real registry, one sim prefill publishing KV events, one sim decode, each
registering a 65,536-token context); each router is a `pdreg router --policy kv
--tokenizer tiny=DIR` process, DIR a byte-level BPE tokenizer.json whose tokens cover
at most 6 characters (tests/test_kv_tokenizer.py's; `--word-level`: the word-level one
of earlier runs, which bounds nothing: a word of any length is one `[UNK]`). Per router:
--requests small streamed requests one after another, alone, and as many while 3
attacker threads send, as fast as the router answers, 4 MB prompts, 480 KB prompts and
a 102,400-message chat (all three over 65,536 x 6 characters: a router that knows the
bound refuses them before decoding them); alone and attacked in alternating windows of
ROUND requests, so that the machine's drift falls on both alike.

    .venv/bin/python bench/bench_kv_starvation.py [--baseline COMMIT] [--requests 30]

Reports each router's small-request TTFT p50 alone and under attack, and their ratio
(the goal: <= 2x), and the same for `GET /v1/models`, which the router answers itself:
the completion's TTFT also waits for engines that the attack's requests load (they
parse and refuse 4 MB prompts), on the same cores. Also: small completions refused
under attack (admission's 503 when the attack fills the prefill's token budget), and
attack requests answered per second (a router that refuses them sooner gets more), and
the CPU the router and the engines spent per attack request answered (from /proc: the
steadiest figure on a shared machine). The attacker is a process of its own, so its
JSON encoding does not stall the measuring client's GIL.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from reference_helpers import start_engines  # noqa: E402
from test_kv_tokenizer import make_byte_level_tokenizer, make_hf_tokenizer  # noqa: E402

from bench.load import first_token_s  # noqa: E402
from bench.procs import remove_tree, router_process, source_tree, tree_cpu_s  # noqa: E402
from pdreg.testing import wait_until  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402
from router.guard import LOOPBACK_ALLOW  # noqa: E402

SMALL = {"model": "tiny", "prompt": "hello world " * 20, "max_tokens": 2, "ignore_eos": True}
ATTACKS = [("/v1/completions", {"prompt": "hello world " * 350_000}),
           ("/v1/completions", {"prompt": "hello world " * 40_000}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]
                                     * 102_400})]
READY_S = 60.0


ROUND = 5  # small requests per window: alone and attacked windows alternate


@dataclass
class Shared:
    """Between the measuring process and the attacker's: `attacking` set while it
    attacks; the attack requests answered, and those in flight."""

    stop: EventType
    attacking: EventType
    answered: Synchronized
    in_flight: Synchronized


def attacker(url: str, shared: Shared) -> None:
    """The attacking client: 3 threads, each sending one kind of request as fast as the
    router answers, while `attacking` is set. A process of its own: its JSON encoding
    (tens of ms of GIL for the chat) must not hold up the measuring client's timing."""
    def loop(path: str, body: dict) -> None:
        with httpx.Client(timeout=120) as http:
            while not shared.stop.is_set():
                if not shared.attacking.wait(0.1):
                    continue
                with shared.in_flight.get_lock():
                    shared.in_flight.value += 1
                with contextlib.suppress(httpx.HTTPError):  # answered or not, go on
                    http.post(url + path, json={"model": "tiny", "max_tokens": 1, **body})
                    with shared.answered.get_lock():
                        shared.answered.value += 1
                with shared.in_flight.get_lock():
                    shared.in_flight.value -= 1

    threads = [threading.Thread(target=loop, args=a, daemon=True) for a in ATTACKS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@dataclass
class Samples:
    """Small requests' TTFTs and `GET /v1/models` times (s), and completions not 200
    (admission's 503 when the attack fills the prefill's budget)."""

    ttfts: list[float] = field(default_factory=list)
    models: list[float] = field(default_factory=list)
    refused: int = 0

    def p50s_ms(self) -> tuple[float, float]:
        ttft = 1000 * statistics.median(self.ttfts) if self.ttfts else float("inf")
        return ttft, 1000 * statistics.median(self.models)


def small_requests(http: httpx.Client, url: str, n: int, into: Samples) -> None:
    """n small completions' TTFT and n `GET /v1/models` (answered by the router alone:
    its own starvation, without the engines the attack also loads)."""
    for _ in range(n):
        try:
            into.ttfts.append(first_token_s(http, url, SMALL))
        except RuntimeError:  # not 200
            into.refused += 1
        started = time.monotonic()
        http.get(url + "/v1/models").raise_for_status()
        into.models.append(time.monotonic() - started)


@dataclass
class Attack:
    """What one router went through under attack: the attack requests answered, and the
    CPU seconds the router and the engines spent meanwhile."""

    answered: int = 0
    seconds: float = 0.0
    router_cpu_s: float = 0.0
    engines_cpu_s: float = 0.0

    def per_request_ms(self, cpu_s: float) -> float:
        return 1000 * cpu_s / max(1, self.answered)


def measure(url: str, n: int, cpu: Callable[[], tuple[float, float]]
            ) -> tuple[Samples, Samples, Attack]:
    """Small requests alone and under attack, in alternating windows of ROUND each (the
    machine drifts less within a window than across a run); `cpu`: the router's and
    the engines' CPU seconds so far, counted over the attacked windows."""
    spawn = multiprocessing.get_context("spawn")
    shared = Shared(spawn.Event(), spawn.Event(), spawn.Value("q", 0), spawn.Value("q", 0))
    process = spawn.Process(target=attacker, args=(url, shared), daemon=True)
    process.start()
    alone, attacked, attack = Samples(), Samples(), Attack()
    try:
        with httpx.Client(timeout=120) as http:
            small_requests(http, url, 3, Samples())  # warm connections
            for _ in range(max(1, n // ROUND)):
                small_requests(http, url, ROUND, alone)
                (router_cpu, engines_cpu), started = cpu(), time.monotonic()
                before = shared.answered.value
                shared.attacking.set()
                assert wait_until(lambda b=before: shared.answered.value >= b + 3, READY_S)
                small_requests(http, url, ROUND, attacked)
                shared.attacking.clear()
                assert wait_until(lambda: shared.in_flight.value == 0, READY_S)
                router_now, engines_now = cpu()
                attack.answered += shared.answered.value - before
                attack.seconds += time.monotonic() - started
                attack.router_cpu_s += router_now - router_cpu
                attack.engines_cpu_s += engines_now - engines_cpu
    finally:
        shared.stop.set()
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
    return alone, attacked, attack


def run(name: str, src: Path, control: str, tokenizer: Path, n: int,
        engine_pids: list[int], report: Callable[[str], None]) -> None:
    flags = ["--drain-delay", "0", "--allow-upstream", LOOPBACK_ALLOW,
             "--tokenizer", f"tiny={tokenizer}"]
    with router_process(control, "kv", flags=flags, src=src) as router:
        assert wait_until(lambda: httpx.get(router.url + "/v1/models").json()["data"], READY_S)
        alone, attacked, attack = measure(
            router.url, n, lambda: (router.cpu_s(), sum(map(tree_cpu_s, engine_pids))))
    (ttft_alone, models_alone), (ttft, models) = alone.p50s_ms(), attacked.p50s_ms()
    report(f"| {name} | {ttft_alone:.1f} ms | {ttft:.1f} ms | {ttft / ttft_alone:.1f}x | "
           f"{attacked.refused} of {len(attacked.models)} | {models_alone:.1f} ms | "
           f"{models:.1f} ms | {models / models_alone:.1f}x | "
           f"{attack.answered / attack.seconds:.1f}/s | "
           f"{attack.per_request_ms(attack.router_cpu_s):.1f} ms | "
           f"{attack.per_request_ms(attack.engines_cpu_s):.1f} ms |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="a commit to compare with")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--word-level", action="store_true",
                        help="the word-level tokenizer (no bound on characters per token)")
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
            make = make_hf_tokenizer if args.word_level else make_byte_level_tokenizer
            make(Path(tokenizer))
            print("| router | small TTFT p50 alone | under attack | ratio | refused under "
                  "attack | /v1/models p50 alone | under attack | ratio | attack answered "
                  "| router CPU per attack request | engines' |\n"
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
            pids = [h.proc.pid for h in handles]
            if baseline is not None:
                run(f"kv @ {args.baseline}", Path(baseline), control, Path(tokenizer),
                    args.requests, pids, lambda line: print(line, flush=True))
            run("kv (this tree)", REPO, control, Path(tokenizer), args.requests, pids,
                lambda line: print(line, flush=True))
    finally:
        for h in handles:
            h.stop(timeout_s=10)
        registry.close()
        remove_tree(baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
