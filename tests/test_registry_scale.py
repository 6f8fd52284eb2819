"""What keeps syncs and views cheap at fleet scale, over real sockets where it matters.

- a snapshot is encoded once per (models, version) and the same bytes go to everyone;
- the sync limiter counts bytes;
- control messages are dispatched by type, and a type without a handler is refused;
- a view syncs once, subscribes to the models it serves, and updates incrementally.
"""

from __future__ import annotations

import gc
import math
import typing
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from membership_ops import fresh, signed, spec
from raw_member import RawMember, member_spec

from pdreg.testing import wait_until
from registry import frozen_map
from registry.client import MembershipView
from registry.control import (
    SNAPSHOT_MAX_AGE_S,
    SNAPSHOT_REUSE_FACTOR,
    ControlChannel,
    SnapshotCache,
)
from registry.frozen_map import FrozenMap
from registry.metrics import LoopStats
from registry.ratelimit import SyncLimiter
from registry.server import RegistryServer
from wire.protocol import (
    ControlMessage,
    Reply,
    ReplyStatus,
    Snapshot,
    Sync,
    make_encoder,
    reply_decoder,
)

WAIT_S = 10.0  # generous: other test processes share two cores


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryServer]) -> RegistryServer:
    return registry_factory(http_port=-1, heartbeat_interval_s=0.5, lease_s=5.0)


