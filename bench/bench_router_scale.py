"""A router in front of a big fleet: CPU per request, latency and GC pauses at 10 members
in its view against 100k, side by side in one run.

    .venv/bin/python bench/bench_router_scale.py [--members 10,100000] [--requests 2000]
        [--variants "this;this --models tiny"] [--baseline COMMIT[,COMMIT]] [--repeat 2]
        [--policy peak_ewma]

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
shim, never in the product): over the measurement, how many, how many full (generation
2), the longest, and collection time per second.

    .venv/bin/python bench/bench_router_scale.py --heap 100000 --baseline main
    .venv/bin/python bench/bench_router_scale.py --table 100000 --baseline main

Instead, per tree in its own process: what a view of N members gives the collector (a
replica's snapshot of N members, after a gc.freeze of what came before): the objects
tracked, a full collection's time, and a digest round over a fifth of the loads (what
100k members heartbeating every 5 s send each second) with the collections it caused.
With --table, per tree likewise: the CPU a router's pairing table takes per view update
at N members (a load digest of 50 members; a member's state flip), --repeat times.
"""

from __future__ import annotations

import argparse
import contextlib
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

from bench.procs import source_tree  # noqa: E402
from bench.scale.generator import generator  # noqa: E402

HANDSHAKE = "vllm-nixl"
# A router first syncs its view (100k members: a 40 MB snapshot) and builds its table.
bench_router.READY_TIMEOUT_S = 180.0
ENGINES = 4  # 2P + 2D, model tiny
# The heartbeat interval, for every fleet size alike: 5 s is what a registry picks at 100k
# members (20k heartbeats/s at most). On a shared 2-core machine a registry fell behind
# at 14k members (1 s) and 64k (5 s) while the fleet registered, and the generator
# stalled on lost replies: --interval 20 there.
INTERVAL_S = 5.0
# The generator registers 100k members in a few minutes on a quiet machine; at a load
# average of 25 on 2 cores it took more than 15.
REGISTER_TIMEOUT_S = 2400.0

