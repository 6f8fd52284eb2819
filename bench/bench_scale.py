"""The registry at fleet scale: a big fleet heartbeating, routers subscribed, churn.

    .venv/bin/python bench/bench_scale.py [--members 10000,100000] [--subscribers 100]
        [--churn 10] [--measure 10] [--baseline COMMIT] [--repeat N]
        [--registry-args "VARIANT;VARIANT"] [--per-model] [--sub-procs K]
    .venv/bin/python bench/bench_scale.py --members 100000 --sync-storm 1000
        [--storm-models K] [--baseline COMMIT]
    .venv/bin/python bench/bench_scale.py --deadband 20000:5 --measure 30

Per registry (this tree, and with --baseline a commit of this repository extracted with
`git archive` into a temporary directory) and per fleet size, in one run, side by side:

- the registry runs as `pdreg registry` in its own process (HTTP off), as deployed;
- a load generator process registers the members and heartbeats each one at the interval
  the registry dictates, from its own phase, with a load that changes (a random walk of
  running requests and KV use), signed as agents sign, over 64 connections on which it
  speaks ZMTP as a libzmq DEALER does (its own CPU is taken from the registry's machine:
  it stands in for hosts); with --churn R, R times a second a
  `churn-*` member says bye or comes back as a new incarnation; a probe member flips its
  state every PROBE_EVERY_S (a membership event);
- a subscriber process holds --subscribers raw SUB sockets (what a router's view holds):
  bytes received, and when each probe event arrived (propagation);
- a view process runs one real `MembershipView` (its CPU while the fleet runs).

Reported over the measured window (after every member has registered and heartbeat at
least once): heartbeats offered and answered OK, registry CPU (% of a core, and per
heartbeat and per delivered PUB message), propagation p50/p99 of the probe's events to
every subscriber, PUB bytes per router per second, view CPU, members wrongly suspected
(a `MemberUpdated` with suspect set for a member that never stopped), and afterwards a
Sync's round trip time and size. Where a probe's delay is: its propagation to the
first subscriber (no fan-out queueing), its own heartbeat's reply (the control queue),
the subscriber processes' own delay, and CPU per registry thread (the loop, libzmq's I/O).
The bench's own part: the generator's CPU per heartbeat and how late it sent heartbeats
after they fell due (a generator without a CPU sends late, then catches up), and the
garbage collections of the generator, the subscribers and the view.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import httpx
import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_registry import _cpu_s, registry_process  # noqa: E402

from registry import sessions  # noqa: E402
from registry.client import MembershipView, request_snapshot  # noqa: E402
from wire.protocol import (  # noqa: E402
    Bye,
    ByeReason,
    Endpoints,
    Heartbeat,
    Load,
    MemberSpec,
    MemberState,
    MemberUpdated,
    Register,
    ReplyStatus,
    Role,
    Sync,
    event_decoder,
    make_encoder,
    reply_decoder,
)

SOCKETS = 64  # generator DEALERs (the registry does not care which carries whom)
# Registrations in flight per socket. Replies on one socket must stay below the ROUTER's
# send queue (1,000), or the registry drops them (as it would for a member not reading).
WINDOW = 32
PROBE_EVERY_S = 0.25
PROBE_MODEL = "probe"
MODELS = 8  # members spread over this many models (topics)
CHURN_MEMBERS = 200
SCRAPE_SETTLE_S = 1.0  # after the scrape before the window: its backlog drains
SUB_RCVHWM = 20_000  # per subscriber: one that falls behind loses messages (counted)


def member_spec(member_id: str, model: str, i: int, incarnation: int = 1) -> MemberSpec:
    host = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
    return MemberSpec(id=member_id, incarnation=incarnation,
                      role=Role.PREFILL if i % 2 else Role.DECODE, model=model,
                      protocol="reference",
                      endpoints=Endpoints(http=f"http://{host}:8000", kv_host=host,
                                          kv_port=5600),
                      labels={"zone": f"z{i % 4}", "rack": f"r{i % 32}"}, capacity=64)


@dataclass(slots=True)
class _Member:
    spec: MemberSpec
    nonce: bytes
    session: bytes = b""
    seq: int = 0
    running: int = 0
    kv: float = 0.0  # (deadband_entries' walk)
    up: bool = True
    kv_e4: int = 0  # the generator's walk: KV use in units of 0.0001 (what a beat carries)


# --- the generator's connections: ZMTP 3.1 as libzmq's DEALER speaks it -------------------
#
# Through libzmq each heartbeat cost the generator two threads' work: the send checks
# the socket's mailbox (getpid, poll) and wakes libzmq's I/O thread (an eventfd, a thread
# switch), which then sends it; 32-45 us of CPU per heartbeat on this machine's 2 cores,
# taken from the registry under test (~13 us now, most of it the send() itself). So the
# generator speaks the wire protocol itself over plain non-blocking TCP sockets: the
# bytes a libzmq DEALER sends (greeting, READY, one frame per message), one send() per
# message, as each agent of a real fleet sends its heartbeat in its own segment
# (TCP_NODELAY, as libzmq).

# A libzmq 4.3 DEALER's greeting (ZMTP 3.1, NULL mechanism, as client) and READY command.
_GREETING = b"\xff" + bytes(7) + b"\x01\x7f\x03\x01NULL" + bytes(16) + b"\x00" + bytes(31)
_READY = (b"\x04\x29\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
          b"\x08Identity\x00\x00\x00\x00")
_SHORT = [bytes((0, n)) for n in range(256)]  # a last frame's flags and size, up to 255 B
_READ_BYTES = 1 << 16


def _frame(payload: bytes) -> bytes:
    n = len(payload)
    return _SHORT[n] + payload if n < 256 else b"\x02" + n.to_bytes(8, "big") + payload


class _Wire:
    """One DEALER-speaking connection to the registry's ROUTER (NULL security, as the
    bench's registry runs): whole messages out, whole single-frame messages in."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(_GREETING + _READY)
        self._buf = bytearray()
        while len(self._buf) < 64:  # the registry's greeting, then its READY
            self._fill()
        del self._buf[:64]
        while not self._frames(handshake=True):
            self._fill()
        self.sock.setblocking(False)
        self.backlog = bytearray()  # what the kernel would not take yet (kept in order)

    def _fill(self) -> bool:
        """What has arrived, up to 64 KiB, into the buffer; whether there may be more."""
        try:
            chunk = self.sock.recv(_READ_BYTES)
        except BlockingIOError:
            return False
        if not chunk:
            raise ConnectionError("the registry closed a generator connection")
        self._buf += chunk
        return len(chunk) == _READ_BYTES

    def send(self, payload: bytes) -> None:
        frame = _frame(payload)
        if self.backlog:
            self.backlog += frame
            self.flush()
            return
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        if sent < len(frame):
            self.backlog += frame[sent:]

    def flush(self) -> None:
        if self.backlog:
            with contextlib.suppress(BlockingIOError):
                del self.backlog[:self.sock.send(self.backlog)]

    def read(self) -> list[bytes]:
        """Every whole message that has arrived, in order (the socket is readable)."""
        while self._fill():
            pass
        return self._frames()

    def _frames(self, handshake: bool = False) -> list[bytes]:
        """The buffer's whole frames: its messages; with `handshake`, up to the first
        command (the registry's READY), returned as the one item."""
        buf, pos, n, out = self._buf, 0, len(self._buf), []
        while n - pos >= 2:
            flags = buf[pos]
            if flags & 0x02:  # a long frame
                if n - pos < 9:
                    break
                size, head = int.from_bytes(buf[pos + 1:pos + 9], "big"), 9
            else:
                size, head = buf[pos + 1], 2
            if n - pos < head + size:
                break
            body = bytes(buf[pos + head:pos + head + size])
            pos += head + size
            if flags & 0x04:  # a command: the handshake's READY, or ERROR
                if body[1:1 + body[0]] == b"ERROR":
                    raise ConnectionError(f"the registry refused a connection: {body!r}")
                if handshake:
                    out = [body]
                    break
            elif flags & 0x01:
                raise ConnectionError("a multipart reply (the registry sends one frame)")
            elif not handshake:
                out.append(body)
        del buf[:pos]
        return out

    def close(self) -> None:
        self.sock.close()


