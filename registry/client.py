"""Registry clients: `MembershipView`, a local copy of membership (ZeroMQ's Clone pattern).

Per registry the view keeps one link (registry/view_links.py: SYNCING, LIVE, AWAY).
Subscribe first, then ask for the snapshot (ZeroMQ Guide ch. 5). What a link holds and
how snapshots and events apply to it is `registry.replica.Replica`, and how several
registries make one view is `registry.merge.Merge`, both pure state; this module owns
the sockets and the timers.

A view learns the event port from a first Sync for the empty topic alone (the routers'
records: a few), subscribes, and asks for the snapshot it follows once the subscription
holds (its first message; SUBSCRIBE_SETTLE_S at most). Taught the port by that snapshot
instead, a view missed every change published before its subscription took hold: at 100k
members one always came, and the gap cost a second 40 MB snapshot. A change missed all
the same (a registry restarted, a subscription dropped) shows as a version gap in the
next event or digest (a digest comes every interval at the latest), and only then does
it sync again. The thread polls until
its next deadline (sync timeout, silence, a carried member's drop), never on a fixed tick.

With `loads_on_demand` (a router), the loads of a model apply as they come only while
readers ask for it (`ask`, on each request: ASKED_KEEP_S after the last ask). Every other
model's digests are decoded no further than their versions (a topic names its model)
and passed over (registry/replica.py); when such a model is asked for, the view fetches
its current loads with a Sync for that model alone, on a DEALER of its own. A router of
every model then pays for the loads of the models it serves requests for, not for the
fleet's (at 100k members ~20,000 load changes a second).

Readers get a `FrozenMap`: each update shares everything but what changed with the one
before, so an update costs the changed members, not a copy of the whole view.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec
import zmq

from registry import sessions
from registry.addresses import (
    DEFAULT_REGISTRY,
    REGISTRY_ENV,
    http_base,
    parse_models,
    parse_registries,
    request_snapshot,
)
from registry.frozen_map import FrozenMap
from registry.merge import Merge
from registry.replica import Applied, LiveMember, Replica
from registry.security import ClientCurve
from registry.teardown import Teardown
from registry.view_changes import Changes, ChangeTrail
from registry.view_links import Link, LinkState, LinkStatus
from wire.protocol import (
    Event,
    Reply,
    Snapshot,
    Sync,
    event_decoder,
    event_head_decoder,
    make_encoder,
    reply_decoder,
    topic_for,
)

__all__ = ["DEFAULT_REGISTRY", "REGISTRY_ENV", "LinkState", "LinkStatus", "LiveMember",
           "MembershipView", "http_base", "parse_models", "parse_registries",
           "request_snapshot"]

logger = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 1.0  # no snapshot by then: new socket, try again
THREAD_STOP_TIMEOUT_S = 10.0  # close() waits this long for the view thread
SYNC_BACKOFF_MAX_S = 2.0
SUBSCRIBE_SETTLE_S = 0.05  # a new subscription's first message, awaited this long at most
EVENTS_RCVHWM = 100_000
ASKED_KEEP_S = 60.0  # loads on demand: a model not asked for this long is held back again
ASKS_RECHECK_S = 1.0  # and the models asked for are looked at again this often


class MembershipView:
    """A local, eventually consistent copy of membership from one or more registries.

    A background thread subscribes to each registry's events, takes a snapshot, applies
    newer events and resynchronises on a version gap or a new epoch. Several registries
    are merged (registry/merge.py): a member is in the view while a live registry holds
    it; while every registry is away the last view is kept.

    `report()` needs a member session (only registered routers may report), which a view
    does not have: give it a `reporter`, such as the router's own `Agent.report`.
    """

    def __init__(self, registries: str | Sequence[str] | None = None, *,
                 models: Sequence[str] = (), curve: ClientCurve | None = None,
                 reporter: Callable[[str, int, str], None] | None = None,
                 token: str = "", loads_on_demand: bool = False) -> None:
        self.addresses = parse_registries(registries)
        self.models = tuple(models)
        self.loads_on_demand = loads_on_demand
        self.curve = curve
        self.reporter = reporter
        self.token = token  # proves Syncs to a registry beyond loopback (sessions.prove_sync)
        self._ctx = zmq.Context()
        self._links = [Link(i, address, Replica(address, per_model=bool(self.models),
                                                loads_on_demand=loads_on_demand))
                       for i, address in enumerate(self.addresses)]
        # Loads on demand: model name -> when a reader last asked for it (set by readers
        # on any thread, pruned by the view thread), and the names whose loads the view
        # thread applies as they come (swapped whole by it).
        self._asked: dict[str, float] = {}
        self._following: frozenset[str] = frozenset()
        self._asks_due = 0.0
        self._eager_topics: frozenset[bytes] = frozenset()  # the topics of those models
        self._merge = Merge([link.replica for link in self._links])
        self._members: FrozenMap[LiveMember] = FrozenMap()
        self._trail: ChangeTrail[LiveMember] = ChangeTrail(self._members)
        self._changed = threading.Condition()
        self._listeners: list[Callable[[Mapping[str, LiveMember]], None]] = []
        wake = f"inproc://pdreg-view-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()  # used by the view thread only
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._running = False
        self._closed = False
        self._teardown = Teardown(lambda: self._ctx.destroy(linger=0))
        self._thread: threading.Thread | None = None
        self._encoder = make_encoder()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> MembershipView:
        if self._thread is None:  # once: one thread owns the sockets
            self._running = True
            self._thread = threading.Thread(target=self._teardown.owning(self._run),
                                            name="pdreg-view", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and close every socket, never under the running thread (closed
        from a listener, the thread does on its way out). Safe twice, from any thread."""
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            running, self._running = self._running, False
            if running:
                with contextlib.suppress(zmq.ZMQError):
                    self._wake_tx.send(b"", zmq.NOBLOCK)
        thread = self._thread
        if (not self._teardown.close(thread, THREAD_STOP_TIMEOUT_S)
                and thread is not threading.current_thread()):
            logger.warning("[view] the view thread did not stop within %.0fs; it closes "
                           "its sockets when it does", THREAD_STOP_TIMEOUT_S)

    def __enter__(self) -> MembershipView:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reads (any thread) ------------------------------------------------------------

    def members(self) -> Mapping[str, LiveMember]:
        """The current view (immutable; swapped by reference, so free to call per request)."""
        return self._members

    def changes(self, since: int) -> Changes[LiveMember]:
        """The view's version, its members, and the ids changed after version `since`
        (None: not all known, read the members whole): a router's table follows these,
        not the whole view (registry/view_changes.py). Free when nothing changed."""
        return self._trail.since(since)

    def loads(self, model: str, after: int, upto: int) -> frozenset[str] | None:
        """The ids of `model` whose load alone changed in versions (after, upto]: not in
        `changes` (registry/view_changes.py). None: not known any more."""
        return self._trail.loads(model, after, upto)

    def loads_confirmed_at(self, model: str) -> float:
        """When the registries `model`'s members come from last confirmed their loads
        (monotonic; -inf if one never did): a member's load is current as of then, even
        if it has not changed since `LiveMember.load_at`. Per registry, the oldest of
        those (registry/merge.py)."""
        return self._merge.loads_confirmed_at(model)

    def ask(self, model: str) -> None:
        """A reader is about to read `model`'s loads (a request for it). With
        `loads_on_demand`, they apply as they come until ASKED_KEEP_S after the last ask;
        the first ask has what was held back applied, soon after (the view thread does
        it: until then `model`'s loads are as old as `loads_confirmed_at` says). Free
        enough to call per request; nothing without `loads_on_demand`."""
        if not self.loads_on_demand:
            return
        self._asked[model] = time.monotonic()
        if model not in self._following:
            self._wake()

    def links(self) -> list[LinkStatus]:
        return [LinkStatus(link.address, link.state, link.replica.epoch, link.replica.version,
                           len(link.replica.members), link.replica.snapshots,
                           len(link.replica.missed))
                for link in self._links]

    @property
    def synced(self) -> bool:
        """At least one registry has given us a snapshot."""
        return any(link.replica.synced for link in self._links)

    def wait_for(self, predicate: Callable[[Mapping[str, LiveMember]], bool],
                 timeout: float) -> bool:
        """Block until predicate(members()) is true or timeout; returns whether it was."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self._members), timeout)

    def add_listener(self, callback: Callable[[Mapping[str, LiveMember]], None]) -> None:
        """Call back (from the view's thread) after every change, with the new view."""
        self._listeners.append(callback)

    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        """Tell the registries a member failed a request, through `reporter` (never blocks).

        Without a reporter the report stays local (the router's own quarantine holds).
        """
        if self.reporter is not None:
            self.reporter(member_id, incarnation, problem)
        else:
            logger.debug("[view] no reporter: report on %s stays local", member_id)

    # --- the view thread ---------------------------------------------------------------

    def _run(self) -> None:
        decode_event = event_decoder()
        decode_head = event_head_decoder() if self.loads_on_demand else None
        decode_reply = reply_decoder()
        while self._running:
            now = time.monotonic()
            changed = False
            for link in self._links:
                changed |= self._check_timers(link, now)
            # Poll until the next deadline; rounded up, as pyzmq truncates to whole ms.
            timeout_ms = math.ceil(max(0.0, self._next_deadline(now) - now) * 1e3)
            ready = dict(self._poller.poll(timeout_ms))
            if self._wake_rx in ready:
                self._drain_wake()
            now = time.monotonic()
            for link in self._links:
                if link.dealer is not None and link.dealer in ready:
                    changed |= self._read_replies(link, decode_reply, now)
                if link.sub is not None and link.sub in ready:
                    changed |= self._read_events(link, decode_event, decode_head, now)
                if link.loads_dealer is not None and link.loads_dealer in ready:
                    changed |= self._read_loads(link, decode_reply, now)
            if self.loads_on_demand:
                self._follow_asks(now)
                for link in self._links:
                    self._fetch_loads(link, link.replica.take_to_fetch(), now)
            self._publish(now, changed)

    def _follow_asks(self, now: float) -> None:
        """Follow the loads of the models asked for within ASKED_KEEP_S and of their
        adapters' base models (the replicas name those whose loads are to be fetched);
        pass over every other model's. Looked at when a new name is asked for, and every
        ASKS_RECHECK_S (an adapter's base models change with membership)."""
        asked = self._asked
        if now < self._asks_due and asked.keys() <= self._following:
            return
        self._asks_due = now + ASKS_RECHECK_S
        names = set()
        for name, at in asked.copy().items():
            if now - at <= ASKED_KEEP_S:
                names.add(name)
            elif asked.get(name) == at:  # (asked again meanwhile: it stays)
                asked.pop(name, None)
        self._following = frozenset(names)
        bases = self._merge.bases_of(names)
        self._eager_topics = frozenset(map(topic_for, bases))
        for link in self._links:
            link.replica.want(bases)

    def _fetch_loads(self, link: Link, models: set[str], now: float) -> None:
        """Ask `link`'s registry for the current loads of `models` (a Sync for them alone,
        on the link's loads DEALER). Not while the link syncs: its snapshot has them."""
        if not models or link.state is not LinkState.LIVE:
            return
        if link.loads_dealer is None:
            link.loads_dealer = self._socket(zmq.DEALER)
            link.loads_dealer.connect(f"tcp://{link.address}")
            self._poller.register(link.loads_dealer, zmq.POLLIN)
        encode = self._encoder.encode
        sync = sessions.prove_sync(Sync(models=sorted(models)), self.token, encode)
        link.loads_dealer.send(encode(sync), zmq.NOBLOCK)
        if not link.loads_asked:
            link.loads_asked_at = now
        link.loads_asked.append(frozenset(models))
        logger.debug("[view] %s: fetching the loads of %s", link.address, sorted(models))

    def _read_loads(self, link: Link, decode: msgspec.msgpack.Decoder[Reply | Snapshot],
                    now: float) -> bool:
        changed = False
        while link.loads_dealer is not None:
            try:
                payload = link.loads_dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            models = link.loads_asked.popleft() if link.loads_asked else frozenset()
            link.loads_asked_at = now
            try:
                message = decode.decode(payload)
            except msgspec.MsgspecError as exc:
                logger.warning("[view] %s: undecodable loads: %s", link.address, exc)
                continue
            if isinstance(message, Snapshot):
                changed |= link.replica.apply_loads(message, models, now, time.time())
            else:  # refused (rate limited): asked again after SYNC_TIMEOUT_S
                logger.warning("[view] %s refused the loads' sync: %s", link.address,
                               message.reason)
                link.loads_asked.appendleft(models)
                link.loads_asked_at = now
                break
        return changed

    def _retry_loads(self, link: Link, now: float) -> None:
        """Loads asked for and not answered within SYNC_TIMEOUT_S: a new DEALER (one to a
        dead peer keeps its queue) asks again for all of them."""
        if not link.loads_asked or now - link.loads_asked_at < SYNC_TIMEOUT_S:
            return
        models = set().union(*link.loads_asked)
        link.loads_asked.clear()
        if link.loads_dealer is not None:
            self._poller.unregister(link.loads_dealer)
            link.loads_dealer.close(linger=0)
            link.loads_dealer = None
        self._fetch_loads(link, models, now)

    def _check_timers(self, link: Link, now: float) -> bool:
        changed = link.replica.drop_carried(now)
        self._retry_loads(link, now)
        if link.state is LinkState.LIVE and not self._merge.live(link.index, now):
            logger.warning("[view] registry %s silent past its lease (%.1fs): out of the "
                           "merge, resyncing", link.address,
                           self._merge.away_after_s(link.index))
            link.state = LinkState.AWAY
            link.next_sync_at = now
        elif link.state is LinkState.LIVE and link.replica.per_model:
            silent = link.replica.silent_model(now, self._merge.away_after_s(link.index))
            if silent is not None:
                logger.info("[view] %s: model %r silent while we hold members of it: "
                            "resync", link.address, silent)
                self._resync(link, now)
        if link.state is not LinkState.LIVE:
            waiting = link.sync_sent_at and now - link.sync_sent_at < SYNC_TIMEOUT_S
            if not waiting and now >= link.next_sync_at:
                if link.sync_sent_at:
                    # No answer: a DEALER to a dead peer keeps its queue; start afresh.
                    self._reset_dealer(link)
                    link.backoff_s = min(SYNC_BACKOFF_MAX_S, link.backoff_s * 2)
                self._send_sync(link, now)
        return changed

    def _next_deadline(self, now: float) -> float:
        """When `_check_timers` next has something to do for some link."""
        deadline = math.inf
        for link in self._links:
            if link.state is LinkState.LIVE:
                away_after_s = self._merge.away_after_s(link.index)
                deadline = min(deadline, self._merge.heard_at(link.index) + away_after_s)
                if link.replica.per_model:
                    deadline = min(deadline, link.replica.next_silence_at(away_after_s))
            elif link.sync_sent_at:
                deadline = min(deadline, max(link.sync_sent_at + SYNC_TIMEOUT_S,
                                             link.next_sync_at))
            else:
                deadline = min(deadline, link.next_sync_at)
            drop_at = link.replica.next_drop_at()
            if drop_at is not None:
                deadline = min(deadline, drop_at)
            if link.loads_asked:
                deadline = min(deadline, link.loads_asked_at + SYNC_TIMEOUT_S)
        return max(deadline, now)

    def _send_sync(self, link: Link, now: float) -> None:
        if link.dealer is None:
            link.dealer = self._socket(zmq.DEALER)
            link.dealer.connect(f"tcp://{link.address}")
            self._poller.register(link.dealer, zmq.POLLIN)
        encode = self._encoder.encode
        # Not subscribed yet: the empty topic alone, for the event port (see above). Else
        # the models it follows and the empty topic's (routers, planners), as subscribed.
        link.probing = link.sub is None
        models = [""] if link.probing else [*self.models, ""] if self.models else []
        sync = sessions.prove_sync(Sync(models=models), self.token, encode)
        link.dealer.send(encode(sync), zmq.NOBLOCK)
        link.sync_sent_at = now
        link.next_sync_at = now + link.backoff_s
        link.buffered.clear()

    def _reset_dealer(self, link: Link) -> None:
        if link.dealer is not None:
            self._poller.unregister(link.dealer)
            link.dealer.close(linger=0)
            link.dealer = None
        link.sync_sent_at = 0.0

    def _subscribe(self, link: Link, events_port: int) -> None:
        if link.sub is not None and link.events_port == events_port:
            return
        if link.sub is not None:
            self._poller.unregister(link.sub)
            link.sub.close(linger=0)
        host = link.address.rpartition(":")[0]
        link.sub = self._socket(zmq.SUB)
        link.sub.setsockopt(zmq.RCVHWM, EVENTS_RCVHWM)
        if self.models:
            for model in (*self.models, ""):
                link.sub.setsockopt(zmq.SUBSCRIBE, topic_for(model))
        else:
            link.sub.setsockopt(zmq.SUBSCRIBE, b"")
        link.sub.connect(f"tcp://{host}:{events_port}")
        link.events_port = events_port
        self._poller.register(link.sub, zmq.POLLIN)

    def _read_replies(self, link: Link, decode: msgspec.msgpack.Decoder[Reply | Snapshot],
                      now: float) -> bool:
        changed = False
        while link.dealer is not None:
            try:
                payload = link.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                message = decode.decode(payload)
            except msgspec.MsgspecError as exc:
                logger.warning("[view] %s: undecodable reply: %s", link.address, exc)
                continue
            self._merge.heard(link.index, now)
            if isinstance(message, Snapshot) and link.probing:
                # Subscribed, the snapshot to follow is asked for once the subscription
                # shows it holds (its first message), or after SUBSCRIBE_SETTLE_S from a
                # registry so quiet that it would miss nothing.
                self._subscribe(link, message.events_port)
                link.sync_sent_at, link.next_sync_at = 0.0, now + SUBSCRIBE_SETTLE_S
            elif isinstance(message, Snapshot):
                changed |= self._apply_snapshot(link, message, now)
            else:  # a refused Sync: rate limited, or another protocol version
                logger.warning("[view] %s refused the sync: %s", link.address, message.reason)
        return changed

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        return sock

    def _apply_snapshot(self, link: Link, snapshot: Snapshot, now: float) -> bool:
        needs_subscription = link.sub is None or link.events_port != snapshot.events_port
        link.sync_sent_at = 0.0
        link.backoff_s = 0.1
        if needs_subscription:
            # This snapshot taught us the port. Subscribe now and use it all the same:
            # whatever changed before the subscription took hold shows as a version gap
            # (the next event, or the next digest within an interval), which resyncs.
            self._subscribe(link, snapshot.events_port)
        replica = link.replica
        replica.apply_snapshot(snapshot, now, time.time())
        link.state = LinkState.LIVE
        self._merge.heard(link.index, now)
        buffered, link.buffered = link.buffered, []
        for event in buffered:
            if event.epoch == replica.epoch and event.version > replica.version:
                self._apply_event(link, event, now)
        logger.debug("[view] %s: snapshot epoch=%d version=%d members=%d", link.address,
                     snapshot.epoch, snapshot.version, len(snapshot.members))
        return True

    def _read_events(self, link: Link, decode: msgspec.msgpack.Decoder[Event],
                     decode_head: msgspec.msgpack.Decoder[Event] | None, now: float) -> bool:
        """`decode_head` (loads on demand): for the topics of models not followed."""
        changed = False
        eager = self._eager_topics
        while link.sub is not None:
            try:
                frames = link.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                continue
            decoder = decode if decode_head is None or frames[0] in eager else decode_head
            try:
                event = decoder.decode(frames[1])
            except msgspec.MsgspecError as exc:
                logger.warning("[view] %s: undecodable event: %s", link.address, exc)
                continue
            self._merge.heard(link.index, now)
            if link.state is not LinkState.LIVE:
                link.buffered.append(event)
                if link.probing and not link.sync_sent_at:
                    link.next_sync_at = now  # the subscription holds: sync (see above)
                continue
            changed |= self._apply_event(link, event, now)
        return changed

    def _apply_event(self, link: Link, event: Event, now: float) -> bool:
        applied = link.replica.apply(event, now)
        if applied is Applied.GAP:
            self._resync(link, now)
        return applied is Applied.CHANGED

    def _resync(self, link: Link, now: float) -> None:
        link.state = LinkState.SYNCING
        link.next_sync_at = now
        link.sync_sent_at = 0.0

    def _publish(self, now: float, changed: bool) -> None:
        """Merge what changed and hand it to readers. `changed`: something was applied,
        so waiters look again even when the view is the same (a first snapshot of an
        empty registry changes no member and makes the view `synced`)."""
        if not self._merge.update(now):
            if changed:
                with self._changed:
                    self._changed.notify_all()
            return
        view = self._merge.members
        self._trail.publish(view, self._merge.last_changed, self._merge.last_loaded)
        with self._changed:
            self._members = view
            self._changed.notify_all()
        for callback in self._listeners:
            try:
                callback(view)
            except Exception:
                logger.exception("[view] listener failed")

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._closed:
                with contextlib.suppress(zmq.ZMQError):
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
