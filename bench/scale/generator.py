"""The load generator: a whole fleet of members registering and heartbeating a registry.

It stands in for 100k hosts on a machine it shares with the registry: every microsecond
it spends per heartbeat is taken from the registry under test. So it sends what is due
once a tick and then reads what came back (not two polls of its 64 sockets per loop
turn), speaks ZMTP itself (`bench.scale.zmtp`), draws its random walk from a pool drawn
once, and freezes its fleet out of the garbage collector's reach.

Each member heartbeats at the interval the registry dictates, from its own phase, signed
as agents sign; registrations go WINDOW in flight per socket. After a pause (no CPU for
the generator, or a collection) what fell due goes out at up to CATCH_UP times the
fleet's rate, not in one burst: a real fleet's agents do not pause together. Over the
measured window it records how late each heartbeat went out after it fell due.

Run as a child process: `generator(address, members, churn_per_s, ctl, out)`; `ctl`
takes "start" and "end" (the window), `out` gets ("registered", seconds, missing,
interval) once the fleet is in, then ("done", marks, probes, probe_replies, figures).
"""

from __future__ import annotations

import gc
import heapq
import math
import multiprocessing as mp
import os
import random
import select
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from bench.scale.fleet import (
    CHURN_MEMBERS,
    KV_E4,
    MODELS,
    PROBE_EVERY_S,
    PROBE_MODEL,
    WALK_STEPS,
    GcPauses,
    Member,
    member_spec,
    walk_steps,
)
from bench.scale.zmtp import Wire
from bench.tables import nearest_rank
from registry import sessions
from wire.protocol import (
    Bye,
    ByeReason,
    Heartbeat,
    Load,
    MemberState,
    Register,
    ReplyStatus,
    make_encoder,
    reply_decoder,
)

SOCKETS = 64  # generator DEALERs (the registry does not care which carries whom)
# Registrations in flight per socket. Replies on one socket must stay below the ROUTER's
# send queue (1,000), or the registry drops them (as it would for a member not reading).
WINDOW = 32
TICK_S = 0.001
CTL_EVERY_S = 0.01  # (a look at the bench's queue is a syscall and an exception)
LATE_OVER_MS = 10.0  # a heartbeat sent later than this after it was due counts as late
CATCH_UP = 2.0  # after a pause, overdue heartbeats go out at this times the fleet's rate
BURST_S = 0.01  # ... after a burst of at most this many seconds' worth

# What a pending reply on a socket was about: None for a fleet heartbeat (the bulk), else
# (kind, member) with kind "register", "beat", "probe" or "bye".
Pending = tuple[str, Member] | None


def generator(address: str, members: int, churn_per_s: float, ctl: mp.Queue,
              out: mp.Queue, nice: int = 0) -> None:
    """A child process's body (see the module's docstring)."""
    os.nice(nice)  # --nice-generator: the registry first when the machine is short of CPU
    Generator(address, members, churn_per_s).run(ctl, out)


@dataclass
class Lateness:
    """In the measured window: how late each heartbeat went out after it was due, the
    longest gap between two ticks (the process paused or waiting for a CPU), the worst
    per second."""

    measuring: bool = False
    window_t0: float = 0.0
    late: list[float] = field(default_factory=list)
    late_per_s: dict[int, float] = field(default_factory=dict)
    gaps_over: int = 0
    gap_max: float = 0.0

    def tick(self, gap: float) -> None:
        if self.measuring:
            self.gap_max = max(self.gap_max, gap)
            self.gaps_over += gap > LATE_OVER_MS / 1e3

    def sent(self, now: float, count: int) -> None:
        """`count` heartbeats just went out (their lateness appended already)."""
        if self.measuring and self.late and count:
            second = int(now - self.window_t0)
            self.late_per_s[second] = max(self.late_per_s.get(second, 0.0),
                                          max(self.late[-count:]))

    def figures(self) -> dict[str, object]:
        late = sorted(self.late)
        return {"late_p50_ms": round(1e3 * nearest_rank(late, 0.5), 1),
                "late_p99_ms": round(1e3 * nearest_rank(late, 0.99), 1),
                "late_max_ms": round(1e3 * late[-1], 1) if late else math.nan,
                "late_over": sum(1 for t in late if t > LATE_OVER_MS / 1e3),
                "gap_max_ms": round(1e3 * self.gap_max, 1), "gaps_over": self.gaps_over,
                "late_per_s_ms": [round(1e3 * self.late_per_s.get(s, 0.0), 1)
                                  for s in range(max(self.late_per_s, default=-1) + 1)]}


