"""A router in front of a big fleet: CPU per request, latency and GC pauses at 10 members
in its view against 100k, side by side in one run.

    .venv/bin/python bench/bench_router_scale.py [--members 10,100000] [--requests 2000]
        [--variants "this;this --models tiny"] [--baseline COMMIT[,COMMIT]] [--repeat 2]
        [--policy peak_ewma] [--settle S] [--idle S]

Per fleet size, one fleet serves every variant in turn (A B A B...: the machine's drift
falls on all): a `pdreg registry` process, 2 prefill + 2 decode sim engines registered
as model `tiny` (vllm-nixl), and bench_scale's load generator keeping the other members
alive (registered on models m0..m7, heartbeating with changing loads every --interval,
default 5 s, the interval a registry picks at 100k, for both sizes; a probe member flips
its state four times a second). Each variant is
a `pdreg router` (this tree with the variant's flags, or --baseline's tree) measured as
bench_router's steady scenario measures one (`measure`: a cold burst, a warm-up, c=1,
then --requests at c=32): router CPU per request (utime+stime) and p50/p99 at c=32.

The router's garbage collections are logged by a sitecustomize on its path (a bench
shim, never in the product): over the measurement (from the moment it serves: its
start-up is printed apart), how many, how many full (generation 2), the longest, and
collection time per second; then its CPU over IDLE_S with no request (what following
the fleet costs it). `--beside`: each router is also measured against a second registry
that the 4 engines alone register with, while the fleet runs: a view of 4 members and
one of the whole fleet, under the same load on the machine's cores.

    .venv/bin/python bench/bench_router_scale.py --heap 100000 --baseline main
    .venv/bin/python bench/bench_router_scale.py --table 100000 --baseline main

Instead, per tree in its own process: what a view of N members gives the collector (a
replica's snapshot of N members, after a gc.freeze of what came before): the objects
tracked, a full collection's time, and a digest round over a fifth of the loads (what
100k members heartbeating every 5 s send each second) with the collections it caused.
With --table, per tree likewise: the CPU a router's pairing table takes per view update
at N members (a load digest of 50 members; a member's state flip; both reading the whole
table), what a request for another model (`tiny`) pays right after a digest, and the
objects the collector tracks after the first table, --repeat times.

    .venv/bin/python bench/bench_router_scale.py --gc 100000 --baseline main
    .venv/bin/python bench/bench_router_scale.py --stages 100000 --baseline main

Instead, per tree likewise, --repeat times: a router's view and table (the real Replica,
Merge, ChangeTrail and Pairing, no sockets) following N members, the collector set as
`settle_heap` sets it: the collections during each step (the first sync, 400 digests of
250 loads with a state flip every 10, a resync) and the young collection right after
each (what the step left for the collector), by the CPU they took. With a fleet,
--gc-detail MS logs what each router collection over MS walked and freed. With --stages,
per tree likewise: the view's CPU per load change at N members, by step (decoding
digests, the replica, the merge, the trail).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import bench_router  # noqa: E402  (puts tests/ on the path too)
from bench_registry import registry_process  # noqa: E402
from reference_helpers import start_engines, stop_all  # noqa: E402

from bench import router_lineup  # noqa: E402
from bench.load import completion, serves  # noqa: E402
from bench.procs import source_tree  # noqa: E402
from bench.router_scale_probes import collections, heap, stages, table  # noqa: E402
from bench.scale.generator import generator  # noqa: E402
from pdreg.testing import wait_until  # noqa: E402

HANDSHAKE = "vllm-nixl"
# A router first syncs its view (100k members: a 40 MB snapshot) and builds its table.
router_lineup.READY_TIMEOUT_S = 180.0
ENGINES = 4  # 2P + 2D, model tiny
# The heartbeat interval, for every fleet size alike: 5 s is what a registry picks at 100k
# members (20k heartbeats/s at most). On a shared 2-core machine a registry fell behind
# at 14k members (1 s) and 64k (5 s) while the fleet registered, and the generator
# stalled on lost replies: --interval 20 there.
INTERVAL_S = 5.0
# The generator registers 100k members in a few minutes on a quiet machine; at a load
# average of 25 on 2 cores it took more than 15.
REGISTER_TIMEOUT_S = 2400.0
# Before a view learned the event port from the empty topic's snapshot, it learned it from
# its first (whole) snapshot and subscribed then: at 100k members something always changed
# meanwhile, so it synced again within a second or two (~1 s of CPU each). Measured without
# a settle, that resync fell into some runs. --settle S sets it (0: measure at once).
SETTLE_S = 10.0
IDLE_S = 5.0  # the router's CPU measured this long with no request, once it serves
GC_DETAIL_MS = 0.0  # --gc-detail: collections longer than this (thread CPU) say what they walked

# Bench-only: the router imports this first (a sitecustomize on its path) and logs every
# garbage collection: unix time, generation, milliseconds of wall time and of the
# collecting thread's CPU. The two differ when the thread waited for the GIL in between
# (a callback is Python code: another thread may run, e.g. the view decoding a snapshot
# in one C call): the CPU figure is the collector's own pause.
_GC_SHIM = """
import gc, os, time
from collections import Counter
_log = open(os.environ["PDREG_BENCH_ROUTER_GC_LOG"], "a", buffering=1)
# --gc-detail MS: a collection taking more of its thread's CPU than this also logs what it
# walked (taken at its start: the objects of the generations it collects, by type, and
# the biggest containers among them with who holds them), and what it freed.
_detail_ms = float(os.environ.get("PDREG_BENCH_ROUTER_GC_DETAIL_MS") or 0)
_start = [0.0, 0.0]
_walked = [None]
_SIZED = (dict, list, set, frozenset, tuple)
def _survey(generation):
    kinds, big, refs = Counter(), [], 0
    for g in range(generation + 1):
        for o in gc.get_objects(g):
            kinds[type(o).__name__] += 1
            if type(o) in _SIZED:
                refs += len(o)
                if len(o) >= 1000:
                    big.append(o)
    big.sort(key=len, reverse=True)
    return kinds, refs, big[:4]