@pytest.fixture
def channel() -> Iterator[tuple[ControlChannel, zmq.Socket]]:
    """A control channel on a real ROUTER, and a DEALER talking to it."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://control")
    dealer.connect("inproc://control")
    try:
        yield ControlChannel(router, fresh(), LoopStats(), epoch=7, token=""), dealer
    finally:
        ctx.destroy(linger=0)


def _snapshot(payload: bytes) -> Snapshot:
    return msgspec.msgpack.decode(payload, type=Snapshot)


# --- snapshots: encoded once, the same bytes for everyone -------------------------------


def test_a_snapshot_is_encoded_once_per_version_and_refreshed_as_it_ages(channel):
    control, _ = channel
    membership = control.membership
    membership.join(spec("p0"), now=0.0)
    cache = control._snapshots = SnapshotCache(clock=lambda: 0.0)  # encoding takes no time
    first = cache.get(control, [], 0.0)
    assert cache.get(control, [], 0.1) is first  # same version: the very same bytes
    assert control.stats.snapshots_encoded == 1
    membership.join(spec("p1"), now=0.2)  # a change: the next requester gets it
    second = cache.get(control, [], 0.2)
    assert second is not first
    assert {r.spec.id for r in _snapshot(second).members} == {"p0", "p1"}
    assert cache.get(control, [], 0.21 + SNAPSHOT_MAX_AGE_S) is not second  # loads aged
    assert cache.get(control, ["m"], 1.0) is not cache.get(control, ["other"], 1.0)
    assert _snapshot(cache.get(control, ["other"], 1.0)).members == []


def test_a_snapshot_slow_to_encode_is_served_a_while_even_as_membership_moves(channel):
    """Encoding a big fleet must not eat the loop: served for REUSE_FACTOR times as long
    as it took, whatever changed (views catch up from events, or resync on a gap)."""
    control, _ = channel
    ticks = iter([0.0, 0.03, 1.0, 1.03])  # each encoding takes 30 ms
    cache = control._snapshots = SnapshotCache(clock=lambda: next(ticks))
    control.membership.join(spec("p0"), now=0.0)
    first = cache.get(control, [], 0.0)
    control.membership.join(spec("p1"), now=0.1)
    reuse_s = SNAPSHOT_REUSE_FACTOR * 0.03
    assert cache.get(control, [], reuse_s - 0.01) is first
    assert control.stats.snapshots_encoded == 1
    later = cache.get(control, [], reuse_s + 0.01)
    assert {r.spec.id for r in _snapshot(later).members} == {"p0", "p1"}


def test_many_views_asking_at_once_share_one_encoding(registry):
    members = [RawMember(registry.control_address, member_id=f"prefill-10.0.0.1-{9000 + i}")
               for i in range(3)]
    askers = [RawMember(registry.control_address, member_id=f"asker-{i}") for i in range(8)]
    try:
        for m in members:
            assert m.register().status is ReplyStatus.OK
        encoded_before = registry.stats.snapshots_encoded
        for asker in askers:  # all sent before any answer is read
            asker.sock.send(make_encoder().encode(Sync()))
        replies = [a.receive() for a in askers]
        assert all(isinstance(r, Snapshot) and len(r.members) == 3 for r in replies)
        # One encoding (two if the snapshot aged past SNAPSHOT_MAX_AGE_S meanwhile).
        assert registry.stats.snapshots_encoded - encoded_before <= 2
        assert registry.stats.syncs >= 8
    finally:
        for m in (*members, *askers):
            m.close()


def test_the_sync_limiter_counts_bytes_and_hands_back_what_it_refused():
    limiter = SyncLimiter(peer_burst=5, peer_syncs_per_s=1, bytes_per_s=1_000,
                          burst_bytes=1_000)
    assert limiter.wait_s(b"a", 600, 0.0) == 0
    assert limiter.wait_s(b"b", 600, 0.0) == pytest.approx(0.2)  # 400 left of 1,000
    assert limiter.wait_s(b"b", 300, 0.0) == 0  # a smaller snapshot still fits
    # b's refused sync did not spend b's own budget: 5 in the burst, 1 used.
    assert [limiter.peer_wait_s(b"b", 0.0) for _ in range(4)] == [0, 0, 0, 0]
    assert limiter.peer_wait_s(b"b", 0.0) > 0


# --- dispatch by type --------------------------------------------------------------------


def test_an_event_leaves_after_its_own_message_not_after_the_rest_of_the_batch(channel):
    """A state change queued behind a thousand heartbeats: its event is handed to the
    publisher as soon as its message is handled (the heartbeats after it wait), not after
    the whole batch, so routers hear of it without the batch's delay."""
    from wire.protocol import Heartbeat, Load, MemberState, control_decoder

    control, dealer = channel
    membership = control.membership
    membership.join(spec("flipper"), now=0.0)
    for i in range(20):
        membership.join(spec(f"steady-{i}"), now=0.0)
    membership.take_events()
    seq = iter(range(1, 10_000))

    def beat(member_id: str, state: MemberState = MemberState.READY) -> bytes:
        message = Heartbeat(member_id, 1, next(seq), state, Load(running=1))
        return signed(membership.session_of(member_id, 1), message)[1]

    queued = [beat(f"steady-{i % 20}") for i in range(10)]
    queued.append(beat("flipper", MemberState.JOINING))
    queued += [beat(f"steady-{i % 20}") for i in range(1_000)]
    for payload in queued:
        dealer.send(payload)
    wait_until(lambda: control.sock.poll(0), WAIT_S)
    published: list[tuple[int, list]] = []  # (heartbeats handled then, events)
    control.on_events = lambda: published.append((control.stats.heartbeats,
                                                  membership.take_events()))
    decoder = control_decoder()

    def handle_all() -> bool:
        control.process(1.0, decoder)
        return control.stats.heartbeats >= len(queued)

    assert wait_until(handle_all, WAIT_S)
    assert [(at, [e.member.state for e in events]) for at, events in published] == [
        (11, [MemberState.JOINING])]
    replies = [reply_decoder().decode(dealer.recv()) for _ in queued]
    assert all(r.status is ReplyStatus.OK for r in replies)


def test_every_control_message_type_has_its_own_handler(channel):
    control, _ = channel
    assert set(typing.get_args(ControlMessage)) == set(control._handlers)
    assert len(set(control._handlers.values())) == len(control._handlers)


