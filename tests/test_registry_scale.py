"""What keeps syncs and views cheap at fleet scale, over real sockets where it matters.

- a snapshot is encoded once per (models, version) and the same bytes go to everyone;
- the sync limiter counts bytes;
- control messages are dispatched by type, and a type without a handler is refused;
- a view syncs once, subscribes to the models it serves, and updates incrementally.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from membership_ops import fresh, spec
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
from registry.protocol import (
    ControlMessage,
    Reply,
    ReplyStatus,
    Snapshot,
    Sync,
    make_encoder,
    reply_decoder,
)
from registry.ratelimit import SyncLimiter
from registry.server import RegistryConfig, RegistryServer

WAIT_S = 10.0  # generous: other test processes share two cores


@pytest.fixture
def registry() -> Iterator[RegistryServer]:
    server = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=-1,
                                           heartbeat_interval_s=0.5, lease_s=5.0)).start()
    try:
        yield server
    finally:
        server.close()


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
            # view is live on the stream and had no reason to ask again.
            assert wait_until(lambda: math.isfinite(view.loads_confirmed_at("")), WAIT_S)
            assert registry.stats.syncs == 1
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
