"""`bench_scale.py --sync-storm VIEWS`: many views asking one registry for a snapshot at
once, as routers starting together do."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import zmq

from bench.procs import cpu_s, registry_process
from bench.scale.fleet import MODELS, member_spec
from bench.scale.generator import WINDOW
from registry import sessions
from wire.protocol import MemberState, Register, Sync, make_encoder, reply_decoder

STORM_DEADLINE_S = 900.0
RETRY_AFTER_S = 0.5  # a refused view asks again this much later, as a view does
CONNECT_S = 1.0  # every connection up before the storm


def register_only(address: str, members: int) -> None:
    """Register `members` without heartbeats (the registry runs with a long lease)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(f"tcp://{address}")
    encode = make_encoder().encode
    sent = received = 0
    while received < members:
        while sent < members and sent - received < WINDOW:
            spec = member_spec(f"decode-{sent}", f"m{sent % MODELS}", sent)
            sock.send(encode(Register(spec=spec, nonce=sessions.new_nonce(),
                                      state=MemberState.READY)))
            sent += 1
        if sock.poll(1000):
            sock.recv()
            received += 1
    ctx.destroy(linger=0)


@contextmanager
def address_space_cap(gb: float) -> Iterator[None]:
    """Snapshots in flight are whole buffers here (libzmq allocates a message when its
    header arrives): capped, so a storm that outruns this process fails it, not the
    machine's other work. (The registry, started before, is not capped.)"""
    limit = resource.getrlimit(resource.RLIMIT_AS)
    if gb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (int(gb * 2**30), limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)


@dataclass
class Storm:
    """What the storm got: snapshots, refusals, bytes, one snapshot per distinct request
    (kept to be decoded afterwards), and the views still waiting at the deadline."""

    syncs: int = 0
    refusals: int = 0
    nbytes: int = 0
    waiting: int = 0
    seconds: float = 0.0
    registry_cpu_s: float = 0.0
    kept: dict[bytes, zmq.Frame] = field(default_factory=dict)


def storm(address: str, pid: int, requests: list[bytes]) -> Storm:
    """One DEALER per request, all sent at once; until each holds a snapshot (or the
    deadline), a refused one asks again RETRY_AFTER_S later."""
    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = []
    for _ in requests:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVHWM, 1)
        s.connect(f"tcp://{address}")
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    time.sleep(CONNECT_S)
    out = Storm()
    cpu0, t0 = cpu_s(pid), time.monotonic()
    for k, s in enumerate(socks):
        s.send(requests[k])
    waiting = set(range(len(socks)))
    index = {s: k for k, s in enumerate(socks)}
    retry: dict[int, float] = {}
    while waiting and time.monotonic() < t0 + STORM_DEADLINE_S:
        for s, _ in poller.poll(100):
            frame = s.recv(copy=False)
            k = index[s]
            if len(frame) > 1000 or frame.bytes[:20].find(b"Snapshot") >= 0:
                waiting.discard(k)
                out.syncs += 1
                out.nbytes += len(frame)
                out.kept.setdefault(requests[k], frame)
            else:  # refused (rate): ask again a little later, as a view does
                out.refusals += 1
                retry[k] = time.monotonic() + RETRY_AFTER_S
        now = time.monotonic()
        for k, at in list(retry.items()):
            if now >= at:
                del retry[k]
                socks[k].send(requests[k])
    out.seconds, out.registry_cpu_s = time.monotonic() - t0, cpu_s(pid) - cpu0
    out.waiting = len(waiting)
    ctx.destroy(linger=0)
    return out


def sync_storm(tree: str, src: str, members: int, views: int,
               models_per_view: int = 0, mem_cap_gb: float = 0.0) -> dict[str, object]:
    """`views` DEALERs ask for a snapshot at once (as views starting together do); the
    time until every one holds a snapshot, retrying after a refusal as a view does. With
    `models_per_view`, view k asks for that many of the models (k's own first), as a
    router started with --models does. The snapshots are received, not decoded, during the
    storm (decoding is each router's own CPU, on its own host): afterwards one of each kind
    is decoded as a view decodes it, and the views' total decode CPU is that times `views`."""
    encode = make_encoder().encode
    requests = [encode(Sync(models=[f"m{(k + j) % MODELS}" for j in range(models_per_view)]))
                for k in range(views)]
    with registry_process(5.0, 3600.0, src=src,
                          extra=("--max-members", str(members + 1000))) as (address, pid):
        register_only(address, members)
        with address_space_cap(mem_cap_gb):
            got = storm(address, pid, requests)
    decode = reply_decoder().decode
    decode_s = []
    for frame in got.kept.values():
        t = time.process_time()
        snapshot = decode(frame.buffer)
        decode_s.append(time.process_time() - t)
        del snapshot
    one_decode_s = sum(decode_s) / max(1, len(decode_s))
    elapsed = got.seconds
    return {"tree": tree, "members": members, "views": views,
            "models_per_view": models_per_view or MODELS, "synced": views - got.waiting,
            "seconds": round(elapsed, 1), "refusals": got.refusals,
            "registry_cpu_s": round(got.registry_cpu_s, 1),
            "gb_sent": round(got.nbytes / 1e9, 2),
            "gb_per_s": round(got.nbytes / 1e9 / max(1e-9, elapsed), 2),
            "mb_per_snapshot": round(got.nbytes / 1e6 / max(1, got.syncs), 2),
            "one_decode_ms": round(1e3 * one_decode_s, 1),
            "views_decode_cpu_s": round(views * one_decode_s, 1)}