# --- the load generator ------------------------------------------------------------------

# The generator stands in for 100k hosts on a machine it shares with the registry: every
# microsecond it spends per heartbeat is taken from the registry under test. So it sends
# what is due once a tick and then reads what came back (not two polls of its 64
# sockets per loop turn), draws its random walk from a pool drawn once, and freezes its
# fleet out of the garbage collector's reach.
TICK_S = 0.001
CTL_EVERY_S = 0.01  # (a look at the bench's queue is a syscall and an exception)
WALK_STEPS = 65_521  # a prime, so a member's steps do not repeat with the fleet's order
KV_E4 = [k / 10_000 for k in range(10_001)]  # KV use as a heartbeat carries it (4 places)
LATE_OVER_MS = 10.0  # a heartbeat sent later than this after it was due counts as late
CATCH_UP = 2.0  # after a pause, overdue heartbeats go out at this times the fleet's rate
BURST_S = 0.01  # ... after a burst of at most this many seconds' worth


def walk_steps(rng: random.Random, n: int = WALK_STEPS) -> list[tuple[int, int]]:
    """The load walk's steps, drawn once: running requests -2..+2 (0 twice as likely) and
    KV use uniform within +-0.01 (in units of 0.0001), per beat, as agents' loads wobble."""
    return [(rng.choice((-2, -1, 0, 0, 1, 2)), round(rng.uniform(-100.0, 100.0)))
            for _ in range(n)]


class _Pauses:
    """The process's garbage collections (gc.callbacks): how many, how many were full
    ones (generation 2, the walks over everything tracked), the longest."""

    def __init__(self) -> None:
        self.count, self.full, self.max_s, self._t = 0, 0, 0.0, 0.0
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        self.count += 1
        self.full += info["generation"] == 2
        self.max_s = max(self.max_s, time.perf_counter() - self._t)

    def reset(self) -> None:
        self.count, self.full, self.max_s = 0, 0, 0.0

    def figures(self) -> dict[str, float]:
        return {"gc_count": self.count, "gc_full": self.full,
                "gc_max_ms": round(1e3 * self.max_s, 1)}