def test_a_message_type_without_a_handler_is_refused_not_taken_for_a_sync(channel):
    control, dealer = channel

    class Novel(msgspec.Struct, tag=True):  # a type some later protocol might add
        id: str = "x"

    dealer.send(b"ping")
    identity, _ = control.sock.recv_multipart()
    control._handle(identity, Novel(), b"", 0.0)  # type: ignore[arg-type]
    control.flush_replies()
    assert dealer.poll(WAIT_S * 1e3)
    reply = reply_decoder().decode(dealer.recv())
    assert isinstance(reply, Reply)
    assert reply.status is ReplyStatus.REJECTED
    assert "unhandled" in reply.reason
    assert control.stats.rejections["unhandled"] == 1
    assert control.stats.syncs == 0


# --- views -------------------------------------------------------------------------------


def test_a_view_syncs_once_when_nothing_changes_meanwhile(registry):
    member = RawMember(registry.control_address)
    try:
        member.register()
        with MembershipView(registry.control_address) as view:
            assert view.wait_for(lambda m: member.id in m, WAIT_S)
            # A digest (one per interval at least) came through the subscription, so the
            # view is live on the stream and had no reason to ask again: the empty
            # topic's snapshot (for the event port) and the one it follows, no third.
            model = view.members()[member.id].record.spec.model
            assert wait_until(lambda: math.isfinite(view.loads_confirmed_at(model)), WAIT_S)
            assert [link.snapshots for link in view.links()] == [1]
            assert registry.stats.syncs == 2
    finally:
        member.close()


def test_with_two_io_threads_heartbeats_and_the_fan_out_each_get_their_own(registry_factory):
    """--io-threads 2: the control socket's connections on the first libzmq I/O thread,
    the PUB fan-out on the second; members and views work as with one."""
    server = registry_factory(http_port=-1, heartbeat_interval_s=0.5, lease_s=5.0,
                              io_threads=2)
    member = RawMember(server.control_address)
    try:
        assert server._control.getsockopt(zmq.AFFINITY) == 0b01
        assert server._events.getsockopt(zmq.AFFINITY) == 0b10
        with MembershipView(server.control_address) as view:
            member.register()
            assert view.wait_for(lambda m: member.id in m, WAIT_S)  # an event, on PUB
            assert member.heartbeat().status is ReplyStatus.OK
            member.bye()
            assert view.wait_for(lambda m: member.id not in m, WAIT_S)
    finally:
        member.close()


def test_a_view_for_some_models_holds_only_those(registry):
    tiny = RawMember(registry.control_address, spec=member_spec("prefill-10.0.0.1-1"))
    other = RawMember(registry.control_address,
                      spec=member_spec("prefill-10.0.0.1-2", model="other"))
    late = RawMember(registry.control_address,
                     spec=member_spec("prefill-10.0.0.1-3", model="other"))
    try:
        tiny.register()
        other.register()
        with MembershipView(registry.control_address, models=["tiny"]) as view:
            assert view.wait_for(lambda m: tiny.id in m, WAIT_S)
            late.register()  # an event on a topic the view did not subscribe to
            tiny.bye()
            assert view.wait_for(lambda m: tiny.id not in m, WAIT_S)
            assert set(view.members()) == set()
    finally:
        for m in (tiny, other, late):
            m.close()


keys = st.sampled_from([f"k{i}" for i in range(12)])
changes = st.dictionaries(keys, st.one_of(st.none(), st.integers(0, 5)), max_size=8)


@given(st.lists(changes, max_size=40), st.integers(0, 3), st.sampled_from([0, 3, 256]))
def test_frozen_map_equals_a_dict_and_old_versions_never_change(batches, base_size, fold):
    """`fold`: the overlay size that folds it into the base (small ones fold often)."""
    saved, frozen_map.OVERLAY_MIN = frozen_map.OVERLAY_MIN, fold
    try:
        check_frozen_map(batches, base_size)
    finally:
        frozen_map.OVERLAY_MIN = saved