# Bench-only: the router imports this first (a sitecustomize on its path) and logs every
# garbage collection: unix time, generation, milliseconds of wall time and of the
# collecting thread's CPU. The two differ when the thread waited for the GIL in between
# (a callback is Python code: another thread may run, e.g. the view decoding a snapshot
# in one C call): the CPU figure is the collector's own pause.
_GC_SHIM = """
import gc, os, time
_log = open(os.environ["PDREG_BENCH_ROUTER_GC_LOG"], "a", buffering=1)
_start = [0.0, 0.0]
def _timed(phase, info):
    if phase == "start":
        _start[:] = time.perf_counter(), time.thread_time()
    else:
        _log.write(f"{time.time():.4f} {info['generation']} "
                   f"{1e3 * (time.perf_counter() - _start[0]):.3f} "
                   f"{1e3 * (time.thread_time() - _start[1]):.3f}\\n")
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


def gc_figures(path: str, t0: float, t1: float) -> tuple[int, int, float, float, float]:
    """(count, full, longest ms, ms per second, longest ms of the thread's CPU) of the
    collections logged in [t0, t1]."""
    count = full = 0
    longest = total = longest_cpu = 0.0
    with contextlib.suppress(FileNotFoundError), open(path) as log:
        for line in log:
            at, generation, ms, *cpu = line.split()
            if t0 <= float(at) <= t1:
                count += 1
                full += generation == "2"
                longest = max(longest, float(ms))
                longest_cpu = max(longest_cpu, float(cpu[0]) if cpu else 0.0)
                total += float(ms)
    return (count, full, round(longest, 1), round(total / max(1e-9, t1 - t0), 1),
            round(longest_cpu, 1))


@contextlib.contextmanager
def gc_logged_router(registry: str, policy: str, label: str, src: Path | None,
                     flags: list[str], log_path: str) -> Iterator[bench_router.Target]:
    """bench_router's `pdreg router`, with the GC shim on its path (for it alone)."""
    shim = tempfile.mkdtemp(prefix="pdreg-router-gc-")
    Path(shim, "sitecustomize.py").write_text(_GC_SHIM)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PDREG_BENCH_ROUTER_GC_LOG")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (shim, saved["PYTHONPATH"]) if p)
    os.environ["PDREG_BENCH_ROUTER_GC_LOG"] = log_path
    bench_router.ROUTER_ARGS[:] = flags
    try:
        with bench_router.pdreg_router(registry, policy, label, src) as target:
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
def fleet(members: int, interval_s: float) -> Iterator[str]:
    """A registry, the 4 sim engines of `tiny`, and the generator's other members."""
    with registry_process(interval_s, 3 * interval_s,
                          extra=("--max-members", str(members + 1000))) as (address, _):
        engines = start_engines([{"role": role, "backend": "sim", "protocol": HANDSHAKE,
                                  "registry": address}
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
            yield address
        finally:
            ctl.put("end")
            with contextlib.suppress(Exception):
                out.get(timeout=60)
            if gen.pid is not None:
                gen.join(timeout=30)
            stop_all(engines)


def print_table(rows: list[Row], requests: int, policy: str) -> None:
    print(f"\n{requests} requests at c={bench_router.CONCURRENCY} per run, policy "
          f"{policy}; GC over the whole measurement\n")
    print("| router | members | CPU per request | p50 / p99 at c=32 | req/s | GCs "
          "(full) | longest GC (wall / the thread's CPU) | GC ms per s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cpu = f"{r.cpu_us_per_req:.0f} µs" if r.cpu_us_per_req is not None else "-"
        print(f"| {r.variant} | {r.members:,} | {cpu} | {r.p50_ms_c32:.1f} / "
              f"{r.p99_ms_c32:.1f} ms | {r.req_per_s_c32:,.0f} | {r.gc_count} ({r.gc_full}) "
              f"| {r.gc_max_ms} / {r.gc_max_cpu_ms} ms | {r.gc_ms_per_s} |")


def main() -> int:
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
    args = parser.parse_args()
    variants: list[tuple[str, Path | None, list[str]]] = [
        (v.strip(), None, v.split()[1:]) for v in args.variants.split(";") if v.strip()]
    trees = [(commit, source_tree(commit))
             for commit in args.baseline.split(",") if commit]
    variants[:0] = [(commit, Path(tmp), []) for commit, tmp in trees]
    if args.table or args.heap:
        for _ in range(args.repeat if args.table else 0):
            table(args.table, [*trees, ("this", str(BENCH.parent))])
        if args.heap:
            heap(args.heap, [*trees, ("this", str(BENCH.parent))])
        for _, tmp in trees:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    logs = tempfile.mkdtemp(prefix="pdreg-router-gc-logs-")
    rows: list[Row] = []
    try:
        for members in (int(m) for m in args.members.split(",")):
            with fleet(members, args.interval) as registry:
                for turn in range(args.repeat):
                    for name, src, flags in variants:
                        log_path = os.path.join(logs, f"{members}-{turn}-{len(rows)}.log")
                        with gc_logged_router(registry, args.policy, name, src,
                                              flags,
                                              log_path) as target:
                            t0 = time.time()
                            try:
                                row = bench_router.measure(target, HANDSHAKE, args.requests)
                            except RuntimeError as exc:  # never became ready: say so, go on
                                print(f"  {name}: {exc}", flush=True)
                                row = bench_router.Row(name, HANDSHAKE, failed=-1)
                            gc = gc_figures(log_path, t0, time.time())
                        rows.append(Row(name, members, row.cpu_us_per_req, row.p50_ms_c32,
                                        row.p99_ms_c32, row.req_per_s_c32, row.failed, *gc))
                        print(json.dumps(asdict(rows[-1])), flush=True)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        for _, tmp in trees:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, args.requests, args.policy)
    return 0



# --- the view's heap alone (--heap N): what a view of N members gives the collector ------

_HEAP_PROBE = """
import gc, json, sys, time
from registry.replica import Replica
from wire.protocol import (Endpoints, Load, LoadDigest, LoadEntry, MemberRecord, MemberSpec,
                           MemberState, Role, Snapshot)
n = int(sys.argv[1])
def spec(i):
    host = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
    return MemberSpec(id=f"decode-{i}", incarnation=1, role=Role.DECODE, model=f"m{i % 8}",
                      protocol="reference", endpoints=Endpoints(http=f"http://{host}:8000"),
                      labels={"zone": f"z{i % 4}", "rack": f"r{i % 32}"}, capacity=64)
records = [MemberRecord(spec(i), MemberState.READY, load=Load(running=i % 7),
                        heartbeat_at=time.time()) for i in range(n)]
gc.collect()
gc.freeze()  # what start-up made is out of the collector's walks (as a router's settle_heap)
replica = Replica("r")
t0 = time.perf_counter()
replica.apply_snapshot(Snapshot(1, 1, records, 5.0), time.monotonic(), time.time())
sync_ms = 1e3 * (time.perf_counter() - t0)
del records  # as a view drops the snapshot, and merges what changed:
replica.take_changed()
tracked = len(gc.get_objects())
t0 = time.perf_counter()
gc.collect()
full_ms = 1e3 * (time.perf_counter() - t0)
# A digest round of a fifth of the members (100k at a 5 s interval: 20k loads a second).
loads = [LoadEntry(f"decode-{i}", 1, Load(running=i % 5 + 1), 0.1) for i in range(0, n, 5)]
gcs = []
gc.callbacks.append(lambda phase, info: gcs.append(time.perf_counter()) if phase == "start"
                    else gcs.append(time.perf_counter() - gcs.pop()))
t0 = time.perf_counter()
for start in range(0, len(loads), 256):
    replica.apply(LoadDigest(1, 1, f"m{start % 8}", loads[start:start + 256], 5.0),
                  time.monotonic())
replica.take_changed()
digest_ms = 1e3 * (time.perf_counter() - t0)
print(json.dumps({"members": n, "sync_ms": round(sync_ms, 1), "tracked_after_sync": tracked,
                  "full_gc_ms": round(full_ms, 1), "digest_round_ms": round(digest_ms, 1),
                  "gcs_in_round": len(gcs), "longest_gc_ms": round(1e3 * max(gcs, default=0), 2)}))
"""


def heap(members: int, trees: list[tuple[str, str]]) -> None:
    """Per source tree, in its own process: a view's replica of `members` members."""
    import subprocess
    print("| router | members | tracked objects after the sync | a full collection "
          "| a digest round (a fifth of the loads) | collections in it, longest |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, src in trees:
        done = subprocess.run([sys.executable, "-c", _HEAP_PROBE, str(members)], cwd=src,
                              env={**os.environ, "PYTHONPATH": src},
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['members']:,} | {r['tracked_after_sync']:,} | "
              f"{r['full_gc_ms']} ms | {r['digest_round_ms']} ms | {r['gcs_in_round']}, "
              f"{r['longest_gc_ms']} ms |", flush=True)



# --- the router's table alone (--table N): what a view update costs the pairing table ---

_TABLE_PROBE = """
import gc, json, math, random, sys, time
import msgspec
from registry.client import LiveMember
from registry.frozen_map import FrozenMap
from router.inflight import InFlight
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.choice import NO_AFFINITY
from router.pairing import Pairing
from router.policies import make_pairer
from router.quarantine import Quarantine
from wire.protocol import Endpoints, Load, MemberRecord, MemberSpec, MemberState, Role
try:
    from registry.view_changes import ChangeTrail
except ImportError:  # a tree from before the view handed out its changes
    ChangeTrail = None
n, rounds, flips = (int(a) for a in sys.argv[1:4])
def member(i):
    host = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
    spec = MemberSpec(id=f"m-{i}", incarnation=1, role=(Role.PREFILL, Role.DECODE)[i % 2],
                      model=f"m{i % 8}", protocol="vllm-nixl",
                      endpoints=Endpoints(http=f"http://{host}:8000"))
    record = MemberRecord(spec, MemberState.READY, load=Load(running=i % 7))
    return LiveMember(record, record.load, time.monotonic(), "r")
class View:  # what MembershipView hands a router: the members, and what changed
    synced = True
    def __init__(self, members):
        self._members = members
        self._trail = ChangeTrail(members) if ChangeTrail else None
        if self._trail:
            self._trail.publish(members, list(members))
    def members(self): return self._members
    def changes(self, since): return self._trail.since(since)
    def loads(self, model, after, upto): return self._trail.loads(model, after, upto)
    def set(self, updates):
        old, self._members = self._members, self._members.updated(updates)
        if not self._trail:
            return
        if not hasattr(self._trail, "loads"):  # a trail from before loads went apart
            self._trail.publish(self._members, list(updates))
            return
        moved, loaded = [], {}  # as the view's merge tells them apart
        for i, new in updates.items():
            was = old.get(i)
            if was is not None and new is not None and was.record is new.record:
                loaded.setdefault(new.record.spec.model, []).append(i)
            else:
                moved.append(i)
        self._trail.publish(self._members, moved, loaded)
    def loads_confirmed_at(self, model): return -math.inf
    def report(self, *a): pass
def tiny(i):  # the model the router gets requests for: 2 prefills, 2 decodes
    spec = MemberSpec(id=f"tiny-{i}", incarnation=1, role=(Role.PREFILL, Role.DECODE)[i % 2],
                      model="tiny", protocol="vllm-nixl",
                      endpoints=Endpoints(http=f"http://10.9.0.{i}:8000"))
    record = MemberRecord(spec, MemberState.READY, load=Load(running=1))
    return LiveMember(record, record.load, time.monotonic(), "r")
view = View(FrozenMap({m.id: m for m in (*map(member, range(n)), *map(tiny, range(4)))}))
metrics, latency = RouterMetrics(), LatencyTracker()
pairing = Pairing(view, make_pairer("peak_ewma", latency=latency), locality_label="",
                  protocols={"vllm-nixl"}, quarantine=Quarantine(5.0),
                  in_flight=InFlight(metrics.in_flight_of), picks_of=metrics.picks_of,
                  latency=latency, clock=time.monotonic, on_members=lambda *a: None)
t0 = time.perf_counter(); pairing.table(); first_ms = 1e3 * (time.perf_counter() - t0)
gc.collect()
tracked = len(gc.get_objects())  # what every full collection walks, the table included
t0 = time.perf_counter(); gc.collect(); full_gc_ms = 1e3 * (time.perf_counter() - t0)
pauses = []
gc.callbacks.append(lambda phase, info: pauses.append(time.perf_counter()) if phase == "start"
                    else pauses.append(time.perf_counter() - pauses.pop()))
rng = random.Random(7)
request_cpu = [0.0]
def timed(updates):
    view.set(updates)
    t0 = time.process_time()
    pairing.table()
    spent = time.process_time() - t0
    t0 = time.process_time()  # then a request for tiny (after the whole table: free)
    pairing.choose("tiny", NO_AFFINITY, ())
    request_cpu[0] += time.process_time() - t0
    return spent
def as_request(updates):  # the update, then a request for tiny: what that request pays
    view.set(updates)
    t0 = time.process_time()
    pairing.choose("tiny", NO_AFFINITY, ())
    return time.process_time() - t0
digest = 0.0  # a digest: 50 members' loads (the same records)
for r in range(rounds):
    ids = [f"m-{rng.randrange(n)}" for _ in range(50)]
    digest += timed({i: msgspec.structs.replace(view.members()[i], load=Load(running=r % 9),
                                                load_at=time.monotonic()) for i in ids})
flip = 0.0  # a probe member flipping its state (a new record)
for r in range(flips):
    held = view.members()["m-3"]
    state = MemberState.DRAINING if r % 2 == 0 else MemberState.READY
    flip += timed({"m-3": msgspec.structs.replace(
        held, record=msgspec.structs.replace(held.record, state=state))})
served = 0.0  # digests of other models, each followed by a request for tiny
for r in range(rounds):
    ids = [f"m-{rng.randrange(n)}" for _ in range(50)]
    served += as_request({i: msgspec.structs.replace(
        view.members()[i], load=Load(running=r % 9 + 1), load_at=time.monotonic())
        for i in ids})
print(json.dumps({"members": n, "first_ms": round(first_ms, 1),
                  "digest_us": round(1e6 * digest / rounds, 1),
                  "flip_ms": round(1e3 * flip / flips, 2),
                  "request_after_digest_us": round(1e6 * served / rounds, 1),
                  "request_us": round(1e6 * request_cpu[0] / (rounds + flips), 1),
                  "tracked": tracked, "full_gc_ms": round(full_gc_ms, 1),
                  "gcs": len(pauses), "longest_gc_ms": round(1e3 * max(pauses, default=0), 2)}))
"""


def table(members: int, trees: list[tuple[str, str]], rounds: int = 200,
          flips: int = 20) -> None:
    """Per source tree, in its own process: what a view of `members` members costs the
    router's pairing table per load digest (50 loads) and per state flip (CPU time)."""
    import subprocess
    print("| router | members | first table | per digest (50 loads) | per state flip | a "
          "request for tiny after a digest of others | tracked objects | a full "
          "collection | collections in the rounds (longest) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, src in trees:
        done = subprocess.run([sys.executable, "-c", _TABLE_PROBE, str(members), str(rounds),
                               str(flips)], cwd=src, env={**os.environ, "PYTHONPATH": src},
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['members']:,} | {r['first_ms']} ms | {r['digest_us']} µs | "
              f"{r['flip_ms']} ms | {r['request_after_digest_us']} µs | {r['tracked']:,} | "
              f"{r['full_gc_ms']} ms | {r['gcs']} ({r['longest_gc_ms']} ms) |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