def generator(address: str, members: int, churn_per_s: float, ctl: mp.Queue,
              out: mp.Queue, nice: int = 0) -> None:
    os.nice(nice)  # --nice-generator: the registry first when the machine is short of CPU
    rng = random.Random(7)
    steps = walk_steps(rng)
    wires = [_Wire(address) for _ in range(SOCKETS)]
    sends = [w.send for w in wires]
    encode = make_encoder().encode
    decode = reply_decoder().decode
    seal = sessions.seal
    fleet = [_Member(member_spec(f"decode-{i}", f"m{i % MODELS}", i), sessions.new_nonce(),
                     running=rng.randrange(64), kv_e4=rng.randrange(10_001))
             for i in range(members)]
    churners = [_Member(member_spec(f"churn-{j}", f"m{j % MODELS}", members + j),
                        sessions.new_nonce()) for j in range(CHURN_MEMBERS if churn_per_s else 0)]
    probe = _Member(member_spec("probe-0", PROBE_MODEL, members + CHURN_MEMBERS + 1),
                    sessions.new_nonce())
    everyone = [*fleet, *churners, probe]
    everyone_index = {m.spec.id: i for i, m in enumerate(everyone)}
    probe_index = len(everyone) - 1
    # The fleet lives as long as the process and makes no cycles: out of the collector's
    # walks (a full collection over 100k members takes ~35 ms, a pause and then a burst).
    gc.freeze()
    pauses = _Pauses()
    # Replies come back in order per socket: what each pending one was about (None: a
    # fleet heartbeat, the bulk).
    pending: list[deque[tuple[str, _Member] | None]] = [deque() for _ in wires]
    counts = {"sent": 0, "ok": 0, "other": 0, "registered": 0}
    interval = 1.0
    ok_reply = b""  # the encoded plain OK reply, once seen
    readable = select.epoll()
    for w in wires:
        readable.register(w.sock.fileno(), select.EPOLLIN)
    index = {w.sock.fileno(): k for k, w in enumerate(wires)}
    due: list[tuple[float, int]] = []  # (when, index into everyone): each its own phase
    started = time.monotonic()
    to_register = 0
    registered_reported = False
    probes: list[float] = []
    probe_replies: list[float] = []  # when each probe's reply was read (the control round trip)
    next_probe = math.inf
    next_churn = math.inf
    marks: dict[str, dict[str, float]] = {}
    down: list[_Member] = []
    step = 0
    # In the window: how late each heartbeat went out after it was due, the longest gap
    # between two ticks (the process paused or waiting for a CPU), the worst per second.
    measuring = False
    late: list[float] = []
    late_per_s: dict[int, float] = {}
    gaps_over = 0
    gap_max = 0.0
    window_t0 = 0.0

    def on_reply(payload: bytes, kind: str, member: _Member | None, read: float) -> None:
        nonlocal interval, ok_reply
        if payload == ok_reply and kind != "register":
            counts["ok"] += 1
            if kind == "probe":
                probe_replies.append(read)
            return
        reply = decode(payload)
        interval = getattr(reply, "heartbeat_interval_s", interval)
        if kind == "register" and member is not None:
            counts["registered"] += 1
            if reply.status is ReplyStatus.OK:
                member.session = reply.session
                # Heartbeats from the moment it is registered, as agents do.
                heapq.heappush(due, (read + rng.random() * interval,
                                     everyone_index[member.spec.id]))
        elif kind in ("beat", "probe"):
            counts["ok" if reply.status is ReplyStatus.OK else "other"] += 1
            if reply.status is ReplyStatus.OK and not reply.reason:
                ok_reply = payload
            if kind == "probe":
                probe_replies.append(read)

    def drain() -> None:
        """Every reply that has arrived. The plain OK reply is the same bytes every time:
        compared, not decoded (the generator's CPU is not the registry's)."""
        read = time.monotonic()
        ok = 0
        for fd, _ in readable.poll(0):
            k = index[fd]
            queue = pending[k]
            for payload in wires[k].read():
                about = queue.popleft()
                if about is None and payload == ok_reply:
                    ok += 1
                else:
                    on_reply(payload, *(about or ("beat", None)), read)
        counts["ok"] += ok
        for w in wires:
            if w.backlog:
                w.flush()

    def send(k: int, payload: bytes, kind: str, member: _Member) -> None:
        sends[k](payload)
        pending[k].append((kind, member))

    def register(member: _Member, k: int) -> None:
        send(k, encode(Register(spec=member.spec, nonce=member.nonce,
                                state=MemberState.READY, load=Load(member.running))),
             "register", member)

    def beat(member: _Member, k: int, extra: dict[str, float], state: MemberState,
             kind: str) -> None:
        """A heartbeat outside the fleet's hot path (the probe)."""
        nonlocal step
        member.seq += 1
        d_running, d_kv = steps[step]
        step = (step + 1) % WALK_STEPS
        member.running = max(0, member.running + d_running)
        member.kv_e4 = min(10_000, max(0, member.kv_e4 + d_kv))
        send(k, seal(member.session, encode(Heartbeat(
            member.spec.id, member.spec.incarnation, member.seq, state,
            Load(member.running, 0, KV_E4[member.kv_e4], extra)))), kind, member)
        counts["sent"] += 1

    ready = MemberState.READY
    previous = time.monotonic()
    budget = 0.0
    typical_gap = TICK_S
    next_ctl = 0.0
    while True:
        message = None
        if previous >= next_ctl:  # the bench's start/end, looked for every CTL_EVERY_S
            next_ctl = previous + CTL_EVERY_S
            try:
                message = ctl.get_nowait()
            except Exception:
                message = None
        if message in ("start", "end"):
            marks[message] = {**counts, "t": time.monotonic(), "probes": len(probes)}
        if message == "start":
            measuring, window_t0 = True, time.monotonic()
            pauses.reset()
        if message == "end":
            break
        now = time.monotonic()
        gap = now - previous
        if measuring:
            gap_max = max(gap_max, gap)
            gaps_over += gap > LATE_OVER_MS / 1e3
        previous = now
        # 1) Registrations, WINDOW in flight per socket, while the registered heartbeat.
        while to_register < len(everyone) and len(pending[to_register % SOCKETS]) < WINDOW:
            register(everyone[to_register], to_register % SOCKETS)
            to_register += 1
        if (not registered_reported and to_register == len(everyone)
                and counts["registered"] >= len(everyone)):
            registered_reported = True
            missing = sum(1 for m in everyone if not m.session)
            gc.freeze()  # the sessions and the schedule, too
            out.put(("registered", now - started, missing, interval))
            next_probe = now + 1.0
            next_churn = now + (1.0 / churn_per_s if churn_per_s else math.inf)
        # 2) What is due (the hot path: one heap pop and push, a walk step from the pool,
        # the project's encoder and the member's own session, per heartbeat).
        # After a pause (no CPU for the generator, or a collection) what fell due goes out
        # at up to CATCH_UP times the fleet's rate, not in one burst: a real fleet's agents
        # do not pause together, so the registry would have had them spread out.
        # The bucket is as deep as two typical ticks, so a generator that gets the CPU
        # only every few ms (a busy machine) still offers the fleet's whole rate.
        rate = len(due) / interval
        typical_gap += (gap - typical_gap) * 0.05
        budget = min(max(rate * max(BURST_S, 2.0 * typical_gap), 8.0),
                     budget + gap * CATCH_UP * rate)
        sent = 0
        while due and due[0][0] <= now and budget >= 1.0:
            budget -= 1.0
            when, i = heapq.heappop(due)
            if i == probe_index:
                continue  # the probe beats on its own schedule
            member = everyone[i]
            if not (member.up and member.session):
                continue  # said bye: registers again as a new incarnation
            member.seq += 1
            d_running, d_kv = steps[step]
            step = (step + 1) % WALK_STEPS
            running = member.running + d_running
            member.running = running = running if running > 0 else 0
            kv = member.kv_e4 + d_kv
            member.kv_e4 = kv = 0 if kv < 0 else 10_000 if kv > 10_000 else kv
            spec = member.spec
            k = i % SOCKETS
            sends[k](seal(member.session, encode(Heartbeat(
                spec.id, spec.incarnation, member.seq, ready,
                Load(running, 0, KV_E4[kv])))))
            pending[k].append(None)
            heapq.heappush(due, (when + interval, i))
            sent += 1
            if measuring:
                late.append(now - when)
        counts["sent"] += sent
        if measuring and late and sent:
            second = int(now - window_t0)
            late_per_s[second] = max(late_per_s.get(second, 0.0), max(late[-sent:]))
        if now >= next_probe:
            next_probe += PROBE_EVERY_S
            state = MemberState.JOINING if len(probes) % 2 == 0 else MemberState.READY
            probes.append(time.monotonic())
            beat(probe, 0, {"probe": float(len(probes) - 1)}, state, "probe")
        while now >= next_churn:
            next_churn += 1.0 / churn_per_s
            if down and (rng.random() < 0.5 or len(down) > len(churners) // 2):
                member = down.pop(0)
                member.spec = msgspec.structs.replace(member.spec,
                                                      incarnation=member.spec.incarnation + 1)
                member.nonce, member.seq, member.up = sessions.new_nonce(), 0, True
                register(member, 1)
            else:
                member = rng.choice(churners)
                if member.up and member.session:
                    member.seq += 1
                    send(1, seal(member.session, encode(Bye(
                        member.spec.id, member.spec.incarnation, member.seq,
                        ByeReason.SHUTDOWN))), "bye", member)
                    member.up = False
                    member.session = b""
                    down.append(member)
        drain()
        # 3) Sleep to the next tick (heartbeats due meanwhile wait for it: up to a tick
        # late, rather than a wake-up per heartbeat), or to the probe's or a churn's time.
        wake = min(now + TICK_S, next_probe, next_churn)
        wait = wake - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    late.sort()
    figures = {"late_p50_ms": round(1e3 * _pct(late, 0.5), 1),
               "late_p99_ms": round(1e3 * _pct(late, 0.99), 1),
               "late_max_ms": round(1e3 * late[-1], 1) if late else math.nan,
               "late_over": sum(1 for t in late if t > LATE_OVER_MS / 1e3),
               "gap_max_ms": round(1e3 * gap_max, 1), "gaps_over": gaps_over,
               "late_per_s_ms": [round(1e3 * late_per_s.get(s, 0.0), 1)
                                 for s in range(max(late_per_s, default=-1) + 1)],
               **pauses.figures()}
    out.put(("done", marks, probes, probe_replies, figures))
    readable.close()
    for w in wires:
        w.close()


# --- subscribers (raw SUB sockets, as a router's view holds) -------------------------------


def subscribers(events_address: str, indices: range, per_model: bool, ready: mp.Queue,
                ctl: mp.Queue, out: mp.Queue) -> None:
    """Subscribers `indices` (of all the bench's, over --sub-procs processes). With
    `per_model`, every subscriber but the first serves one model, as a router started
    with --models does (its topic, the probe's and the pulse); the first one (index 0)
    takes every topic (the bytes a router serving every model receives)."""
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for k in indices:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, SUB_RCVHWM)
        if per_model and k:
            for model in (f"m{k % MODELS}", PROBE_MODEL, ""):
                s.setsockopt(zmq.SUBSCRIBE, model.encode() + b"\0")
        else:
            s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://{events_address}")
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    decode = event_decoder().decode
    probe_topic = PROBE_MODEL.encode() + b"\0"
    measuring = False
    nbytes = messages = 0
    arrivals: dict[int, list[float]] = {}  # probe k -> arrival time per subscriber
    # probe k -> per arrival, how long this process had been busy with other sockets since
    # its poll returned (its own share of the delay, beyond waiting for a CPU)
    own: dict[int, list[float]] = {}
    wrongly_suspect: set[str] = set()
    all_topics = socks[0] if indices.start == 0 else None
    pauses = _Pauses()
    ready.put("subscribed")
    while True:
        try:
            message = ctl.get_nowait()
        except Exception:
            message = None
        if message == "start":
            measuring, nbytes, messages = True, 0, 0
            pauses.reset()
        elif message == "end":
            break
        for s, _ in poller.poll(20):
            polled = time.monotonic()
            first = s is all_topics
            while True:
                try:
                    topic, body = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                now = time.monotonic()
                if first and measuring:
                    nbytes += len(topic) + len(body)
                    messages += 1
                if topic == probe_topic:
                    event = decode(body)
                    if isinstance(event, MemberUpdated):
                        k = int(event.member.load.extra.get("probe", -1))
                        arrivals.setdefault(k, []).append(now)
                        own.setdefault(k, []).append(now - polled)
                elif first and measuring and body[:20].find(b"MemberUpdated") >= 0:
                    event = decode(body)
                    if (isinstance(event, MemberUpdated) and event.member.suspect
                            and not event.member.spec.id.startswith("churn-")):
                        wrongly_suspect.add(event.member.spec.id)
    out.put((nbytes, messages, arrivals, own, sorted(wrongly_suspect), pauses.figures()))
    ctx.destroy(linger=0)