class Generator:
    """The fleet, its sockets and its schedule (one process, one thread)."""

    def __init__(self, address: str, members: int, churn_per_s: float) -> None:
        self.rng = rng = random.Random(7)
        self.steps = walk_steps(rng)
        self.step = 0
        self.wires = [Wire(address) for _ in range(SOCKETS)]
        self.sends = [w.send for w in self.wires]
        self.encode = make_encoder().encode
        self.decode = reply_decoder().decode
        fleet = [Member(member_spec(f"decode-{i}", f"m{i % MODELS}", i), sessions.new_nonce(),
                        running=rng.randrange(64), kv_e4=rng.randrange(10_001))
                 for i in range(members)]
        self.churners = [Member(member_spec(f"churn-{j}", f"m{j % MODELS}", members + j),
                                sessions.new_nonce())
                         for j in range(CHURN_MEMBERS if churn_per_s else 0)]
        self.probe = Member(member_spec("probe-0", PROBE_MODEL, members + CHURN_MEMBERS + 1),
                            sessions.new_nonce())
        self.everyone = [*fleet, *self.churners, self.probe]
        self.everyone_index = {m.spec.id: i for i, m in enumerate(self.everyone)}
        self.probe_index = len(self.everyone) - 1
        self.churn_per_s = churn_per_s
        # The fleet lives as long as the process and makes no cycles: out of the
        # collector's walks (a full collection over 100k members takes ~35 ms, a pause
        # and then a burst).
        gc.freeze()
        self.pauses = GcPauses()
        # Replies come back in order per socket: what each pending one was about.
        self.pending: list[deque[Pending]] = [deque() for _ in self.wires]
        self.counts = {"sent": 0, "ok": 0, "other": 0, "registered": 0}
        self.interval = 1.0
        self.ok_reply = b""  # the encoded plain OK reply, once seen
        self.readable = select.epoll()
        for w in self.wires:
            self.readable.register(w.sock.fileno(), select.EPOLLIN)
        self.index = {w.sock.fileno(): k for k, w in enumerate(self.wires)}
        self.due: list[tuple[float, int]] = []  # (when, index into everyone): own phases
        self.started = time.monotonic()
        self.to_register = 0
        self.registered_reported = False
        self.probes: list[float] = []
        self.probe_replies: list[float] = []  # when each probe's reply was read
        self.next_probe = math.inf
        self.next_churn = math.inf
        self.marks: dict[str, dict[str, float]] = {}
        self.down: list[Member] = []
        self.lateness = Lateness()
        self.budget = 0.0
        self.typical_gap = TICK_S

    # --- the loop ---------------------------------------------------------------------

    def run(self, ctl: mp.Queue, out: mp.Queue) -> None:
        previous = time.monotonic()
        next_ctl = 0.0
        while True:
            if previous >= next_ctl:  # the bench's start/end, looked for every CTL_EVERY_S
                next_ctl = previous + CTL_EVERY_S
                if self._control(ctl) == "end":
                    break
            now = time.monotonic()
            gap = now - previous
            self.lateness.tick(gap)
            previous = now
            # 1) Registrations, WINDOW in flight per socket, while the registered beat.
            self._register_some(now, out)
            # 2) What is due, 3) the probe and the churn, 4) what came back.
            self._send_due(now, gap)
            self._probe_and_churn(now)
            self.drain()
            # 5) Sleep to the next tick (heartbeats due meanwhile wait for it: up to a
            # tick late, rather than a wake-up per heartbeat), or the probe's or a churn's.
            wait = min(now + TICK_S, self.next_probe, self.next_churn) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        out.put(("done", self.marks, self.probes, self.probe_replies,
                 {**self.lateness.figures(), **self.pauses.figures()}))
        self.readable.close()
        for w in self.wires:
            w.close()

    def _control(self, ctl: mp.Queue) -> str | None:
        try:
            message = ctl.get_nowait()
        except Exception:
            return None
        if message in ("start", "end"):
            self.marks[message] = {**self.counts, "t": time.monotonic(),
                                   "probes": len(self.probes)}
        if message == "start":
            self.lateness.measuring, self.lateness.window_t0 = True, time.monotonic()
            self.pauses.reset()
        return message

    def _register_some(self, now: float, out: mp.Queue) -> None:
        everyone, pending = self.everyone, self.pending
        while (self.to_register < len(everyone)
               and len(pending[self.to_register % SOCKETS]) < WINDOW):
            self.register(everyone[self.to_register], self.to_register % SOCKETS)
            self.to_register += 1
        if (not self.registered_reported and self.to_register == len(everyone)
                and self.counts["registered"] >= len(everyone)):
            self.registered_reported = True
            missing = sum(1 for m in everyone if not m.session)
            gc.freeze()  # the sessions and the schedule, too
            out.put(("registered", now - self.started, missing, self.interval))
            self.next_probe = now + 1.0
            self.next_churn = now + (1.0 / self.churn_per_s if self.churn_per_s else math.inf)

    def _send_due(self, now: float, gap: float) -> None:
        """The hot path: per heartbeat one heap pop and push, a walk step from the pool,
        the project's encoder and the member's own session. The bucket is as deep as two
        typical ticks, so a generator that gets the CPU only every few ms (a busy
        machine) still offers the fleet's whole rate."""
        due, everyone, steps, sends, pending = (self.due, self.everyone, self.steps,
                                                self.sends, self.pending)
        encode, seal, interval = self.encode, sessions.seal, self.interval
        ready, probe_index, step = MemberState.READY, self.probe_index, self.step
        late = self.lateness.late if self.lateness.measuring else None
        rate = len(due) / interval
        self.typical_gap += (gap - self.typical_gap) * 0.05
        budget = min(max(rate * max(BURST_S, 2.0 * self.typical_gap), 8.0),
                     self.budget + gap * CATCH_UP * rate)
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
            if late is not None:
                late.append(now - when)
        self.step, self.budget = step, budget
        self.counts["sent"] += sent
        self.lateness.sent(now, sent)

    def _probe_and_churn(self, now: float) -> None:
        if now >= self.next_probe:
            self.next_probe += PROBE_EVERY_S
            probes = self.probes
            state = MemberState.JOINING if len(probes) % 2 == 0 else MemberState.READY
            probes.append(time.monotonic())
            self.beat(self.probe, 0, {"probe": float(len(probes) - 1)}, state, "probe")
        while now >= self.next_churn:
            self.next_churn += 1.0 / self.churn_per_s
            if self.down and (self.rng.random() < 0.5
                              or len(self.down) > len(self.churners) // 2):
                member = self.down.pop(0)
                member.spec = msgspec.structs.replace(
                    member.spec, incarnation=member.spec.incarnation + 1)
                member.nonce, member.seq, member.up = sessions.new_nonce(), 0, True
                self.register(member, 1)
                continue
            member = self.rng.choice(self.churners)
            if member.up and member.session:
                member.seq += 1
                self.send(1, sessions.seal(member.session, self.encode(Bye(
                    member.spec.id, member.spec.incarnation, member.seq,
                    ByeReason.SHUTDOWN))), "bye", member)
                member.up = False
                member.session = b""
                self.down.append(member)

    # --- messages -----------------------------------------------------------------------

    def send(self, k: int, payload: bytes, kind: str, member: Member) -> None:
        self.sends[k](payload)
        self.pending[k].append((kind, member))

    def register(self, member: Member, k: int) -> None:
        self.send(k, self.encode(Register(spec=member.spec, nonce=member.nonce,
                                          state=MemberState.READY,
                                          load=Load(member.running))),
                  "register", member)

    def beat(self, member: Member, k: int, extra: dict[str, float], state: MemberState,
             kind: str) -> None:
        """A heartbeat outside the fleet's hot path (the probe)."""
        member.seq += 1
        d_running, d_kv = self.steps[self.step]
        self.step = (self.step + 1) % WALK_STEPS
        member.running = max(0, member.running + d_running)
        member.kv_e4 = min(10_000, max(0, member.kv_e4 + d_kv))
        self.send(k, sessions.seal(member.session, self.encode(Heartbeat(
            member.spec.id, member.spec.incarnation, member.seq, state,
            Load(member.running, 0, KV_E4[member.kv_e4], extra)))), kind, member)
        self.counts["sent"] += 1

    def drain(self) -> None:
        """Every reply that has arrived. The plain OK reply is the same bytes every time:
        compared, not decoded (the generator's CPU is not the registry's)."""
        read = time.monotonic()
        ok = 0
        ok_reply = self.ok_reply
        for fd, _ in self.readable.poll(0):
            k = self.index[fd]
            queue = self.pending[k]
            for payload in self.wires[k].read():
                about = queue.popleft()
                if about is None and payload == ok_reply:
                    ok += 1
                else:
                    self.on_reply(payload, *(about or ("beat", None)), read)
                    ok_reply = self.ok_reply
        self.counts["ok"] += ok
        for w in self.wires:
            if w.backlog:
                w.flush()

    def on_reply(self, payload: bytes, kind: str, member: Member | None, read: float) -> None:
        counts = self.counts
        if payload == self.ok_reply and kind != "register":
            counts["ok"] += 1
            if kind == "probe":
                self.probe_replies.append(read)
            return
        reply = self.decode(payload)
        self.interval = getattr(reply, "heartbeat_interval_s", self.interval)
        if kind == "register" and member is not None:
            counts["registered"] += 1
            if reply.status is ReplyStatus.OK:
                member.session = reply.session
                # Heartbeats from the moment it is registered, as agents do.
                heapq.heappush(self.due, (read + self.rng.random() * self.interval,
                                          self.everyone_index[member.spec.id]))
        elif kind in ("beat", "probe"):
            counts["ok" if reply.status is ReplyStatus.OK else "other"] += 1
            if reply.status is ReplyStatus.OK and not reply.reason:
                self.ok_reply = payload
            if kind == "probe":
                self.probe_replies.append(read)
