"""KV-aware pairing side by side: pdreg `kv` against `prefix`, `peak_ewma`, round robin,
two peers and two oracles, on engines whose prefix caches really work.

Each router gets its own fresh cluster (same shape, same trace, same seed): a real
registry, 3 sim prefills (KV events on, their default; one prefill at a time, a cost per *uncached*
prompt token, a prefix cache of --cache-blocks blocks of 16 tokens, LRU) and 2 sim
decodes. A third of the way in a 4th prefill joins; two thirds in, prefill 1 restarts
(empty cache, same id): the caches change under the router.

Trace (seeded): 32 system prompts of 1-2k tokens with Zipf popularity, each request one
of: a system prompt + a fresh question; the next turn of one of 12 multi-turn sessions
(history grows each turn); a unique prompt. Open loop: Poisson arrivals (seeded) at
--utilisation of what the 3 first prefills compute with no cache hit at all, so the
prefills are busy but not permanently queued, and a router's hits show in its TTFT.

Reported per router: TTFT p50/p99 (first streamed token, client side), prefill tokens
computed per request and the hit rate (the engines' own counters), hit tokens against
the oracles', router CPU per request (its process tree), tokenization shown apart (the
router's own histogram), and for `kv` the hit rate it predicted at its picks. The
oracles replay the trace at its arrival times against LRU caches of the same size and
FIFO prefills of the same speed, knowing every cache and queue, each request to the
prefill holding most of it: one within the routers' load bound (`prefix`'s rule; the
fair ceiling for a router that must spread load, and the one "vs oracle" means), one
with load ignored (the ceiling of hits alone).

    .venv/bin/python bench/bench_kv.py [--requests 300] [--utilisation 0.7] [--routers kv,...]
    .venv/bin/python bench/bench_kv.py --routers kv --decisions   # log every kv pick
    .venv/bin/python bench/bench_kv.py --routers kv+disagg=0,kv  # disagg=0: always P then D
    .venv/bin/python bench/bench_kv.py --trace chat --routers kv+disagg=0,kv+disagg=1024
    .venv/bin/python bench/bench_kv.py --scale   # the index alone at 1,000 members
    .venv/bin/python bench/bench_kv.py --routers kv,sglang-router:cache_aware
    .venv/bin/python bench/bench_kv.py --routers kv,prefix --prompt-scale 0.5   # ~1k tokens
    .venv/bin/python bench/bench_kv.py --routers kv@main,kv,prefix   # before/after
    .venv/bin/python bench/bench_kv.py --routers kv --replicas 1,2,4   # N routers on one
        # registry, each its own feed and counts, taking requests in turn; CPU summed
Writes bench/out/kv.json.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # `bench` and pdreg; the engine helpers

from reference_helpers import EngineHandle, metrics, start_engine, start_engines  # noqa: E402

from bench import peers  # noqa: E402
from bench.kv_index_alone import index_alone  # noqa: E402
from bench.kv_open_loop import OpenLoop  # noqa: E402
from bench.kv_profile import RouterProbe  # noqa: E402
from bench.kv_rows import Row, make_row, print_rows  # noqa: E402
from bench.kv_trace import (  # noqa: E402
    BLOCK,
    PREFILL_S_PER_TOKEN,
    arrivals,
    make_chat_trace,
    make_trace,
    oracle,
)
from bench.procs import remove_tree, router_process, source_tree, tree_run_s  # noqa: E402
from bench.tables import write_json  # noqa: E402
from pdreg.testing import free_low_port, wait_until  # noqa: E402
from registry.client import MembershipView  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402
from router.guard import LOOPBACK_ALLOW  # noqa: E402

OUT = REPO / "bench" / "out" / "kv.json"
# Per prefill: 32k tokens, a third of the trace's shared prefixes (system prompts and
# session histories, ~100k tokens): the fleet holds the popular ones when it partitions
# them, one prefill alone does not. (A GPU prefill holds 100k-1M tokens; the trace is
# scaled down with it.)
CACHE_BLOCKS = 2048
UTILISATION = 0.7
MAX_CONCURRENT = 64
DECODE_S_PER_TOKEN = 0.002
MAX_TOKENS = 4
ROUTERS = ("kv", "prefix", "peak_ewma", "round_robin")
READY_TIMEOUT_S = 60.0
ENGINE_STOP_S = 10.0


# --- one run ---------------------------------------------------------------------------


KV_EVENTS = [True]  # --no-kv-events: engines cache but publish nothing (a fleet kv is blind to)
PROFILE: list[Path | None] = [None]  # --profile DIR: py-spy every pdreg router over its load


def engine_args(cache_blocks: int) -> list[str]:
    return [
        "--kv-events" if KV_EVENTS[0] else "--no-kv-events",
        "--max-running", "1", "--prefix-cache-blocks", str(cache_blocks),
        "--block-size", str(BLOCK), "--sim-prefill-delay", str(PREFILL_S_PER_TOKEN)]


@contextmanager
def cluster(cache_blocks: int) -> Iterator[tuple[RegistryServer, list[EngineHandle], list]]:
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0,
                                             heartbeat_interval_s=0.5, lease_s=3.0)).start()
    control = registry.control_address
    handles: list[EngineHandle] = []
    try:
        specs = [{"role": "prefill", "registry": control, "extra_args": [
            *engine_args(cache_blocks), "--port", str(free_low_port())]} for _ in range(3)]
        # Decodes cache (what they compute and what they pull) and publish like prefills,
        # and compute a prompt at the same cost: what a decode serving a request alone
        # (conditional disaggregation) would do.
        # The sim does not slow a decode's other streams while it prefills one.
        specs += [{"role": "decode", "registry": control, "extra_args": [
            *engine_args(cache_blocks), "--max-running", "8",
            "--sim-decode-delay", str(DECODE_S_PER_TOKEN)]} for _ in range(2)]
        handles += start_engines(specs)
        yield registry, handles, specs
    finally:
        for h in handles:
            h.stop(timeout_s=10)
        registry.close()


@contextmanager
def pdreg_router(registry: str, name: str, decisions: Path | None = None, replicas: int = 1
                 ) -> Iterator[tuple[list[str], list[int]]]:
    """`name`: a policy, or `kv+disagg=N` (kv with --disagg-min-uncached-tokens N), and
    either may end in `@COMMIT`: the router of that commit (a before/after in one run).
    `decisions`: keep the router's DEBUG log there (the kv chooser logs every pick).
    `replicas`: that many routers, each on its own; yields their URLs and pids."""
    name, _, commit = name.partition("@")
    policy, _, option = name.partition("+")
    extra = ["--disagg-min-uncached-tokens", option.split("=", 1)[1]] if option else []
    with ExitStack() as stack:
        src = source_tree(commit) if commit else None
        stack.callback(remove_tree, src)
        routers = [stack.enter_context(router_process(
            registry, policy, src=Path(src) if src else REPO,
            flags=["--drain-delay", "0", "--allow-upstream", LOOPBACK_ALLOW, *extra],
            log_level="DEBUG" if decisions else "WARNING",
            log_path=decisions if i == 0 else None)) for i in range(replicas)]
        yield [r.url for r in routers], [r.proc.pid for r in routers]


def counters(handles: list[EngineHandle]) -> tuple[float, float]:
    prompt = hit = 0.0
    for h in handles:
        if h.returncode is None:
            m = metrics(h.url)
            prompt += m.get("pdreg:engine_prompt_tokens_total", 0.0)
            hit += m.get("pdreg:engine_prefix_cache_hit_tokens_total", 0.0)
    return prompt, hit


@contextmanager
def peer_router(name: str, handles: list[EngineHandle]
                ) -> Iterator[tuple[list[str], list[int]]]:
    """`sglang-router:POLICY` (SGLang's bootstrap handshake, which the reference engines
    answer too) or `vllm-router:POLICY`, given the first 3 prefills and the decodes as
    static URLs: a peer does not see the prefill that joins mid-run."""
    kind, _, policy = name.partition(":")
    prefills, decodes = handles[:3], handles[3:5]
    if kind == "sglang-router":
        router = peers.start_sglang_router([(h.url, h.bootstrap_port) for h in prefills],
                                           [h.url for h in decodes], policy=policy)
    else:
        router = peers.start_vllm_router([h.url for h in prefills], [h.url for h in decodes],
                                         policy=policy)
    try:
        yield [router.url], [router.proc.pid]
    finally:
        router.stop()


class MidRun:
    """The caches change under the router: a 4th prefill joins a third of the way in;
    two thirds in, prefill 1 restarts (empty cache, same id). Each runs on a thread of
    its own, beside the arrivals. `retired`: the restarted prefill's first life's
    counters (prompt tokens, hit tokens)."""

    def __init__(self, registry: str, handles: list[EngineHandle], specs: list,
                 cache_blocks: int, requests: int) -> None:
        self.registry, self.handles, self.specs = registry, handles, specs
        self.cache_blocks = cache_blocks
        self.joins_at, self.restarts_at = requests // 3, 2 * requests // 3
        self.retired = [0.0, 0.0]
        self.threads: list[threading.Thread] = []

    def before(self, i: int) -> None:
        if i in (self.joins_at, self.restarts_at):
            self.threads.append(threading.Thread(target=self._change, args=(i,)))
            self.threads[-1].start()

    def _change(self, i: int) -> None:
        if i == self.joins_at:
            self.handles.append(start_engine(role="prefill", registry=self.registry,
                                             extra_args=engine_args(self.cache_blocks)))
        elif i == self.restarts_at:
            victim = self.handles[0]
            p, h = counters([victim])
            self.retired[0] += p
            self.retired[1] += h
            victim.stop(timeout_s=ENGINE_STOP_S)
            self.handles[0] = start_engine(role="prefill", registry=self.registry,
                                           extra_args=self.specs[0]["extra_args"])

    def join(self) -> None:
        for t in self.threads:
            t.join()


def _wait_ready(registry: RegistryServer, count: int = 5) -> None:
    view = MembershipView(registry.control_address).start()
    try:
        assert view.wait_for(lambda m: len([x for x in m.values()
                                            if x.record.state.name == "READY"]) == count,
                             READY_TIMEOUT_S)
    finally:
        view.close()


def _router(policy: str, registry: RegistryServer, handles: list[EngineHandle],
            decisions: Path | None, replicas: int
            ) -> AbstractContextManager[tuple[list[str], list[int]]]:
    if ":" in policy:
        return peer_router(policy, handles)
    return pdreg_router(registry.control_address, policy, decisions, replicas)


@dataclass
class _Run:
    """One router under test, on its own fleet, through the windows of a run."""

    name: str
    handles: list[EngineHandle]
    urls: list[str]
    pids: list[int]
    mid: MidRun
    load: OpenLoop
    probe: RouterProbe
    cpu_s: float = 0.0


def run_routers(policies: list[tuple[str, int]], trace: list[str], times: list[float],
                cache_blocks: int, window: int = 0, decisions: bool = False,
                max_tokens: list[int] | None = None) -> list[Row]:
    """Each (policy, replicas) on a fleet of its own, all up at once. The trace goes in
    windows of `window` requests (0: the whole trace), each window to every router in
    turn, the order reversed every window (A B B A...): routers compared in one run
    then share the machine's drifting load, and each is charged the CPU of its own
    windows only. `max_tokens`: each request's (the chat trace's answers)."""
    window = window or len(trace)
    with ExitStack() as stack:
        runs = [_start(stack, policy, replicas, cache_blocks, len(trace), decisions)
                for policy, replicas in policies]
        for w, first in enumerate(range(0, len(trace), window)):
            for run in runs if w % 2 == 0 else runs[::-1]:
                cpu_before = sum(tree_run_s(pid) for pid in run.pids)
                with run.probe.window():
                    run.load.run(trace, times, run.mid, max_tokens,
                                 range(first, min(first + window, len(trace))))
                run.cpu_s += sum(tree_run_s(pid) for pid in run.pids) - cpu_before
        rows = []
        for run in runs:
            run.probe.close()
            # Summed over replicas: every counter the row reads is a sum.
            router_metrics = "\n".join(httpx.get(url + "/metrics").text for url in run.urls)
            decode = counters(run.handles[3:5])
            prompt, hit = counters(run.handles)
            served = (prompt + run.mid.retired[0], hit + run.mid.retired[1])
            row = make_row(run.name, len(trace), run.load, run.cpu_s, router_metrics, served,
                       decode)
            row.threads_ms_per_request = {thread: round(1000 * s / len(trace), 3)
                                          for thread, s in run.probe.threads().items()}
            row.threads_wakes_per_request = {thread: round(n / len(trace), 2)
                                             for thread, n in run.probe.wakes().items()}
            rows.append(row)
        return rows


def _start(stack: ExitStack, policy: str, replicas: int, cache_blocks: int, n: int,
           decisions: bool) -> _Run:
    """A fleet for `policy`'s router(s), ready, and the router(s) listening."""
    registry, handles, specs = stack.enter_context(cluster(cache_blocks))
    _wait_ready(registry)
    log = None
    if decisions and ":" not in policy:
        log = OUT.parent / f"kv-decisions-{policy}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
    urls, pids = stack.enter_context(_router(policy, registry, handles, log, replicas))
    if ":" not in policy:  # a peer listens already (peers._start waited)
        for url in urls:
            assert wait_until(lambda u=url: httpx.get(u + "/v1/models").json()["data"], 30)
    name = policy if replicas == 1 else f"{policy} x{replicas} replicas"
    probe = RouterProbe(pids, name, PROFILE[0] if ":" not in policy else None)
    return _Run(name, handles, urls, pids,
                MidRun(registry.control_address, handles, specs, cache_blocks, n),
                OpenLoop(urls, max_tokens=MAX_TOKENS, workers=MAX_CONCURRENT), probe)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--utilisation", type=float, default=UTILISATION,
                        help="offered load: this share of what the first 3 prefills "
                             "compute with no cache (Poisson arrivals)")
    parser.add_argument("--cache-blocks", type=int, default=CACHE_BLOCKS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prompt-scale", type=float, default=1.0,
                        help="every text of the trace this many times longer (1: ~2k "
                             "tokens per request on average)")
    parser.add_argument("--replicas", default="1",
                        help="pdreg routers per run, e.g. 1,2,4: each count is a run of "
                             "its own, the client spreading requests across them")
    parser.add_argument("--trace", choices=("mixed", "chat"), default="mixed",
                        help="mixed: shared system prompts, sessions, unique prompts; "
                             "chat: multi-turn conversations only (kv_trace.make_chat_trace)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--decisions", action="store_true",
                        help="keep each pdreg router's DEBUG log (every kv pick) in "
                             "bench/out/kv-decisions-ROUTER.log")
    parser.add_argument("--no-kv-events", action="store_true",
                        help="engines publish no KV events (what `kv` does blind)")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON results")
    parser.add_argument("--interleave", type=int, default=0, metavar="N",
                        help="every router up at once, each on its own fleet; the trace "
                             "in windows of N requests, each to every router in turn "
                             "(A B B A...), CPU charged per window: side by side")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="py-spy each pdreg router over its load: DIR/kv-profile-"
                             "ROUTER-N.txt (raw stacks per thread; python -m "
                             "bench.kv_profile FILE breaks them down)")
    parser.add_argument("--scale", action="store_true",
                        help="only the index at 1,000 members: events/s and memory")
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.scale:
        index_alone()
        return 0
    KV_EVENTS[0] = not args.no_kv_events
    PROFILE[0] = args.profile
    answers: list[int] | None = None
    if args.trace == "chat":
        chat = make_chat_trace(args.requests, args.seed)
        trace, answers = chat.prompts, chat.max_tokens
    else:
        trace = make_trace(args.requests, args.seed, args.prompt_scale)
    times = arrivals(trace, args.utilisation, args.seed)
    joins_at, restarts_at = len(trace) // 3, 2 * len(trace) // 3
    fair = oracle(trace, times, args.cache_blocks, joins_at, restarts_at, bounded=True)
    greedy = oracle(trace, times, args.cache_blocks, joins_at, restarts_at, bounded=False)
    rate = len(trace) / times[-1]
    print(f"oracle (bounded load) {fair.hit_rate:.1%} hits, modelled prefill TTFT p50 "
          f"{fair.prefill_ttft_p50_ms:.0f} ms; oracle (load ignored) {greedy.hit_rate:.1%}, "
          f"{greedy.prefill_ttft_p50_ms:.0f} ms; {rate:.2f} req/s; "
          f"{sum(map(len, trace)) / len(trace):.0f} characters (= tokens) per request",
          flush=True)
    runs = [(policy, int(n)) for policy in args.routers.split(",")
            for n in (args.replicas.split(",") if ":" not in policy else ["1"])]
    if args.interleave:
        print(f"== {', '.join(p for p, _ in runs)} in windows of {args.interleave}", flush=True)
        rows = run_routers(runs, trace, times, args.cache_blocks, args.interleave,
                           args.decisions, answers)
    else:
        rows = []
        for run in runs:
            print(f"== {run[0]} x{run[1]}", flush=True)
            rows += run_routers([run], trace, times, args.cache_blocks, 0, args.decisions,
                                answers)
    for row in rows:
        row.vs_oracle = row.hit_rate / fair.hit_rate if fair.hit_rate else 0.0
        row.vs_greedy_oracle = row.hit_rate / greedy.hit_rate if greedy.hit_rate else 0.0
        print(f"   {row}", flush=True)
    print_rows(rows, fair.hit_rate, greedy.hit_rate, args, rate)
    write_json(args.out, {"oracle_hit_rate": fair.hit_rate,
                          "oracle_load_ignored_hit_rate": greedy.hit_rate,
                          "requests_per_s": rate,
                          "args": {k: str(v) for k, v in vars(args).items()},
                          "rows": [{k: v for k, v in asdict(r).items() if k != "ttfts"}
                                   for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
