"""bench_router_scale's probes without a fleet, each per source tree in its own process:
`heap` (--heap N: what a view of N members gives the collector), `table` (--table N:
what view updates cost a router's pairing table, and a request for another model),
`collections` (--gc N) and `stages` (--stages N: a load change's CPU in the view, by step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["collections", "heap", "stages", "table"]


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
getattr(replica, "take_loaded", lambda: None)()  # (a tree that lists loads apart)
digest_ms = 1e3 * (time.perf_counter() - t0)
print(json.dumps({"members": n, "sync_ms": round(sync_ms, 1), "tracked_after_sync": tracked,
                  "full_gc_ms": round(full_ms, 1), "digest_round_ms": round(digest_ms, 1),
                  "gcs_in_round": len(gcs), "longest_gc_ms": round(1e3 * max(gcs, default=0), 2)}))
"""


def heap(members: int, trees: list[tuple[str, str]]) -> None:
    """Per source tree, in its own process: a view's replica of `members` members."""
    print("| router | members | tracked objects after the sync | a full collection "
          "| a digest round (a fifth of the loads) | collections in it, longest |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, src in trees:
        r = _probe(name, src, _HEAP_PROBE, members)
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
    def ask(self, model): pass
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
    print("| router | members | first table | per digest (50 loads) | per state flip | a "
          "request for tiny after a digest of others | tracked objects | a full "
          "collection | collections in the rounds (longest) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, src in trees:
        r = _probe(name, src, _TABLE_PROBE, members, rounds, flips)
        print(f"| {name} | {r['members']:,} | {r['first_ms']} ms | {r['digest_us']} µs | "
              f"{r['flip_ms']} ms | {r['request_after_digest_us']} µs | {r['tracked']:,} | "
              f"{r['full_gc_ms']} ms | {r['gcs']} ({r['longest_gc_ms']} ms) |", flush=True)


# --- a router's collections alone (--gc N): what each step of following N members costs --

_GC_PROBE = """
import gc, json, math, sys, time
import msgspec
from registry.merge import Merge
from registry.replica import Replica
from registry.view_changes import ChangeTrail
from router.choice import NO_AFFINITY
from router.inflight import InFlight
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.pairing import Pairing
from router.policies import make_pairer
from router.quarantine import Quarantine
from wire.protocol import (Endpoints, Load, LoadDigest, LoadEntry, MemberRecord, MemberSpec,
                           MemberState, MemberUpdated, Role, Snapshot, event_decoder,
                           make_encoder, reply_decoder)
n, rounds = (int(a) for a in sys.argv[1:3])
encode = make_encoder().encode
def spec(i, model=None):  # as bench_scale's fleet registers them: labels, a capacity
    host = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
    return MemberSpec(id=f"m-{i}", incarnation=1, role=(Role.PREFILL, Role.DECODE)[i % 2],
                      model=model or f"m{i % 8}", protocol="vllm-nixl",
                      endpoints=Endpoints(http=f"http://{host}:8000", kv_host=host,
                                          kv_port=5600),
                      labels={"zone": f"z{i % 4}", "rack": f"r{i % 32}"}, capacity=64)
def snapshot(version, load):
    records = [MemberRecord(spec(i), MemberState.READY, load=Load(running=(i + load) % 7))
               for i in range(n)]
    records += [MemberRecord(spec(n + i, "tiny"), MemberState.READY) for i in range(4)]
    return encode(Snapshot(1, version, records, 20.0))
class View:  # MembershipView's view thread, without its sockets: the same steps
    synced = True
    def __init__(self):
        self.replica = Replica("r")
        self.merge = Merge([self.replica])
        self.trail = ChangeTrail(self.merge.members)
        self.merge.heard(0, time.monotonic())
    def publish(self):
        now = time.monotonic()
        self.merge.heard(0, now)
        if self.merge.update(now):
            self.trail.publish(self.merge.members, self.merge.last_changed,
                               self.merge.last_loaded)
    def members(self): return self.merge.members
    def changes(self, since): return self.trail.since(since)
    def loads(self, model, after, upto): return self.trail.loads(model, after, upto)
    def loads_confirmed_at(self, model): return -math.inf
    def ask(self, model): pass
    def report(self, *a): pass
phase = ["start-up"]
figures = {}
clock = [0.0]
def timed(stage, info):
    if stage == "start":
        clock[0] = time.thread_time()
        return
    took = 1e3 * (time.thread_time() - clock[0])
    count, longest = figures.get(phase[0], (0, 0.0))
    figures[phase[0]] = (count + 1, max(longest, took))
gc.callbacks.append(timed)
view, decode_reply, decode_event = View(), reply_decoder(), event_decoder()
metrics, latency = RouterMetrics(), LatencyTracker()
pairing = Pairing(view, make_pairer("peak_ewma", latency=latency), locality_label="",
                  protocols={"vllm-nixl"}, quarantine=Quarantine(5.0),
                  in_flight=InFlight(metrics.in_flight_of), picks_of=metrics.picks_of,
                  latency=latency, clock=time.monotonic, on_members=lambda *a: None)
pairing.choose("tiny", NO_AFFINITY, ())  # a router reads its empty view before the sync
first = snapshot(1, 0)
gc.collect(); gc.freeze(); gc.set_threshold(20_000, 10, 10)  # as settle_heap
def sync(payload):
    view.replica.apply_snapshot(decode_reply.decode(payload), time.monotonic(), time.time())
    view.publish()
    pairing.choose("tiny", NO_AFFINITY, ())
spent = {}
def step(name, work):
    phase[0] = name
    t0 = time.process_time()
    work()
    spent[name] = time.process_time() - t0
    phase[0] = "after " + name
    gc.collect(1)  # the young collection that comes next: what the step left behind
step("first sync", lambda: sync(first))
digests = [encode(LoadDigest(1, 1, f"m{r % 8}", [LoadEntry(f"m-{(r * 250 + j * 8 + r % 8) % n}",
           1, Load(running=(r + j) % 9), 0.1) for j in range(250)], 20.0))
           for r in range(rounds)]
def steady():
    for r, payload in enumerate(digests):
        view.replica.apply(decode_event.decode(payload), time.monotonic())
        if r % 10 == 0:  # a member flips its state (a new record, its model's pools remade)
            held = view.replica.members["m-8"].record
            state = MemberState.DRAINING if r % 20 == 0 else MemberState.READY
            version = view.replica.version + 1
            view.replica.apply(decode_event.decode(encode(MemberUpdated(
                1, version, msgspec.structs.replace(held, state=state)))), time.monotonic())
            again_version[0] = version
        view.publish()
        pairing.choose("tiny", NO_AFFINITY, ())
again_version = [1]
step("digests and flips", steady)
phase[0] = "start-up"
payload = snapshot(again_version[0], 5)  # (made before the step: not the router's work)
step("resync", lambda: sync(payload))
print(json.dumps({"members": n, **{k: [v[0], round(v[1], 2)] for k, v in figures.items()},
                  "per_load_us": round(1e6 * spent["digests and flips"] / (rounds * 250), 2),
                  "resync_ms": round(1e3 * spent["resync"], 1)}))
"""

PHASES = ("first sync", "after first sync", "digests and flips", "after digests and flips",
          "resync", "after resync")


def collections(members: int, trees: list[tuple[str, str]], rounds: int = 400) -> None:
    """Per source tree, in its own process: the collections (count, the longest by CPU)
    that a router's view and table cause while following `members` members: the first
    sync, `rounds` digests of 250 loads with a state flip every 10, a resync; and the
    young collection right after each (what it left for the collector). Also the CPU
    per load change of the digests (view and table together) and of the resync."""
    print("| tree | members | " + " | ".join(PHASES) + " | CPU per load change | a "
          "resync |")
    print("|---|---:|" + "---:|" * (len(PHASES) + 2))
    for name, src in trees:
        r = _probe(name, src, _GC_PROBE, members, rounds)
        cells = [f"{r[p][0]}, {r[p][1]} ms" if p in r else "0" for p in PHASES]
        print(f"| {name} | {r['members']:,} | " + " | ".join(cells) + f" | "
              f"{r['per_load_us']} µs | {r['resync_ms']} ms |", flush=True)


_STAGES_PROBE = """
import gc, json, sys, time
from registry.merge import Merge
from registry.replica import Replica
from registry.view_changes import ChangeTrail
from wire.protocol import (Endpoints, Load, LoadDigest, LoadEntry, MemberRecord, MemberSpec,
                           MemberState, Role, Snapshot, event_decoder, make_encoder)
n, rounds, on_demand = (int(a) for a in sys.argv[1:4])
def spec(i):
    host = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
    return MemberSpec(id=f"m-{i}", incarnation=1, role=(Role.PREFILL, Role.DECODE)[i % 2],
                      model=f"m{i % 8}", protocol="vllm-nixl",
                      endpoints=Endpoints(http=f"http://{host}:8000", kv_host=host,
                                          kv_port=5600),
                      labels={"zone": f"z{i % 4}", "rack": f"r{i % 32}"}, capacity=64)
# on_demand: a router's view, asked for `tiny` alone (the digests' models passed over)
replica = Replica("r", loads_on_demand=True) if on_demand else Replica("r")
replica.want({"tiny"}) if on_demand else None
merge = Merge([replica]); trail = ChangeTrail(merge.members)
now = time.monotonic()
replica.apply_snapshot(Snapshot(1, 1, [MemberRecord(spec(i), MemberState.READY)
                                       for i in range(n)], 5.0), now, time.time())
merge.heard(0, now); merge.update(now)
trail.publish(merge.members, merge.last_changed, merge.last_loaded)
gc.collect(); gc.freeze(); gc.set_threshold(20_000, 10, 10)  # as settle_heap
encode = make_encoder().encode  # a digest per model, 250 of its members' loads each
digests = [encode(LoadDigest(1, 1, f"m{r % 8}", [LoadEntry(
    f"m-{((r * 250 + j) * 8 + r % 8) % n}", 1, Load(running=(r + j) % 9 + 1), 0.1)
    for j in range(250)], 5.0)) for r in range(rounds)]
if on_demand:  # the digests of a model not followed are read no further than versions
    from registry.view_demand import event_head_decoder as event_decoder
decode, clock = event_decoder().decode, time.process_time
spent = dict.fromkeys(("decode", "replica", "merge", "trail"), 0.0)
for payload in digests:  # the view thread's steps for one digest, each timed
    t0 = clock(); event = decode(payload); t1 = clock()
    replica.apply(event, time.monotonic()); t2 = clock()
    now = time.monotonic(); merge.heard(0, now); merge.update(now); t3 = clock()
    trail.publish(merge.members, merge.last_changed, merge.last_loaded); t4 = clock()
    for stage, took in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
        spent[stage] += took
print(json.dumps({k: round(1e6 * v / (rounds * 250), 2) for k, v in spent.items()}))
"""


def stages(members: int, trees: list[tuple[str, str]], rounds: int = 400) -> None:
    """Per source tree, in its own process: the view's CPU per load change at `members`
    members (a router of every model following 100k at a 5 s interval takes ~20,000 a
    second), by step: decoding digests of 250 loads, the replica, the merge, the trail.
    Then, for a tree whose view has loads on demand, the same for a router asked for
    another model (the digests passed over)."""
    print("| tree | view | members | decode | replica | merge | trail | a load change |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for on_demand, view in ((0, "eager"), (1, "loads on demand")):
        for name, src in trees:
            try:
                r = _probe(name, src, _STAGES_PROBE, members, rounds, on_demand)
            except RuntimeError:
                if not on_demand:
                    raise
                continue  # (a tree from before loads on demand)
            print(f"| {name} | {view} | {members:,} | "
                  + " | ".join(f"{v} µs" for v in r.values())
                  + f" | {round(sum(r.values()), 2)} µs |", flush=True)


def _probe(name: str, src: str, code: str, *args: int) -> dict[str, Any]:
    """Run probe `code` with `args` against source tree `src` in its own process; the
    JSON line it prints last."""
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=src,
                          env={**os.environ, "PYTHONPATH": src}, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