def view_process(address: str, ctl: mp.Queue, out: mp.Queue) -> None:
    view = MembershipView(address).start()
    view.wait_for(bool, 120)
    pauses = _Pauses()
    cpu0 = time.process_time()
    while True:
        message = ctl.get()
        if message == "start":
            cpu0 = time.process_time()
            t0 = time.monotonic()
            pauses.reset()
        elif message == "end":
            break
    cpu = time.process_time() - cpu0
    out.put((cpu / max(1e-9, time.monotonic() - t0), len(view.members()), pauses.figures()))
    view.close()


# --- one run -------------------------------------------------------------------------------


@dataclass
class Result:
    tree: str
    members: int
    subscribers: int
    per_model: bool
    churn_per_s: float
    interval_s: float
    register_s: float
    not_registered: int
    offered_per_s: float
    sent_total: int  # heartbeats the generator sent, the whole run
    handled_total: int  # heartbeats the registry handled, the whole run (its own counter)
    answered_per_s: float  # OK replies the generator read back
    refused: int
    registry_core_pct: float
    registry_us_per_heartbeat: float
    registry_us_per_delivered_msg: float
    propagation_p50_ms: float
    propagation_p99_ms: float
    probes_lost: int
    pub_bytes_per_router_per_s: float
    pub_msgs_per_router_per_s: float
    view_core_pct: float
    view_members: int
    wrongly_suspect: int
    snapshot_ms: float
    snapshot_mb: float
    # time the process's threads waited for a CPU while runnable (schedstat), % of the window
    registry_runq_wait_pct: float = 0.0
    subscribers_runq_wait_pct: float = 0.0
    turns_per_s: int = 0  # loop turns a second in the window (the registry's own count)
    turns_over_25ms: int = 0  # loop turns in the window that took longer (the registry's own)
    turns_over_100ms: int = 0
    snapshot_builds: int = 0  # HTTP snapshots built in the window
    snapshot_build_ms_mean: float = 0.0
    scrapes: int = 0  # /metrics scrapes inside the window (--scrape-every)
    scrape_kb: float = 0.0
    scrape_ms_max: float = 0.0
    # The probe's propagation to the first subscriber that got it (the registry, libzmq and
    # one socket: no fan-out queueing), and the subscriber processes' own part of each
    # arrival: time spent on other sockets since the poll returned.
    first_p50_ms: float = 0.0
    first_p99_ms: float = 0.0
    sub_own_p99_ms: float = 0.0
    sub_procs: int = 1
    # The probe heartbeat's reply, read back by the generator: its way into the registry
    # and through the control queue (plus the generator's own delay in reading it).
    probe_reply_p50_ms: float = 0.0
    probe_reply_p99_ms: float = 0.0
    probe_series_ms: list[float] = field(default_factory=list)  # (JSON only)
    # % of a core per registry thread (the loop vs libzmq's I/O threads), JSON only
    registry_threads_pct: dict[str, float] = field(default_factory=dict)
    generator_core_pct: float = 0.0  # the bench's own share of the machine
    subscribers_core_pct: float = 0.0
    generator_us_per_heartbeat: float = 0.0  # its CPU over the heartbeats it sent
    # How late the generator sent each heartbeat after it was due (the machine or a pause
    # holding it back, and then a burst of overdue heartbeats): p50/p99/max, how many over
    # 10 ms, its longest gap between two ticks, its garbage collections (count, longest),
    # and per second of the window the latest one (JSON only).
    generator_late_p50_ms: float = 0.0
    generator_late_p99_ms: float = 0.0
    generator_late_max_ms: float = 0.0
    generator_late_over_10ms: int = 0
    generator_gap_max_ms: float = 0.0
    generator_gc: str = ""
    generator_late_per_s_ms: list[float] = field(default_factory=list)
    # The longest garbage collection in the window: the subscriber processes, the view's
    subscribers_gc_max_ms: float = 0.0
    view_gc: str = ""


