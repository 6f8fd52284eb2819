"""Registry benchmarks: heartbeat ingest, event propagation, snapshot size and time.

    .venv/bin/python bench/bench_registry.py [--quick]

Each figure runs the registry as its own process (`pdreg registry`), the way it is
deployed, and drives it from this one over loopback:

1. ingest: simulated members (a separate process) pipeline heartbeats as fast as the
   registry answers; the registry does full processing (decode, validate, membership,
   reply, digests). Compared with a bare pyzmq+msgspec receive loop.
2. propagation: with 1,000 members registered, a member changes state; the time until a
   `MembershipView` in this process sees the event (p50/p99).
3. snapshot: with 10,000 members, a Sync round trip (request -> decoded snapshot), its
   encoded size per member, and the registry's resident memory per member.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdreg.testing import die_with_parent  # noqa: E402
from registry.client import MembershipView, request_snapshot  # noqa: E402
from registry.protocol import (  # noqa: E402
    Endpoints,
    Heartbeat,
    Load,
    MemberSpec,
    MemberState,
    Register,
    Role,
    control_decoder,
    make_encoder,
)


@contextmanager
def registry_process(interval_s: float = 1.0, lease_s: float = 30.0) -> Iterator[tuple[str, int]]:
    """A `pdreg registry` child on OS-chosen ports; yields (control address, pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "registry", "--port", "0",
         "--events-port", "0", "--http-port", "-1", "--heartbeat-interval", str(interval_s),
         "--lease", str(lease_s)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        preexec_fn=die_with_parent)
    try:
        line = proc.stdout.readline()
        address = line.split("control ")[1].split()[0]
        yield address, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def spec(i: int) -> MemberSpec:
    role = Role.PREFILL if i % 2 else Role.DECODE
    return MemberSpec(id=f"m-{i}", incarnation=1, role=role, model="bench", protocol="reference",
                      endpoints=Endpoints(http=f"http://10.0.{i // 250}.{i % 250}:8000",
                                          kv_host=f"10.0.{i // 250}.{i % 250}", kv_port=5600),
                      labels={"zone": f"z{i % 4}", "rack": f"r{i % 32}"}, capacity=64)


def register_members(address: str, count: int, start: int = 0) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{address}")
    encoder = make_encoder()
    for i in range(start, start + count):
        sock.send(encoder.encode(Register(spec=spec(i), state=MemberState.READY)))
    for _ in range(count):
        sock.recv()
    sock.close(linger=0)


