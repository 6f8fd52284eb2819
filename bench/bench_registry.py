"""Registry benchmarks: heartbeat ingest, event propagation, snapshot size and time.

    .venv/bin/python bench/bench_registry.py [--quick] [--baseline-src DIR]
                                             [--same-protocol-src DIR]

Each figure runs the registry as its own process (`pdreg registry`), the way it is
deployed, and drives it from this one over loopback:

1. ingest: simulated members (a separate process) pipeline heartbeats as fast as the
   registry answers; the registry does full processing (decode, session proof and seq,
   membership, reply, digests). Side by side in one run: a bare pyzmq+msgspec receive
   loop (the floor), the registry with sessions checked, the same with CURVE on both
   sockets, and, with `--baseline-src DIR` (a source tree of an older pdreg, e.g.
   `git archive b216f1c | tar -x -C DIR`), that registry without sessions; with
   `--same-protocol-src DIR`, the registry of that tree under the same signed flood
   (to compare a change against the main it branched from).
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
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` and pdreg

from bench.procs import ROOT, cpu_s, registry_process, rss_bytes
from registry import sessions
from registry.client import MembershipView, request_snapshot
from registry.security import ClientCurve, generate_keys
from wire.protocol import (
    Endpoints,
    Heartbeat,
    Load,
    MemberSpec,
    MemberState,
    Register,
    Role,
    control_decoder,
    make_encoder,
    reply_decoder,
)

INGEST_MEMBERS = 1000
_PROOF_FIELD_BYTES = 2 + sessions.PROOF_BYTES  # msgpack bin8 header + the proof
MAX_FLOOD_PER_S = 150_000  # signed heartbeats prepared per second of flood (more than
                           # any receiver here answers; the flood stops early if not)


def _without_proof(payload: bytes) -> bytes:
    """A protocol-2 heartbeat as protocol 1 sent it: the same array, one element (the
    trailing proof) shorter. The first byte is the fixarray header, holding the count."""
    return bytes((payload[0] - 1,)) + payload[1:-_PROOF_FIELD_BYTES]


def spec(i: int) -> MemberSpec:
    role = Role.PREFILL if i % 2 else Role.DECODE
    return MemberSpec(id=f"m-{i}", incarnation=1, role=role, model="bench", protocol="reference",
                      endpoints=Endpoints(http=f"http://10.0.{i // 250}.{i % 250}:8000",
                                          kv_host=f"10.0.{i // 250}.{i % 250}", kv_port=5600),
                      labels={"zone": f"z{i % 4}", "rack": f"r{i % 32}"}, capacity=64)


def register_members(address: str, count: int, start: int = 0, *,
                     curve: ClientCurve | None = None) -> dict[str, bytes]:
    """Register members m-START.. and return their sessions."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        curve.apply(sock)
    sock.connect(f"tcp://{address}")
    encoder, decoder = make_encoder(), reply_decoder()
    for i in range(start, start + count):
        sock.send(encoder.encode(Register(spec=spec(i), nonce=sessions.new_nonce(),
                                          state=MemberState.READY)))
    found = {}
    for i in range(start, start + count):
        found[f"m-{i}"] = decoder.decode(sock.recv()).session
    sock.close(linger=0)
    return found