def _holder(o, survey):
    names = []
    for r in gc.get_referrers(o):
        if r is survey or r is survey[2]:
            continue
        if type(r) is dict:
            key = next((k for k, v in r.items() if v is o), "?")
            names.append(f"dict[{key!r}]")
        else:
            names.append(type(r).__name__)
    return ",".join(names[:3])
def _timed(phase, info):
    if phase == "start":
        if _detail_ms:
            _walked[0] = _survey(info["generation"])
        _start[:] = time.perf_counter(), time.thread_time()
        return
    wall = 1e3 * (time.perf_counter() - _start[0])
    cpu = 1e3 * (time.thread_time() - _start[1])
    _log.write(f"{time.time():.4f} {info['generation']} {wall:.3f} {cpu:.3f}\\n")
    walked, _walked[0] = _walked[0], None
    if walked is not None and cpu > _detail_ms:
        kinds, refs, big = walked
        sizes = "; ".join(f"{type(o).__name__}[{len(o)}] in {_holder(o, walked)}"
                          for o in big)
        _log.write(f"# gen{info['generation']} cpu={cpu:.1f}ms walked="
                   f"{sum(kinds.values())} refs={refs} collected={info['collected']} "
                   f"{kinds.most_common(6)} big: {sizes}\\n")
gc.callbacks.append(_timed)
"""


@dataclass
class Row:
    variant: str
    members: int
    cpu_us_per_req: float | None
    p50_ms_c32: float
    p99_ms_c32: float
    req_per_s_c32: float
    failed: int
    gc_count: int
    gc_full: int
    gc_max_ms: float
    gc_ms_per_s: float
    gc_max_cpu_ms: float = 0.0  # the longest by the collecting thread's CPU time
    idle_cpu_ms_per_s: float | None = None  # serving nothing: what following the fleet costs


def gc_figures(path: str, t0: float, t1: float) -> tuple[int, int, float, float, float]:
    """(count, full, longest ms, ms per second, longest ms of the thread's CPU) of the
    collections logged in [t0, t1]."""
    count = full = 0
    longest = total = longest_cpu = 0.0
    with contextlib.suppress(FileNotFoundError), open(path) as log:
        for line in log:
            if line.startswith("#"):  # --gc-detail's account of a slow one
                continue
            at, generation, ms, *cpu = line.split()
            if t0 <= float(at) <= t1:
                count += 1
                full += generation == "2"
                longest = max(longest, float(ms))
                longest_cpu = max(longest_cpu, float(cpu[0]) if cpu else 0.0)
                total += float(ms)
    return (count, full, round(longest, 1), round(total / max(1e-9, t1 - t0), 1),
            round(longest_cpu, 1))


def serving_since(target: router_lineup.Target) -> float:
    """Wait until `target` serves a request, then SETTLE_S more; then (unix time). The
    collections counted are those from then on: its start-up (the first snapshot, the
    first table, and the resync that follows at 100k members) apart."""
    send = completion(target.url, router_lineup.BODY)
    wait_until(lambda: serves(send), router_lineup.READY_TIMEOUT_S, poll_s=0.2)
    time.sleep(SETTLE_S)
    return time.time()


def measure_router(registry: str, args: argparse.Namespace, name: str, src: Path | None,
                   flags: list[str], members: int, log_path: str) -> Row:
    """One variant's router against `registry` (`members` in its view), measured as
    bench_router's steady scenario measures one, then IDLE_S with no request."""
    with gc_logged_router(registry, args.policy, name, src, flags, log_path) as target:
        t0 = serving_since(target)
        try:
            row = bench_router.measure(target, HANDSHAKE, args.requests)
        except RuntimeError as exc:  # never became ready: say so, go on
            print(f"  {name}: {exc}", flush=True)
            row = bench_router.Row(name, HANDSHAKE, failed=-1)
        gc = gc_figures(log_path, t0, time.time())
        idle = idle_cpu_ms_per_s(target)  # after the measurement: past its start-up
        start_up = gc_figures(log_path, 0.0, t0)
        print(f"  start-up: {start_up[0]} collections, the longest {start_up[2]} ms "
              f"({start_up[4]} ms of CPU)", flush=True)
    return Row(name, members, row.cpu_us_per_req, row.p50_ms_c32, row.p99_ms_c32,
               row.req_per_s_c32, row.failed, *gc, idle)


def idle_cpu_ms_per_s(target: router_lineup.Target) -> float | None:
    """The router's CPU per second over IDLE_S with no request: its view following the
    fleet, which a request's CPU figure carries too (spread over the requests)."""
    if target.cpu_s is None:
        return None
    before = target.cpu_s()
    time.sleep(IDLE_S)
    return round((target.cpu_s() - before) / IDLE_S * 1e3, 1)


@contextlib.contextmanager
def gc_logged_router(registry: str, policy: str, label: str, src: Path | None,
                     flags: list[str], log_path: str) -> Iterator[router_lineup.Target]:
    """router_lineup's `pdreg router`, with the GC shim on its path (for it alone)."""
    shim = tempfile.mkdtemp(prefix="pdreg-router-gc-")
    Path(shim, "sitecustomize.py").write_text(_GC_SHIM)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PDREG_BENCH_ROUTER_GC_LOG",
                                            "PDREG_BENCH_ROUTER_GC_DETAIL_MS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (shim, saved["PYTHONPATH"]) if p)
    os.environ["PDREG_BENCH_ROUTER_GC_LOG"] = log_path
    os.environ["PDREG_BENCH_ROUTER_GC_DETAIL_MS"] = str(GC_DETAIL_MS)
    router_lineup.ROUTER_ARGS[:] = flags
    try:
        with router_lineup.pdreg_router(registry, policy, label, src) as target:
            for key, value in saved.items():  # the router has it; nobody else gets it
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            yield target
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(shim, ignore_errors=True)


@contextlib.contextmanager
def fleet(members: int, interval_s: float, beside: bool = False
          ) -> Iterator[list[tuple[int, str]]]:
    """A registry, the 4 sim engines of `tiny`, and the generator's other members; yields
    [(members, its control address)]. `beside`: and a second registry that the engines
    alone register with: a router of it has 4 members in its view while the machine
    carries the whole fleet (the same load on its cores for both)."""
    with contextlib.ExitStack() as stack:
        address, _ = stack.enter_context(registry_process(
            interval_s, 3 * interval_s, extra=("--max-members", str(members + 1000))))
        registries = [(members, address)]
        if beside:
            small, _ = stack.enter_context(registry_process(interval_s, 3 * interval_s))
            registries.append((ENGINES, small))
        engines = start_engines([{"role": role, "backend": "sim", "protocol": HANDSHAKE,
                                  "registry": ",".join(a for _, a in registries)}
                                 for role in ("prefill", "prefill", "decode", "decode")])
        ctl, out = mp.Queue(), mp.Queue()
        others = max(0, members - ENGINES - 1)  # the generator adds its probe member
        gen = mp.Process(target=generator, args=(address, others, 0.0, ctl, out))
        try:  # (the engines are stopped whatever fails from here)
            gen.start()
            _, register_s, missing, interval = out.get(timeout=REGISTER_TIMEOUT_S)
            print(f"fleet of {members}: {others} generated members registered in "
                  f"{register_s:.0f}s ({missing} missing), interval {interval:g}s",
                  flush=True)
            time.sleep(max(2.0, 1.5 * interval))  # every member heartbeats once
            yield registries
        finally:
            ctl.put("end")
            with contextlib.suppress(Exception):
                out.get(timeout=60)
            if gen.pid is not None:
                gen.join(timeout=30)
            stop_all(engines)


def print_table(rows: list[Row], requests: int, policy: str) -> None:
    print(f"\n{requests} requests at c={router_lineup.CONCURRENCY} per run, policy "
          f"{policy}; GC over the whole measurement\n")
    print("| router | members | CPU per request | p50 / p99 at c=32 | req/s | GCs "
          "(full) | longest GC (wall / the thread's CPU) | GC ms per s | idle CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cpu = f"{r.cpu_us_per_req:.0f} µs" if r.cpu_us_per_req is not None else "-"
        print(f"| {r.variant} | {r.members:,} | {cpu} | {r.p50_ms_c32:.1f} / "
              f"{r.p99_ms_c32:.1f} ms | {r.req_per_s_c32:,.0f} | {r.gc_count} ({r.gc_full}) "
              f"| {r.gc_max_ms} / {r.gc_max_cpu_ms} ms | {r.gc_ms_per_s} | "
              f"{r.idle_cpu_ms_per_s} ms/s |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", default="10,100000")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--variants", default="this;this --models tiny",
                        help="routers to run, ';'-separated: 'this FLAGS...'")
    parser.add_argument("--baseline", default="", help="also these commits' routers, comma-"
                        "separated (their flags as bench_router gives another tree)")
    parser.add_argument("--policy", default="peak_ewma")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--interval", type=float, default=INTERVAL_S, metavar="S",
                        help="the fleet's heartbeat interval")
    parser.add_argument("--heap", type=int, default=0, metavar="N",
                        help="instead: a view's heap of N members, per tree (no fleet)")
    parser.add_argument("--table", type=int, default=0, metavar="N",
                        help="instead: what view updates cost the pairing table at N "
                             "members, per tree (no fleet)")
    parser.add_argument("--beside", action="store_true",
                        help="also measure each router against a registry of the 4 "
                             "engines alone, while the fleet runs (the same machine load)")
    parser.add_argument("--gc", type=int, default=0, metavar="N",
                        help="instead: a router's collections per step of following N "
                             "members (first sync, digests and flips, a resync), per tree")
    parser.add_argument("--settle", type=float, default=SETTLE_S, metavar="S",
                        help="measure this long after the router serves (its start-up apart)")
    parser.add_argument("--idle", type=float, default=IDLE_S, metavar="S",
                        help="measure the router's CPU this long with no request")
    parser.add_argument("--stages", type=int, default=0, metavar="N",
                        help="instead: the view's CPU per load change at N members, by "
                             "step (decode, replica, merge, trail), per tree")
    parser.add_argument("--gc-detail", type=float, default=0.0, metavar="MS",
                        help="log what each collection over MS of CPU walked and freed")
    parser.add_argument("--gc-logs", default="", metavar="DIR",
                        help="keep the routers' collection logs in DIR")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    global GC_DETAIL_MS, SETTLE_S, IDLE_S
    GC_DETAIL_MS, SETTLE_S, IDLE_S = args.gc_detail, args.settle, args.idle
    variants: list[tuple[str, Path | None, list[str]]] = [
        (v.strip(), None, v.split()[1:]) for v in args.variants.split(";") if v.strip()]
    trees = [(commit, source_tree(commit))
             for commit in args.baseline.split(",") if commit]
    variants[:0] = [(commit, Path(tmp), []) for commit, tmp in trees]
    if args.table or args.heap or args.gc or args.stages:
        for _ in range(args.repeat if args.table else 0):
            table(args.table, [*trees, ("this", str(BENCH.parent))])
        if args.heap:
            heap(args.heap, [*trees, ("this", str(BENCH.parent))])
        for _ in range(args.repeat if args.gc else 0):
            collections(args.gc, [*trees, ("this", str(BENCH.parent))])
        for _ in range(args.repeat if args.stages else 0):
            stages(args.stages, [*trees, ("this", str(BENCH.parent))])
        for _, tmp in trees:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    logs = args.gc_logs or tempfile.mkdtemp(prefix="pdreg-router-gc-logs-")
    os.makedirs(logs, exist_ok=True)
    rows: list[Row] = []
    try:
        for members in (int(m) for m in args.members.split(",")):
            with fleet(members, args.interval, args.beside) as registries:
                for turn in range(args.repeat):
                    for (name, src, flags), (size, registry) in itertools.product(
                            variants, registries):
                        log_path = os.path.join(logs, f"{size}-{turn}-{len(rows)}.log")
                        rows.append(measure_router(registry, args, name, src, flags, size,
                                                   log_path))
                        print(json.dumps(asdict(rows[-1])), flush=True)
    finally:
        if not args.gc_logs:
            shutil.rmtree(logs, ignore_errors=True)
        for _, tmp in trees:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, args.requests, args.policy)
    return 0



if __name__ == "__main__":
    sys.exit(main())
