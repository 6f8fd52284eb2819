"""What listens to the registry in `bench_scale.py`: raw subscribers and one real view.

`subscribers` holds raw SUB sockets, as a router's view holds one: the bytes a router
serving every model receives, when each probe event arrived at each subscriber
(propagation), and which steady members were wrongly marked suspect. `view_process` runs
one real `MembershipView` and reports its CPU over the window. Both run as child
processes and take "start" and "end" (the window) on their `ctl` queue.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field

import zmq

from bench.scale.fleet import MODELS, PROBE_MODEL, GcPauses
from registry.client import MembershipView
from wire.protocol import MemberUpdated, event_decoder

SUB_RCVHWM = 20_000  # per subscriber: one that falls behind loses messages (counted)
POLL_MS = 20


def _subscribe(ctx: zmq.Context, events_address: str, indices: range,
               per_model: bool) -> tuple[list[zmq.Socket], zmq.Poller]:
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
    return socks, poller


@dataclass
class Heard:
    """What a subscriber process heard. `arrivals`: probe k -> its arrival time at each
    subscriber; `own`: probe k -> per arrival, how long this process had been busy with
    other sockets since its poll returned (its own share of the delay, beyond waiting for
    a CPU). Bytes and messages count the all-topics subscriber alone, in the window."""

    nbytes: int = 0
    messages: int = 0
    arrivals: dict[int, list[float]] = field(default_factory=dict)
    own: dict[int, list[float]] = field(default_factory=dict)
    wrongly_suspect: set[str] = field(default_factory=set)

    def probe(self, event: MemberUpdated, now: float, polled: float) -> None:
        k = int(event.member.load.extra.get("probe", -1))
        self.arrivals.setdefault(k, []).append(now)
        self.own.setdefault(k, []).append(now - polled)


def subscribers(events_address: str, indices: range, per_model: bool, ready: mp.Queue,
                ctl: mp.Queue, out: mp.Queue) -> None:
    """Subscribers `indices` (of all the bench's, over --sub-procs processes). With
    `per_model`, every subscriber but the first serves one model, as a router started
    with --models does (its topic, the probe's and the pulse); the first one (index 0)
    takes every topic (the bytes a router serving every model receives)."""
    ctx = zmq.Context()
    socks, poller = _subscribe(ctx, events_address, indices, per_model)
    all_topics = socks[0] if indices.start == 0 else None
    heard = Heard()
    pauses = GcPauses()
    ready.put("subscribed")
    measuring = False
    while True:
        try:
            message = ctl.get_nowait()
        except Exception:
            message = None
        if message == "start":
            measuring, heard.nbytes, heard.messages = True, 0, 0
            pauses.reset()
        elif message == "end":
            break
        for s, _ in poller.poll(POLL_MS):
            _read(s, s is all_topics, measuring, heard)
    out.put((heard.nbytes, heard.messages, heard.arrivals, heard.own,
             sorted(heard.wrongly_suspect), pauses.figures()))
    ctx.destroy(linger=0)


_decode = event_decoder().decode
_PROBE_TOPIC = PROBE_MODEL.encode() + b"\0"


def _read(s: zmq.Socket, first: bool, measuring: bool, heard: Heard) -> None:
    """Everything waiting on one socket; `first`: the all-topics subscriber, which also
    counts bytes and watches every member for a wrong suspicion."""
    polled = time.monotonic()
    while True:
        try:
            topic, body = s.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        now = time.monotonic()
        if first and measuring:
            heard.nbytes += len(topic) + len(body)
            heard.messages += 1
        if topic == _PROBE_TOPIC:
            event = _decode(body)
            if isinstance(event, MemberUpdated):
                heard.probe(event, now, polled)
        elif first and measuring and body[:20].find(b"MemberUpdated") >= 0:
            event = _decode(body)
            if (isinstance(event, MemberUpdated) and event.member.suspect
                    and not event.member.spec.id.startswith("churn-")):
                heard.wrongly_suspect.add(event.member.spec.id)


def view_process(address: str, ctl: mp.Queue, out: mp.Queue) -> None:
    """One real `MembershipView`: its share of a core over the window, how many members
    it holds, its garbage collections."""
    view = MembershipView(address).start()
    view.wait_for(bool, 120)
    pauses = GcPauses()
    cpu0 = time.process_time()
    t0 = time.monotonic()
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