def check_frozen_map(batches, base_size):
    expected = {f"k{i}": -1 for i in range(base_size)}
    current = FrozenMap(expected)
    history = [(current, dict(expected))]
    for batch in batches:
        current = current.updated(batch)
        for key, value in batch.items():
            if value is None:
                expected.pop(key, None)
            else:
                expected[key] = value
        history.append((current, dict(expected)))
    for version, want in history:
        assert dict(version.items()) == want
        assert len(version) == len(want)
        assert sorted(version) == sorted(want)
        assert sorted(version.values()) == sorted(want.values())
        assert all(k in version for k in want)
        assert all(version.get(f"k{i}") == want.get(f"k{i}") for i in range(12))
        assert version.get("k99", -7) == -7
        assert not gc.is_tracked(version._base)  # a fold leaves nothing to walk
        assert not any(f"k{i}" in version for i in range(12) if f"k{i}" not in want)
        assert version == want


# --- the CLI flags -------------------------------------------------------------------------


def test_router_and_planner_take_the_models_they_serve():
    from pdreg import cli, cmd_planner

    parser = cli.build_parser()
    assert parser.parse_args(["router", "--models", "llama, qwen,llama"]).models == (
        "llama", "qwen")
    assert parser.parse_args(["router"]).models == ()  # every model
    planner = parser.parse_args(["planner", "--models", "qwen", "--model", "llama"])
    assert cmd_planner._planned_models(planner) == ("llama", "qwen")
    assert cmd_planner.config_from(planner).models == frozenset({"llama", "qwen"})


def test_a_model_name_no_member_could_have_is_refused_at_the_command_line(capsys):
    from pdreg import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["router", "--models", "bad\x01name"])
    assert "printable" in capsys.readouterr().err


# --- churn over real sockets ---------------------------------------------------------------

CHURN_MEMBERS = 2_000
CHURN_FLIPS_PER_S = 20
CHURN_SECONDS = 6.0
COALESCE_S = 0.001


def test_under_churn_every_heartbeat_is_answered_and_no_steady_member_expires(
        registry_factory):
    """2,000 members heartbeating every second over a few sockets (as many agents would),
    while 20 times a second a `churn-*` member leaves or comes back as a new incarnation.
    Every heartbeat gets an OK, and no member that kept beating is expired."""
    registry = registry_factory(http_port=-1, heartbeat_interval_s=1.0, lease_s=6.0)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{registry.events_port}")
        fleet = _ChurnFleet(ctx, registry.control_address)
        fleet.register_all()
        fleet.run(CHURN_SECONDS)
        assert wait_until(lambda: fleet.collect() or fleet.answered == fleet.sent, WAIT_S)
        expired = _expired_ids(sub)
        assert fleet.sent >= CHURN_MEMBERS * (CHURN_SECONDS - 1)
        assert fleet.refused == 0
        assert fleet.flips >= CHURN_FLIPS_PER_S * (CHURN_SECONDS - 1)
        assert {i for i in expired if not i.startswith("churn-")} == set()
        assert len(registry.members()) >= CHURN_MEMBERS
    finally:
        ctx.destroy(linger=0)