def run_one(tree: str, src: str, members: int, subs: int, churn: float,
            measure_s: float, extra: tuple[str, ...], per_model: bool = False,
            warmup_s: float = 0.0, profile: str = "", scrape_every_s: float = 0.0,
            nice_generator: int = 0, sub_procs: int = 1) -> Result:
    label = f"{tree}-{members}"
    with _profiled(src, profile, label) as run_src, registry_process(1.0, 3.0, src=run_src,
                          extra=("--max-members", str(2 * members + 1000), "--http-port", "0",
                                 *extra)) as (address, pid):
        hello = request_snapshot(address, timeout_s=10)
        events_port = hello.events_port
        metrics_url = f"http://{address.rpartition(':')[0]}:{hello.http_port}/metrics"
        events = f"{address.rpartition(':')[0]}:{events_port}"
        queues = {name: (mp.Queue(), mp.Queue()) for name in ("gen", "sub", "view")}
        gen = mp.Process(target=generator,
                         args=(address, members, churn, *queues["gen"], nice_generator))
        gen.start()
        _, register_s, missing, interval = queues["gen"][1].get(timeout=600)
        # Routers come once the fleet is up (100 of them in one process here could not
        # take 100k joins each; in a real fleet each has its own host).
        ready: mp.Queue = mp.Queue()
        procs = max(1, min(sub_procs, subs))
        sub_queues = [queues["sub"], *((mp.Queue(), mp.Queue()) for _ in range(procs - 1))]
        share = [range(subs * j // procs, subs * (j + 1) // procs) for j in range(procs)]
        subs_p = [mp.Process(target=subscribers,
                             args=(events, share[j], per_model, ready, *sub_queues[j]))
                  for j in range(procs)]
        for p in subs_p:
            p.start()
        for _ in subs_p:
            ready.get(timeout=60)
        view = mp.Process(target=view_process, args=(address, *queues["view"]))
        view.start()
        # Every member heartbeats once, the view syncs, the registration backlog drains.
        time.sleep(max(2.0, 1.5 * interval, warmup_s))
        # The loop's figures are scraped around the window, not in it: a /metrics scrape
        # at 100k members is a walk over every member in the registry's HTTP thread, which
        # holds back the loop (and so the probes) for a moment; --scrape-every measures
        # that on purpose. (A registry before the per-member series were capped, before
        # bde53e6, takes ~1.5 s per scrape at 100k: with such a baseline,
        # --no-baseline-figures.)
        figures = tree.startswith("this") or not _NO_BASELINE_FIGURES
        loop0 = _loop_figures(metrics_url) if figures else {}
        loop_t0 = time.monotonic()
        if figures:
            time.sleep(SCRAPE_SETTLE_S)
        for name in queues:
            queues[name][0].put("start")
        spy = _py_spy(pid, measure_s, os.path.join(profile, f"{label}.txt")) if profile else None
        watched = (("registry", [pid]), ("sub", [p.pid for p in subs_p]))
        waited0 = {name: sum(map(_runq_s, pids)) for name, pids in watched}
        others = {"gen": [gen.pid], "sub": [p.pid for p in subs_p]}
        others0 = {name: sum(map(_cpu_s, pids)) for name, pids in others.items()}
        threads0 = _thread_cpu_s(pid)
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        scrapes = _scrape_during(metrics_url, measure_s, scrape_every_s)
        cpu, elapsed = _cpu_s(pid) - cpu0, time.monotonic() - t0
        threads = {name: round(100 * (s - threads0.get(name, 0.0)) / elapsed, 1)
                   for name, s in _thread_cpu_s(pid).items()}
        threads = {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v}
        others_cpu = {name: sum(map(_cpu_s, pids)) - others0[name]
                      for name, pids in others.items()}
        waited = {name: sum(map(_runq_s, pids)) - waited0[name] for name, pids in watched}
        if spy is not None:
            spy.wait(timeout=60)
        for name in queues:
            queues[name][0].put("end")
        for q in sub_queues[1:]:
            q[0].put("end")
        loop = {k: v - loop0.get(k, 0.0)
                for k, v in (_loop_figures(metrics_url) if figures else {}).items()}
        loop_span_s = time.monotonic() - loop_t0  # the window and a little on either side
        _, marks, probes, probe_replies, gen_figures = queues["gen"][1].get(timeout=120)
        arrivals: dict[int, list[float]] = {}
        own: dict[int, list[float]] = {}
        suspects: list[str] = []
        sub_gc_max_ms = 0.0
        for j, q in enumerate(sub_queues):
            (got_bytes, got_messages, got_arrivals, got_own, got_suspects,
             got_pauses) = q[1].get(timeout=120)
            sub_gc_max_ms = max(sub_gc_max_ms, got_pauses["gc_max_ms"])
            if j == 0:
                nbytes, messages = got_bytes, got_messages
            for k, times in got_arrivals.items():
                arrivals.setdefault(k, []).extend(times)
            for k, times in got_own.items():
                own.setdefault(k, []).extend(times)
            suspects.extend(got_suspects)
        view_core, view_members, view_pauses = queues["view"][1].get(timeout=120)
        for p in (gen, *subs_p, view):
            p.join(timeout=30)
        # Scraped after the window (a registry before the cap: ~10 MB, ~1.5 s at 100k).
        time.sleep(2.0)
        handled = _heartbeats_handled(metrics_url)
        t_sync = time.perf_counter()
        raw = _sync_bytes(address)
        snapshot_s = time.perf_counter() - t_sync
    start, end = marks["start"], marks["end"]
    window = end["t"] - start["t"]
    lat, first_lat, own_ms = [], [], []
    series: list[float] = []  # per probe, in order: when its last subscriber had it
    lost = 0
    for k in range(int(start["probes"]), int(end["probes"])):
        got = arrivals.get(k, [])
        lost += subs - len(got)
        lat.extend(1e3 * (t - probes[k]) for t in got)
        if got:
            first_lat.append(1e3 * (min(got) - probes[k]))
        series.append(round(1e3 * (max(got) - probes[k]), 1) if got else math.nan)
        own_ms.extend(1e3 * t for t in own.get(k, []))
    replied = sorted(1e3 * (probe_replies[k] - probes[k])
                     for k in range(int(start["probes"]), min(len(probe_replies),
                                                              int(end["probes"]))))
    lat.sort()
    first_lat.sort()
    own_ms.sort()
    answered = end["ok"] - start["ok"]
    delivered = messages * subs
    return Result(
        tree=tree, members=members, subscribers=subs, per_model=per_model, churn_per_s=churn,
        interval_s=interval,
        register_s=round(register_s, 1), not_registered=missing,
        offered_per_s=round((end["sent"] - start["sent"]) / window),
        sent_total=int(end["sent"]), handled_total=int(handled),
        answered_per_s=round(answered / window), refused=int(end["other"] - start["other"]),
        registry_core_pct=round(100 * cpu / elapsed, 1),
        registry_us_per_heartbeat=round(1e6 * cpu / max(1, answered), 1),
        registry_us_per_delivered_msg=round(1e6 * cpu / max(1, delivered), 2),
        propagation_p50_ms=round(_pct(lat, 0.5), 1), propagation_p99_ms=round(_pct(lat, 0.99), 1),
        first_p50_ms=round(_pct(first_lat, 0.5), 1), first_p99_ms=round(_pct(first_lat, 0.99), 1),
        sub_own_p99_ms=round(_pct(own_ms, 0.99), 1), sub_procs=procs,
        probe_series_ms=series, registry_threads_pct=threads,
        generator_core_pct=round(100 * others_cpu["gen"] / elapsed, 1),
        generator_us_per_heartbeat=round(1e6 * others_cpu["gen"]
                                         / max(1, end["sent"] - start["sent"]), 1),
        generator_late_p50_ms=gen_figures["late_p50_ms"],
        generator_late_p99_ms=gen_figures["late_p99_ms"],
        generator_late_max_ms=gen_figures["late_max_ms"],
        generator_late_over_10ms=gen_figures["late_over"],
        generator_gap_max_ms=gen_figures["gap_max_ms"],
        generator_gc=_gc_text(gen_figures),
        generator_late_per_s_ms=gen_figures["late_per_s_ms"],
        subscribers_gc_max_ms=sub_gc_max_ms,
        view_gc=_gc_text(view_pauses),
        subscribers_core_pct=round(100 * others_cpu["sub"] / elapsed, 1),
        probe_reply_p50_ms=round(_pct(replied, 0.5), 1),
        probe_reply_p99_ms=round(_pct(replied, 0.99), 1),
        probes_lost=lost, pub_bytes_per_router_per_s=round(nbytes / elapsed),
        pub_msgs_per_router_per_s=round(messages / elapsed),
        view_core_pct=round(100 * view_core, 1), view_members=view_members,
        wrongly_suspect=len(suspects), snapshot_ms=round(1e3 * snapshot_s, 1),
        snapshot_mb=round(len(raw) / 1e6, 2),
        registry_runq_wait_pct=round(100 * waited["registry"] / elapsed, 1),
        subscribers_runq_wait_pct=round(100 * waited["sub"] / elapsed, 1),
        turns_per_s=round(loop.get("turns", 0.0) / loop_span_s),
        turns_over_25ms=int(loop.get("turns_over_25ms", 0)),
        turns_over_100ms=int(loop.get("turns_over_100ms", 0)),
        snapshot_builds=int(loop.get("snapshot_builds", 0)),
        snapshot_build_ms_mean=round(1e3 * loop.get("snapshot_build_s", 0.0)
                                     / max(1.0, loop.get("snapshot_builds", 0.0)), 1),
        scrapes=scrapes,
        scrape_kb=round(max(scraped[0] for scraped in _SCRAPED) / 1e3, 1) if _SCRAPED else 0.0,
        scrape_ms_max=round(1e3 * max(scraped[1] for scraped in _SCRAPED), 1)
        if _SCRAPED else 0.0)


def _gc_text(figures: dict[str, float]) -> str:
    return (f"{figures['gc_count']} ({figures['gc_full']} full), "
            f"max {figures['gc_max_ms']} ms")


_NO_BASELINE_FIGURES = "--no-baseline-figures" in sys.argv

# (bytes, seconds) of each /metrics scrape inside the last window
_SCRAPED: list[tuple[int, float]] = []

# Bench-only: the registry under --profile imports this first (a sitecustomize on its
# path) and logs every garbage collection that pauses it over 1 ms.
_GC_LOG_SHIM = """
import gc, os, time
_log = open(os.environ["PDREG_BENCH_GC_LOG"], "a", buffering=1)
_start = [0.0]
def _timed(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        took = time.perf_counter() - _start[0]
        if took > 0.001:
            _log.write(f"{time.time():.3f} gen{info['generation']} {1e3 * took:.1f}ms "
                       f"collected={info['collected']}\\n")
        if info["generation"] == 2:  # what a full collection walks (bench only)
            from collections import Counter
            kinds = Counter(type(o).__name__ for o in gc.get_objects())
            _log.write(f"  tracked={sum(kinds.values())} {kinds.most_common(6)}\\n")
gc.callbacks.append(_timed)
"""


@contextlib.contextmanager
def _profiled(src: str, profile: str, label: str) -> Iterator[str]:
    """`src`, or with `profile` a directory whose sitecustomize logs GC pauses into
    PROFILE/LABEL-gc.log before importing `src`'s packages (by symlink)."""
    if not profile:
        yield src
        return
    os.makedirs(profile, exist_ok=True)
    shim = tempfile.mkdtemp(prefix="pdreg-profiled-")
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(shim, name))
    with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
        f.write(_GC_LOG_SHIM)
    before = os.environ.get("PDREG_BENCH_GC_LOG")
    os.environ["PDREG_BENCH_GC_LOG"] = os.path.abspath(os.path.join(profile, f"{label}-gc.log"))
    try:
        yield shim
    finally:
        if before is None:
            os.environ.pop("PDREG_BENCH_GC_LOG", None)
        shutil.rmtree(shim, ignore_errors=True)


def _py_spy(pid: int, seconds: float, out: str) -> subprocess.Popen | None:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        print("py-spy not found (pip install py-spy): no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration",
                             str(max(1, int(seconds))), "--rate", "200", "--format", "raw",
                             "--output", out], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _scrape_during(metrics_url: str, seconds: float, every_s: float) -> int:
    """Sleep `seconds`; with `every_s`, scrape /metrics that often meanwhile."""
    _SCRAPED.clear()
    end = time.monotonic() + seconds
    if every_s <= 0:
        time.sleep(seconds)
        return 0
    while end - time.monotonic() > 0:
        t = time.perf_counter()
        body = httpx.get(metrics_url, timeout=30).content
        _SCRAPED.append((len(body), time.perf_counter() - t))
        time.sleep(max(0.0, min(every_s - (time.perf_counter() - t), end - time.monotonic())))
    return len(_SCRAPED)


def _register_only(address: str, members: int) -> None:
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


def sync_storm(tree: str, src: str, members: int, views: int,
               models_per_view: int = 0, mem_cap_gb: float = 0.0) -> dict[str, object]:
    """`views` DEALERs ask for a snapshot at once (as views starting together do); the
    time until every one holds a snapshot, retrying after a refusal as a view does. With
    `models_per_view`, view k asks for that many of the models (k's own first), as a
    router started with --models does. The snapshots are received, not decoded, during the
    storm (decoding is each router's own CPU, on its own host): afterwards one of each kind
    is decoded as a view decodes it, and the views' total decode CPU is that times `views`."""
    with registry_process(5.0, 3600.0, src=src,
                          extra=("--max-members", str(members + 1000))) as (address, pid):
        _register_only(address, members)
        # Snapshots in flight are whole buffers here (libzmq allocates a message when its
        # header arrives): capped, so a storm that outruns this process fails it, not the
        # machine's other work. The registry, started before, is not capped.
        limit = resource.getrlimit(resource.RLIMIT_AS)
        if mem_cap_gb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (int(mem_cap_gb * 2**30), limit[1]))
        ctx = zmq.Context()
        socks = []
        poller = zmq.Poller()
        for _ in range(views):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RCVHWM, 1)
            s.connect(f"tcp://{address}")
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        encode = make_encoder().encode
        requests = [encode(Sync(models=[f"m{(k + j) % MODELS}"
                                        for j in range(models_per_view)]))
                    for k in range(views)]
        time.sleep(1.0)  # every connection up
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        for k, s in enumerate(socks):
            s.send(requests[k])
        waiting = set(range(views))
        index = {s: k for k, s in enumerate(socks)}
        retry: dict[int, float] = {}
        syncs = refusals = 0
        nbytes = 0
        kept: dict[bytes, zmq.Frame] = {}  # one snapshot per distinct request
        deadline = t0 + 900
        while waiting and time.monotonic() < deadline:
            for s, _ in poller.poll(100):
                frame = s.recv(copy=False)
                k = index[s]
                if len(frame) > 1000 or frame.bytes[:20].find(b"Snapshot") >= 0:
                    waiting.discard(k)
                    syncs += 1
                    nbytes += len(frame)
                    kept.setdefault(requests[k], frame)
                else:  # refused (rate): ask again a little later, as a view does
                    refusals += 1
                    retry[k] = time.monotonic() + 0.5
            now = time.monotonic()
            for k, at in list(retry.items()):
                if now >= at:
                    del retry[k]
                    socks[k].send(requests[k])
        elapsed = time.monotonic() - t0
        cpu = _cpu_s(pid) - cpu0
        ctx.destroy(linger=0)
        resource.setrlimit(resource.RLIMIT_AS, limit)
    decode = reply_decoder().decode
    decode_s = []
    for frame in kept.values():
        t = time.process_time()
        snapshot = decode(frame.buffer)
        decode_s.append(time.process_time() - t)
        del snapshot
    one_decode_s = sum(decode_s) / max(1, len(decode_s))
    return {"tree": tree, "members": members, "views": views,
            "models_per_view": models_per_view or MODELS, "synced": views - len(waiting),
            "seconds": round(elapsed, 1), "refusals": refusals,
            "registry_cpu_s": round(cpu, 1), "gb_sent": round(nbytes / 1e9, 2),
            "gb_per_s": round(nbytes / 1e9 / max(1e-9, elapsed), 2),
            "mb_per_snapshot": round(nbytes / 1e6 / max(1, syncs), 2),
            "one_decode_ms": round(1e3 * one_decode_s, 1),
            "views_decode_cpu_s": round(views * one_decode_s, 1)}