def register_members_v1(address: str, count: int) -> None:
    """Register on a registry that speaks protocol version 1 (no nonce, no sessions)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{address}")
    for i in range(count):
        sock.send(msgspec.msgpack.encode(["Register", msgspec.to_builtins(spec(i)),
                                          int(MemberState.READY)]))
    for _ in range(count):
        sock.recv()
    sock.close(linger=0)


def _flood(address: str, members: int, seconds: float, window: int, out: mp.Queue,
           signed: bool, curve: ClientCurve | None) -> None:
    """Child process: pipeline heartbeats, keeping `window` unanswered at a time.

    Every message is built before the clock starts, so the flood costs the shared cores
    one send per message and the registry is what limits the rate. With `signed`, it
    registers its members and prepares each heartbeat with a fresh seq and its session
    proof, as agents send them; else protocol-1 heartbeats without a proof (what a
    registry without sessions accepts), cycled as before sessions existed.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        curve.apply(sock)
    sock.connect(f"tcp://{address}")
    encode = make_encoder().encode
    ids = [f"m-{i}" for i in range(members)]
    loads = [Load(i % 7, i % 3, (i % 10) / 10) for i in range(members)]
    if signed:
        held = register_members(address, members, curve=curve)
        keys = [held[member_id] for member_id in ids]
        messages = [sessions.seal(keys[j % members], encode(Heartbeat(
            ids[j % members], 1, j // members + 1, MemberState.READY, loads[j % members])))
            for j in range(int(seconds * MAX_FLOOD_PER_S))]
    else:
        messages = [_without_proof(encode(Heartbeat(ids[i], 1, 1, MemberState.READY,
                                                     loads[i]))) for i in range(members)]
    out.put("flooding")
    cycle = not signed
    count = len(messages)
    sent = received = 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline and (cycle or sent < count):
        while sent - received < window and (cycle or sent < count):
            sock.send(messages[sent % count], zmq.NOBLOCK)
            sent += 1
        sock.poll(100)
        try:
            while True:
                sock.recv(zmq.NOBLOCK)
                received += 1
        except zmq.Again:
            pass
    out.put((received, time.perf_counter() - started))
    sock.close(linger=0)
    ctx.term()


@dataclass(frozen=True)
class Ingest:
    heartbeats_per_s: float
    cpu_us_per_heartbeat: float  # the receiving process's CPU (all its threads)


def _drive(address: str, pid: int, seconds: float, *, signed: bool,
           curve: ClientCurve | None = None) -> Ingest:
    out: mp.Queue = mp.Queue()
    child = mp.Process(target=_flood, args=(address, INGEST_MEMBERS, seconds, 2000, out,
                                            signed, curve))
    child.start()
    assert out.get(timeout=120) == "flooding"  # messages built, members registered
    cpu_before = cpu_s(pid)
    answered, elapsed = out.get(timeout=seconds + 60)
    cpu = cpu_s(pid) - cpu_before
    child.join()
    return Ingest(answered / elapsed, 1e6 * cpu / max(1, answered))


def bench_ingest(seconds: float, *, curve_keys: str | None = None,
                 src: str | Path = ROOT) -> Ingest:
    """The registry with sessions checked (and CURVE on both sockets, given keys), from
    source tree `src` (this one by default; another of the same protocol version)."""
    extra: tuple[str, ...] = ()
    curve = None
    if curve_keys is not None:
        extra = ("--curve-secret-key", os.path.join(curve_keys, "registry.key_secret"))
        curve = ClientCurve.from_files(os.path.join(curve_keys, "registry.key"),
                                       os.path.join(curve_keys, "client.key_secret"))
    with registry_process(extra=extra, src=src) as (address, pid):
        return _drive(address, pid, seconds, signed=True, curve=curve)


def bench_baseline(seconds: float, src: str) -> Ingest:
    """The registry of another source tree (protocol 1: no sessions), same flood."""
    with registry_process(src=src) as (address, pid):
        register_members_v1(address, INGEST_MEMBERS)
        return _drive(address, pid, seconds, signed=False)


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
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            decoder.decode(frames[1])
            sock.send_multipart((frames[0], b"ok"))
            count += 1
    out.put(count)


def bench_bare(seconds: float) -> Ingest:
    """The floor: a bare ROUTER that decodes and answers, nothing else (same flood)."""
    port_q: mp.Queue = mp.Queue()
    count_q: mp.Queue = mp.Queue()
    receiver = mp.Process(target=_bare_receiver, args=(port_q, seconds, count_q))
    receiver.start()
    address = f"127.0.0.1:{port_q.get(timeout=10)}"
    result = _drive(address, receiver.pid, seconds, signed=False)
    receiver.terminate()
    return result


def bench_propagation(samples: int) -> dict[str, float]:
    members = 1000
    with registry_process() as (address, _pid):
        held = register_members(address, members)
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
                payload = encoder.encode(Heartbeat(f"m-{i}", 1, n + 2, state, Load()))
                sock.send(sessions.seal(held[f"m-{i}"], payload))
                if not seen.wait(5):
                    raise RuntimeError("event never reached the view")
                latencies.append(time.perf_counter() - start)
                sock.recv()
            sock.close(linger=0)
    latencies.sort()
    return {"p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
            "max_ms": 1e3 * latencies[-1]}


def bench_snapshot(members: int, rounds: int) -> dict[str, float]:
    with registry_process() as (address, pid):
        request_snapshot(address)
        before = rss_bytes(pid)
        for start in range(0, members, 1000):
            register_members(address, min(1000, members - start), start)
        after = rss_bytes(pid)
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


def _median(results: list[Ingest]) -> Ingest:
    return Ingest(statistics.median(r.heartbeats_per_s for r in results),
                  statistics.median(r.cpu_us_per_heartbeat for r in results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="ingest rounds, interleaved (default 3, quick 1); medians shown")
    parser.add_argument("--baseline-src", metavar="DIR", default=None,
                        help="also measure the registry of this source tree (protocol 1)")
    parser.add_argument("--same-protocol-src", metavar="DIR", default=None,
                        help="also measure the registry of this source tree (same protocol "
                             "version, sessions checked), e.g. main before a change")
    parser.add_argument("--ingest-only", action="store_true",
                        help="skip the propagation and snapshot figures")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else 8.0
    rounds = args.rounds or (1 if args.quick else 3)
    print("registry benchmarks (2-core machine, loopback)")
    figures: dict[str, list[Ingest]] = {}
    with tempfile.TemporaryDirectory() as keys:
        generate_keys(keys, "registry")
        generate_keys(keys, "client")
        runs = {"bare pyzmq+msgspec ROUTER loop": lambda: bench_bare(seconds)}
        if args.baseline_src:
            runs["registry without sessions (baseline)"] = lambda: bench_baseline(
                seconds, args.baseline_src)
        if args.same_protocol_src:
            runs["registry of --same-protocol-src"] = lambda: bench_ingest(
                seconds, src=args.same_protocol_src)
        runs["registry, sessions checked"] = lambda: bench_ingest(seconds)
        runs["registry, sessions checked, CURVE on"] = lambda: bench_ingest(
            seconds, curve_keys=keys)
        for _ in range(rounds):  # interleaved, so a noisy minute hits every figure
            for name, run in runs.items():
                figures.setdefault(name, []).append(run())
    bare = _median(figures["bare pyzmq+msgspec ROUTER loop"]).heartbeats_per_s
    for name, results in figures.items():
        median = _median(results)
        print(f"  {name + ':':40} {median.heartbeats_per_s:9,.0f} heartbeats/s "
              f"({median.heartbeats_per_s / bare:4.0%} of bare), "
              f"{median.cpu_us_per_heartbeat:5.1f} us CPU each "
              f"[rates: {', '.join(f'{r.heartbeats_per_s:,.0f}' for r in results)}]")
    if args.ingest_only:
        return 0
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