def test_under_a_high_rate_the_loop_batches_messages_and_still_answers_every_one(
        registry_factory):
    """Above 2,000 messages/s the loop pauses between turns (registry.coalesce): turns
    each handle a batch, every heartbeat is still answered OK, and once the rate falls the
    loop handles each message as it arrives again."""
    import time

    registry = registry_factory(http_port=-1, heartbeat_interval_s=1.0, lease_s=6.0,
                                coalesce_s=COALESCE_S)
    ctx = zmq.Context()
    try:
        fleet = _ChurnFleet(ctx, registry.control_address)
        fleet.register_all()
        assert not registry.stats.coalescing
        start = time.monotonic()
        beats = 0

        def flood(until: Callable[[], bool], seconds: float) -> None:
            """8,000 heartbeats/s (four times the threshold) until `until()` or `seconds`."""
            nonlocal beats
            began, sent = time.monotonic(), beats
            while time.monotonic() - began < seconds and not until():
                due = sent + int((time.monotonic() - began) * 8_000)
                while beats < due:
                    fleet.beat(beats % CHURN_MEMBERS)
                    beats += 1
                fleet.collect()
                time.sleep(0.005)

        # The first full second at that rate turns the pauses on...
        flood(lambda: registry.stats.coalescing, 6.0)
        assert registry.stats.coalescing, f"{beats} heartbeats in {time.monotonic() - start:.1f}s"
        # ...and from then on each turn takes a batch, not a message or two.
        turns_before, sent_before = sum(registry.stats.turns.counts), fleet.sent
        flood(lambda: not registry.stats.coalescing, 1.5)
        assert registry.stats.coalescing  # the rate held all along
        turns = sum(registry.stats.turns.counts) - turns_before
        # (A loop that spins between deadlines, as it did around each pulse, fails here.)
        assert turns < (fleet.sent - sent_before) / 3, (turns, fleet.sent - sent_before)
        assert wait_until(lambda: fleet.collect() or fleet.answered == fleet.sent, WAIT_S)
        assert fleet.refused == 0
        # The rate fell to nothing: the next window ends the pauses.
        fleet.beat(0)
        assert wait_until(lambda: fleet.collect() or not registry.stats.coalescing, WAIT_S)
    finally:
        ctx.destroy(linger=0)


def _expired_ids(sub: zmq.Socket) -> set[str]:
    from wire.protocol import LeaveReason, MemberLeft, event_decoder

    decode = event_decoder().decode
    expired = set()
    while sub.poll(200):
        _, body = sub.recv_multipart()
        event = decode(body)
        if isinstance(event, MemberLeft) and event.reason is LeaveReason.EXPIRED:
            expired.add(event.id)
    return expired