def deadband_entries(members: int, interval_s: float, seconds: float) -> list[dict[str, object]]:
    """Load-digest entries per second that `members` heartbeating every `interval_s` with
    the generator's random walk make, per deadband setting: pure state, simulated time
    (no sockets), so the figure does not depend on the machine's load."""
    from registry.deadband import MAX_AGE_INTERVALS, MAX_AGE_S, Deadband
    from registry.detector import DetectorConfig
    from registry.membership import Membership
    from wire.protocol import Heartbeat

    settings = [("every change (--load-max-age 0)", Deadband(max_age_s=0.0)),
                (f"band, max age {MAX_AGE_S:g} s", Deadband(max_age_s=MAX_AGE_S)),
                (f"band, max age {MAX_AGE_S:g} s or {MAX_AGE_INTERVALS:g} intervals",
                 Deadband(max_age_s=MAX_AGE_S, max_age_intervals=MAX_AGE_INTERVALS))]
    encode = make_encoder().encode
    rows = []
    for label, band in settings:
        rng = random.Random(7)
        m = Membership(7, DetectorConfig(heartbeat_interval_s=interval_s,
                                         lease_s=3 * interval_s, tick_period_s=0.1),
                       deadband=band)
        fleet = []
        for i in range(members):
            member = _Member(member_spec(f"d{i}", f"m{i % MODELS}", i), b"",
                             running=rng.randrange(64), kv=rng.random())
            member.session = m.register(member.spec, MemberState.READY, Load(member.running),
                                        0.0, nonce=sessions.new_nonce()).session
            fleet.append(member)
        due = [(rng.random() * interval_s, i) for i in range(members)]
        heapq.heapify(due)
        t, entries, counted_from = 0.0, 0, 2 * interval_s + 2.0
        while t < counted_from + seconds:
            t += 0.1  # the digest period
            while due[0][0] <= t:
                when, i = heapq.heappop(due)
                member = fleet[i]
                member.seq += 1
                member.running = max(0, member.running + rng.choice((-2, -1, 0, 0, 1, 2)))
                member.kv = min(1.0, max(0.0, member.kv + rng.uniform(-0.01, 0.01)))
                payload = sessions.seal(member.session, encode(Heartbeat(
                    member.spec.id, 1, member.seq, MemberState.READY,
                    Load(member.running, 0, round(member.kv, 4)))))
                m.heartbeat(msgspec.msgpack.decode(payload, type=Heartbeat), payload, when)
                heapq.heappush(due, (when + interval_s, i))
            digests = m.take_load_digests(t)
            if t >= counted_from:
                entries += sum(map(len, digests.values()))
            m.take_events()
        rows.append({"members": members, "interval_s": interval_s, "deadband": label,
                     "heartbeats_per_s": round(members / interval_s),
                     "digest_entries_per_s": round(entries / seconds)})
    return rows


