"""What one `/metrics` scrape of the registry costs as the fleet grows, and what keeping
its counts costs a heartbeat.

    .venv/bin/python bench/bench_metrics_scrape.py [--members 10000,100000] [--baseline REV]
    .venv/bin/python bench/bench_metrics_scrape.py --heartbeats 50000 --baseline REV

Scrape: a `Membership` of N members over MODELS models (heartbeats spread over 5 s) and
the registry's collector (`registry.metrics`), rendered as the HTTP thread does for a
scrape while a second thread stands in for the registry loop: it wakes every 0.1 ms
(releasing the GIL, as the loop does in every libzmq call) and records how late each wake
is. Reported per N: scrape bytes and series, render time, the loop thread's longest and
p99 wait while the scrape ran and all it waited (beyond the 0.1 ms it slept), and the
loop's own work for the scrape (this tree: copying
the counts; a tree whose collector reads the published snapshot: rebuilding every record
heartbeats made stale and the snapshot's tuple). With --baseline, the same for
`registry/metrics.py` of that commit, side by side.

Heartbeats (--heartbeats K): `Membership.heartbeat` over K pre-signed heartbeats to a
fleet of --fleet members, this tree's and the baseline's membership.py in turns (ROUNDS
rounds each); reported: ns per heartbeat, per round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` and pdreg

from bench.procs import ROOT
from bench.scale.fleet import MODELS, member_spec
from registry import sessions
from registry.admission import Limits
from registry.membership import Membership
from registry.metrics import PER_MEMBER_SERIES_MAX, LoopStats
from registry.published import Published
from wire.protocol import Heartbeat, Load, MemberState, make_encoder

SPREAD_S = 5.0  # heartbeat times spread over one interval, as in a healthy fleet
ROUNDS = 5
WAKE_S = 0.0001  # the stand-in loop wakes this often
SESSION = b"s" * sessions.SESSION_BYTES  # one session for all: pre-signed beats fit any tree


def fleet(membership_class: Any, members: int, start: float) -> Any:
    """`members` members, member i last heard at start + SPREAD_S * i / members."""
    m = membership_class(1, limits=Limits(max_members=max(members, 1)),
                         wall_offset=time.time() - time.monotonic(),
                         new_session=lambda: SESSION)
    for i in range(members):
        m.register(member_spec(f"decode-{i}", f"m{i % MODELS}", i), MemberState.READY,
                   Load(running=i % 7), start + SPREAD_S * i / members, nonce=b"n")
    return m


def load_rev(rev: str, path: str) -> ModuleType:
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                            check=True, capture_output=True, text=True).stdout
    name = os.path.basename(path).removesuffix(".py") + "_rev"
    file = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(file, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def loop_work(module: ModuleType, m: Membership, now: float) -> tuple[Any, float]:
    """What the loop builds for a scrape, and how long it takes (every record stale, as
    after 10 s of heartbeats at 100k)."""
    t0 = time.perf_counter()
    if hasattr(module, "FleetFigures"):  # this design: the counts, copied
        source = m.figures(now, PER_MEMBER_SERIES_MAX)
    else:  # a collector that reads the published snapshot
        m._stale.update(m._members)
        t0 = time.perf_counter()
        m.refresh_some_records(len(m))
        source = Published(epoch=1, version=m.version, members=tuple(m.records()),
                           heartbeat_interval_s=5.0, lease_s=15.0, self_preserving=False,
                           taken_at=now + m.wall_offset)
    return source, time.perf_counter() - t0


def scrape(module: ModuleType, m: Membership, now: float) -> dict[str, float]:
    source, loop_s = loop_work(module, m, now)
    registry = module.make_metrics_registry(LoopStats(), lambda: source)
    waits: list[float] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(WAKE_S)
            waits.append(time.perf_counter() - t)

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.05)
    waits.clear()
    t0 = time.perf_counter()
    text = generate_latest(registry)
    took = time.perf_counter() - t0
    stop.set()
    thread.join()
    waits.sort()
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return {"members": len(m), "bytes": len(text), "series": series,
            "render_ms": round(1e3 * took, 2),
            "loop_wait_max_ms": round(1e3 * waits[-1], 2) if waits else 0.0,
            "loop_wait_p99_ms": round(1e3 * waits[int(0.99 * (len(waits) - 1))], 2)
            if waits else 0.0,
            "loop_waited_ms": round(1e3 * sum(w - WAKE_S for w in waits), 2),
            "loop_work_ms": round(1e3 * loop_s, 2)}


def heartbeats(classes: list[tuple[str, Any]], members: int, beats: int) -> None:
    encode = make_encoder().encode
    start = time.monotonic()
    fleets = {name: fleet(cls, members, start) for name, cls in classes}
    now = start + SPREAD_S
    for round_ in range(ROUNDS):
        signed = []
        for k in range(beats):
            i = (k * 7919) % members  # spread over the fleet, each once per round
            beat = Heartbeat(f"decode-{i}", 1, round_ + 1, MemberState.READY,
                             Load(running=i % 7))
            payload = sessions.seal(SESSION, encode(beat))
            signed.append((msgspec.msgpack.decode(payload, type=Heartbeat), payload))
        now += SPREAD_S
        for name, _ in classes:
            heartbeat = fleets[name].heartbeat
            t0 = time.perf_counter()
            for k, (beat, payload) in enumerate(signed):
                heartbeat(beat, payload, now + k * 1e-4)
            took = time.perf_counter() - t0
            print(json.dumps({"tree": name, "round": round_, "members": members,
                              "heartbeats": beats,
                              "ns_per_heartbeat": round(1e9 * took / beats)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="10000,100000")
    parser.add_argument("--baseline", default="", help="a commit to run beside this tree")
    parser.add_argument("--heartbeats", type=int, default=0,
                        help="measure Membership.heartbeat instead, over this many")
    parser.add_argument("--fleet", type=int, default=100_000, help="with --heartbeats")
    args = parser.parse_args()
    if args.heartbeats:
        classes: list[tuple[str, Any]] = [("this", Membership)]
        if args.baseline:
            old = load_rev(args.baseline, "registry/membership.py").Membership
            classes.insert(0, (args.baseline, old))
        heartbeats(classes, args.fleet, args.heartbeats)
        return
    import registry.metrics as this
    trees: list[tuple[str, ModuleType]] = [("this", this)]
    if args.baseline:
        trees.insert(0, (args.baseline, load_rev(args.baseline, "registry/metrics.py")))
    for members in [int(n) for n in args.members.split(",")]:
        start = time.monotonic() - SPREAD_S
        m = fleet(Membership, members, start)
        for name, module in trees:
            print(json.dumps({"tree": name, **scrape(module, m, time.monotonic())}),
                  flush=True)


if __name__ == "__main__":
    main()