class _ChurnFleet:
    SOCKETS = 16

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        from registry import sessions

        self.sessions = sessions
        self.socks = [ctx.socket(zmq.DEALER) for _ in range(self.SOCKETS)]
        for s in self.socks:
            s.connect(f"tcp://{address}")
        self.encode = make_encoder().encode
        self.decode = reply_decoder().decode
        self.specs = [member_spec(f"decode-10.0.{i // 250}.{i % 250}-1", http="http://10.0.0.1:1")
                      for i in range(CHURN_MEMBERS)]
        self.specs += [member_spec(f"churn-{j}", http="http://10.0.0.2:1") for j in range(50)]
        self.keys: dict[int, bytes] = {}
        self.seq: dict[int, int] = {}
        self.pending: list[list[tuple[str, int]]] = [[] for _ in self.socks]
        self.sent = self.answered = self.refused = self.flips = 0

    def _send(self, i: int, kind: str, payload: bytes) -> None:
        k = i % self.SOCKETS
        self.socks[k].send(payload)
        self.pending[k].append((kind, i))

    def register(self, i: int) -> None:
        from wire.protocol import MemberState, Register

        self._send(i, "register", self.encode(Register(
            spec=self.specs[i], nonce=self.sessions.new_nonce(), state=MemberState.READY)))

    def register_all(self) -> None:
        for i in range(len(self.specs)):
            self.register(i)
            if i % 200 == 199:
                self.collect()
        assert wait_until(lambda: self.collect() or len(self.keys) == len(self.specs), WAIT_S)

    def beat(self, i: int) -> None:
        from wire.protocol import Heartbeat, Load, MemberState

        self.seq[i] = self.seq.get(i, 0) + 1
        spec_ = self.specs[i]
        beat = Heartbeat(spec_.id, spec_.incarnation, self.seq[i], MemberState.READY,
                         Load(running=self.seq[i] % 5))
        self._send(i, "beat", self.sessions.seal(self.keys[i], self.encode(beat)))
        self.sent += 1

    def flip(self, j: int) -> None:
        from wire.protocol import Bye, ByeReason

        i = CHURN_MEMBERS + j % 50
        if i in self.keys:  # up: leave
            self.seq[i] = self.seq.get(i, 0) + 1
            spec_ = self.specs[i]
            self._send(i, "bye", self.sessions.seal(self.keys.pop(i), self.encode(
                Bye(spec_.id, spec_.incarnation, self.seq[i], ByeReason.SHUTDOWN))))
        else:  # down: come back as a new incarnation
            self.specs[i] = msgspec.structs.replace(
                self.specs[i], incarnation=self.specs[i].incarnation + 1)
            self.seq[i] = 0
            self.register(i)
        self.flips += 1

    def collect(self) -> None:
        for k, s in enumerate(self.socks):
            while s.poll(0):
                reply = self.decode(s.recv())
                kind, i = self.pending[k].pop(0)
                if kind == "register" and reply.status is ReplyStatus.OK:
                    self.keys[i] = reply.session
                elif kind == "beat":
                    if reply.status is ReplyStatus.OK:
                        self.answered += 1
                    else:
                        self.refused += 1

    def run(self, seconds: float) -> None:
        """Each steady member beats once a second in its own phase; churn runs beside (each
        churn member flips every 2.5 s, well inside its lease, so it needs no beats)."""
        import time

        start = time.monotonic()
        phases = sorted((i * 1.0 / CHURN_MEMBERS, i) for i in range(CHURN_MEMBERS))
        beats_done = 0
        flips_done = 0
        while (elapsed := time.monotonic() - start) < seconds:
            due_beats = int(elapsed * CHURN_MEMBERS)
            while beats_done < due_beats:
                _, i = phases[beats_done % CHURN_MEMBERS]
                self.beat(i)
                beats_done += 1
            while flips_done < int(elapsed * CHURN_FLIPS_PER_S):
                self.flip(flips_done)
                flips_done += 1
            self.collect()
            time.sleep(0.002)


def test_strangers_asking_for_many_model_sets_cannot_make_the_loop_encode_past_its_budget():
    """Who may Sync: anyone who reaches the control port (a view holds no credential).
    What a stranger can change: nothing; what it can cost: encodings. Each distinct model
    set is a fresh encoding, and fresh connections get fresh per-peer bursts, so the byte
    budget is charged before encoding, on an estimate."""
    from wire.protocol import control_decoder

    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.bind("inproc://control-flood")
        membership = fresh()
        for i in range(50):
            membership.join(spec(f"p{i}"), now=0.0)
        control = ControlChannel(router, membership, LoopStats(), epoch=7, token="")
        # Room for about three snapshots of these 50 members, and no refill.
        control._syncs = SyncLimiter(bytes_per_s=1e-9, burst_bytes=3.5 * 50 * 256)
        strangers = []
        for i in range(20):  # each from a fresh connection, each a new model set
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("inproc://control-flood")
            dealer.send(make_encoder().encode(Sync(models=["m", f"x{i}"])))
            strangers.append(dealer)
        decoder = control_decoder()
        while router.poll(100):
            control.process(0.0, decoder)
        replies = [reply_decoder().decode(d.recv()) for d in strangers]
        served = [r for r in replies if isinstance(r, Snapshot)]
        # About three (the estimate is learned from the first encoding), never twenty.
        assert 3 <= len(served) <= 5
        assert all(len(r.members) == 50 for r in served)
        assert control.stats.snapshots_encoded == len(served)  # refused: never encoded
        assert control.stats.rejections["rate"] == 20 - len(served)
        assert len(membership) == 50  # and nothing changed
    finally:
        ctx.destroy(linger=0)