def _heartbeats_handled(metrics_url: str) -> float:
    """The registry's own count of heartbeats handled (scraped: it costs the loop nothing)."""

    for line in httpx.get(metrics_url, timeout=30).text.splitlines():
        if line.startswith("pdreg_heartbeats_total "):
            return float(line.split()[1])
    return math.nan


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid`, keyed "name/tid" (libzmq names its I/O threads
    ZMQbg/IO/N; Python's show the process name)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[f"{name}/{task}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _runq_s(pid: int) -> float:
    """Seconds the threads of `pid` have waited on a run queue (runnable, no CPU)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended
    return total / 1e9


def _loop_figures(metrics_url: str) -> dict[str, float]:
    """The registry's loop-turn and snapshot-build histograms (registries before them: {})."""
    figures: dict[str, float] = {}
    text = httpx.get(metrics_url, timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            le = sample.labels.get("le")
            if sample.name == "pdreg_loop_turn_seconds_bucket" and le in ("0.025", "0.1"):
                figures[f"turns_upto_{le}"] = sample.value
            elif sample.name == "pdreg_loop_turn_seconds_count":
                figures["turns"] = sample.value
            elif sample.name == "pdreg_snapshot_build_seconds_count":
                figures["snapshot_builds"] = sample.value
            elif sample.name == "pdreg_snapshot_build_seconds_sum":
                figures["snapshot_build_s"] = sample.value
    if "turns" in figures:
        figures["turns_over_25ms"] = figures["turns"] - figures.pop("turns_upto_0.025")
        figures["turns_over_100ms"] = figures["turns"] - figures.pop("turns_upto_0.1")
    return figures


def _sync_bytes(address: str) -> bytes:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://{address}")
    s.send(make_encoder().encode(Sync()))
    assert s.poll(60_000), "no snapshot"
    raw = s.recv()
    s.close(linger=0)
    return raw


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q * len(values)))]


def baseline_tree(commit: str) -> str:
    """This repository at `commit`, extracted into a temporary directory."""
    target = tempfile.mkdtemp(prefix="pdreg-baseline-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", default="10000,100000")
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--churn", type=float, default=0.0, help="changes per second")
    parser.add_argument("--measure", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=0.0,
                        help="seconds between the last registration and the window")
    parser.add_argument("--baseline", default="", help="a commit to run beside this tree")
    parser.add_argument("--only-baseline", action="store_true")
    parser.add_argument("--registry-args", default="",
                        help="extra args for this tree's registry; VARIANT;VARIANT runs "
                             "each (an empty one: the defaults)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--per-model", action="store_true",
                        help="subscribers serve one model each (router --models)")
    parser.add_argument("--sync-storm", type=int, default=0, metavar="VIEWS",
                        help="instead: VIEWS views asking for a snapshot at once")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="py-spy the registry over the window (DIR/TREE-N.txt, raw "
                             "stacks) and log its GC pauses over 1 ms (DIR/TREE-N-gc.log)")
    parser.add_argument("--scrape-every", type=float, default=0.0, metavar="S",
                        help="scrape the registry's /metrics every S seconds in the window")
    parser.add_argument("--nice-generator", type=int, default=0, metavar="N",
                        help="run the load generator at this nice level")
    parser.add_argument("--storm-models", type=int, default=0, metavar="K",
                        help="with --sync-storm: each view asks for K of the models")
    parser.add_argument("--storm-mem-gb", type=float, default=6.0, metavar="GB",
                        help="with --sync-storm: cap this process's address space meanwhile")
    parser.add_argument("--deadband", default="", metavar="MEMBERS:INTERVAL",
                        help="instead: digest entries/s per deadband setting (simulated)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the trees in turn N times (A B A B: the machine's load "
                             "drifts)")
    parser.add_argument("--no-baseline-figures", action="store_true",
                        help="do not scrape the baseline's loop histograms")
    parser.add_argument("--sub-procs", type=int, default=1, metavar="K",
                        help="spread the subscribers over K processes")
    args = parser.parse_args()
    # Several variants of this tree side by side: --registry-args "A;B" runs "this A" and
    # "this B" (an empty variant is the default flags).
    variants = args.registry_args.split(";")
    trees = [] if args.only_baseline else [
        ("this" + (f" {v.strip()}" if v.strip() else ""), ROOT, tuple(v.split()))
        for v in variants]
    tmp = None
    if args.baseline:
        tmp = baseline_tree(args.baseline)
        trees.insert(0, (args.baseline, tmp, ()))
    results = []
    try:
        if args.deadband:
            count, _, interval = args.deadband.partition(":")
            for row in deadband_entries(int(count), float(interval), args.measure):
                print(json.dumps(row), flush=True)
            return 0
        if args.sync_storm:
            for members in (int(m) for m in args.members.split(",")):
                for name, src, _ in trees:
                    print(json.dumps(sync_storm(name, src, members, args.sync_storm,
                                                args.storm_models, args.storm_mem_gb)),
                          flush=True)
            return 0
        for members in (int(m) for m in args.members.split(",")):
            for name, src, extra in trees * args.repeat:
                result = run_one(name, src, members, args.subscribers, args.churn,
                                 args.measure, extra, args.per_model, args.warmup,
                                 args.profile, args.scrape_every, args.nice_generator,
                                 args.sub_procs)
                results.append(result)
                print(json.dumps(asdict(result)), flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if not args.json:
        _table(results)
    return 0


def _table(results: list[Result]) -> None:
    cols = ["tree", "members", "churn_per_s", "interval_s", "offered_per_s", "sent_total",
            "handled_total",
            "answered_per_s",
            "registry_core_pct", "registry_us_per_heartbeat", "registry_us_per_delivered_msg",
            "propagation_p50_ms", "propagation_p99_ms", "first_p50_ms", "first_p99_ms",
            "sub_own_p99_ms", "sub_procs", "probe_reply_p50_ms", "probe_reply_p99_ms",
            "probes_lost", "generator_core_pct", "generator_us_per_heartbeat",
            "generator_late_p99_ms", "generator_late_max_ms", "generator_late_over_10ms",
            "generator_gap_max_ms", "generator_gc", "subscribers_gc_max_ms", "view_gc",
            "subscribers_core_pct",
            "pub_bytes_per_router_per_s", "view_core_pct", "wrongly_suspect",
            "registry_runq_wait_pct", "subscribers_runq_wait_pct", "turns_per_s", "turns_over_25ms",
            "turns_over_100ms", "snapshot_builds", "snapshot_build_ms_mean",
            "scrape_kb", "scrape_ms_max", "snapshot_ms",
            "snapshot_mb", "register_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        row = asdict(r)
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    sys.exit(main())
