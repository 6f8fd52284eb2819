"""An outsider replays a crashed engine's sniffed Register over real sockets: the
incarnation it brings back holds nothing against the engine's restart (more attacks on
the registry: tests/test_adversary.py)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from raw_member import RawMember
from test_adversary import SECURE, TOKEN, WAIT_S, record

from engine_agent.agent import new_incarnation
from pdreg.testing import wait_until
from registry.server import RegistryServer
from wire.protocol import Load, ReplyStatus, Role


@pytest.fixture
def secure(registry_factory: Callable[..., RegistryServer]) -> Callable[..., RegistryServer]:
    """Secured registries as test_adversary.py starts them (SECURE, then overrides)."""
    return lambda **overrides: registry_factory(**{**SECURE, **overrides})


def _expired(server, member: RawMember) -> bool:
    return record(server, member.id) is None


def test_a_replayed_register_cannot_lock_a_restarted_engine_out(secure):
    """The engine crashes without a bye; its lease runs out; an outsider who sniffed its
    Register replays it, which registers that incarnation again. It holds the id against
    nobody: the restarted engine's Register is taken at once, not refused as contested."""
    server = secure(heartbeat_interval_s=0.2, lease_s=1.0)
    crashed = RawMember(server.control_address, member_id="decode-10.0.0.7-8200",
                        role=Role.DECODE, token=TOKEN)
    sniffer = RawMember(server.control_address, member_id="attacker-1")
    restarted = RawMember(server.control_address, token=TOKEN,
                          spec=msgspec.structs.replace(crashed.spec,
                                                       incarnation=new_incarnation()))
    try:
        assert crashed.register().status is ReplyStatus.OK
        sniffed = crashed.last_frames
        assert crashed.heartbeat(Load(running=1)).status is ReplyStatus.OK  # then it dies
        assert wait_until(lambda: _expired(server, crashed), WAIT_S, poll_s=0.05)
        assert sniffer.send_frames(sniffed).status is ReplyStatus.OK  # back, unproven
        held = record(server, crashed.id)
        assert held is not None and held.spec.incarnation == crashed.spec.incarnation
        assert restarted.register().status is ReplyStatus.OK  # not "contested"
        assert record(server, crashed.id).spec.incarnation == restarted.spec.incarnation
        # Replays of the old incarnation are stale now, and change nothing.
        assert sniffer.send_frames(sniffed).status is ReplyStatus.STALE
        assert restarted.heartbeat(Load()).status is ReplyStatus.OK
        assert server.stats.rejections.get("contested", 0) == 0
    finally:
        for m in (crashed, sniffer, restarted):
            m.close()


def test_a_lapsed_member_that_heartbeats_again_holds_its_id(secure):
    """A partitioned engine that was expired registers again and proves itself with its
    own session: from then on it is alive, and a newer incarnation is contested."""
    server = secure(heartbeat_interval_s=0.2, lease_s=1.0)
    partitioned = RawMember(server.control_address, member_id="decode-10.0.0.7-8200",
                            role=Role.DECODE, token=TOKEN)
    rival = RawMember(server.control_address, token=TOKEN,
                      spec=msgspec.structs.replace(partitioned.spec,
                                                   incarnation=new_incarnation()))
    try:
        assert partitioned.register().status is ReplyStatus.OK
        assert partitioned.heartbeat(Load()).status is ReplyStatus.OK
        assert wait_until(lambda: _expired(server, partitioned), WAIT_S, poll_s=0.05)
        assert partitioned.heartbeat(Load()).status is ReplyStatus.UNKNOWN
        assert partitioned.register().status is ReplyStatus.OK
        assert partitioned.heartbeat(Load()).status is ReplyStatus.OK
        assert rival.register().status is ReplyStatus.REJECTED
        assert server.stats.rejections.get("contested", 0) == 1
    finally:
        partitioned.close()
        rival.close()