def _flood(address: str, members: int, seconds: float, window: int, out: mp.Queue) -> None:
    """Child process: pipeline heartbeats, keeping `window` unanswered at a time."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(f"tcp://{address}")
    encoder = make_encoder()
    beats = [encoder.encode(Heartbeat(f"m-{i}", 1, 1, MemberState.READY,
                                      Load(i % 7, i % 3, (i % 10) / 10)))
             for i in range(members)]
    sent = received = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        while sent - received < window:
            sock.send(beats[sent % members], zmq.NOBLOCK)
            sent += 1
        sock.poll(100)
        try:
            while True:
                sock.recv(zmq.NOBLOCK)
                received += 1
        except zmq.Again:
            pass
    out.put(received)
    sock.close(linger=0)
    ctx.term()


def bench_ingest(seconds: float) -> dict[str, float]:
    members = 1000
    with registry_process() as (address, _pid):
        register_members(address, members)
        out: mp.Queue = mp.Queue()
        child = mp.Process(target=_flood, args=(address, members, seconds, 2000, out))
        start = time.perf_counter()
        child.start()
        answered = out.get(timeout=seconds + 30)
        elapsed = time.perf_counter() - start
        child.join()
    return {"heartbeats_per_s": answered / elapsed}


def _bare_receiver(port_out: mp.Queue, seconds: float, out: mp.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    port_out.put(port)
    decoder = control_decoder()
    count = 0
    deadline = time.perf_counter() + seconds + 5
    while time.perf_counter() < deadline:
        if not sock.poll(100):
            continue
        while True:
            try:
                identity, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            decoder.decode(payload)
            sock.send_multipart((identity, b"ok"))
            count += 1
    out.put(count)


def bench_bare(seconds: float) -> float:
    """The floor: a bare ROUTER that decodes and answers, nothing else."""
    port_q: mp.Queue = mp.Queue()
    count_q: mp.Queue = mp.Queue()
    receiver = mp.Process(target=_bare_receiver, args=(port_q, seconds, count_q))
    receiver.start()
    address = f"127.0.0.1:{port_q.get(timeout=10)}"
    out: mp.Queue = mp.Queue()
    child = mp.Process(target=_flood, args=(address, 1000, seconds, 2000, out))
    start = time.perf_counter()
    child.start()
    answered = out.get(timeout=seconds + 30)
    elapsed = time.perf_counter() - start
    child.join()
    receiver.terminate()
    return answered / elapsed


def bench_propagation(samples: int) -> dict[str, float]:
    members = 1000
    with registry_process() as (address, _pid):
        register_members(address, members)
        with MembershipView(address) as view:
            assert view.wait_for(lambda m: len(m) == members, 30)
            seen = threading.Event()
            target: dict[str, object] = {}

            def listener(current) -> None:
                member = current.get(target.get("id", ""))
                if member is not None and member.record.state is target.get("state"):
                    seen.set()

            view.add_listener(listener)
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.connect(f"tcp://{address}")
            encoder = make_encoder()
            latencies = []
            for n in range(samples):
                i = n % members
                # READY -> JOINING -> READY ...: every heartbeat is a membership change.
                state = MemberState.JOINING if (n // members) % 2 == 0 else MemberState.READY
                target.update(id=f"m-{i}", state=state)
                seen.clear()
                start = time.perf_counter()
                sock.send(encoder.encode(Heartbeat(f"m-{i}", 1, n + 2, state, Load())))
                if not seen.wait(5):
                    raise RuntimeError("event never reached the view")
                latencies.append(time.perf_counter() - start)
                sock.recv()
            sock.close(linger=0)
    latencies.sort()
    return {"p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
            "max_ms": 1e3 * latencies[-1]}


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def bench_snapshot(members: int, rounds: int) -> dict[str, float]:
    with registry_process() as (address, pid):
        request_snapshot(address)
        before = _rss_bytes(pid)
        for start in range(0, members, 1000):
            register_members(address, min(1000, members - start), start)
        after = _rss_bytes(pid)
        times = []
        size = 0
        for _ in range(rounds):
            start = time.perf_counter()
            snapshot = request_snapshot(address, timeout_s=10)
            times.append(time.perf_counter() - start)
            assert len(snapshot.members) == members
        size = len(msgspec.msgpack.encode(snapshot))
    return {"sync_ms_median": 1e3 * statistics.median(times),
            "sync_ms_max": 1e3 * max(times),
            "wire_bytes_per_member": size / members,
            "rss_bytes_per_member": (after - before) / members}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else 8.0
    print("registry benchmarks (2-core machine, loopback)")
    bare = bench_bare(seconds)
    print(f"  bare pyzmq+msgspec ROUTER loop:      {bare:10,.0f} heartbeats/s")
    ingest = bench_ingest(seconds)
    print(f"  registry, full processing:           {ingest['heartbeats_per_s']:10,.0f} "
          f"heartbeats/s ({ingest['heartbeats_per_s'] / bare:.0%} of bare)")
    prop = bench_propagation(200 if args.quick else 2000)
    print(f"  propagation to a MembershipView @1k: p50 {prop['p50_ms']:.2f} ms, "
          f"p99 {prop['p99_ms']:.2f} ms, max {prop['max_ms']:.2f} ms")
    snap = bench_snapshot(2000 if args.quick else 10_000, 3 if args.quick else 10)
    print(f"  snapshot @{2000 if args.quick else 10_000}: sync {snap['sync_ms_median']:.1f} ms "
          f"median ({snap['sync_ms_max']:.1f} max), {snap['wire_bytes_per_member']:.0f} B/member "
          f"on the wire, {snap['rss_bytes_per_member']:.0f} B/member resident")
    return 0


if __name__ == "__main__":
    sys.exit(main())
