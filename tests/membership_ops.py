"""Random membership histories, shared by the membership and replica property tests."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from registry.detector import DetectorConfig
from registry.membership import Membership
from registry.protocol import (
    ByeReason,
    Endpoints,
    Load,
    MemberRecord,
    MemberSpec,
    MemberState,
    Role,
)

CONFIG = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0, tick_period_s=0.1)
READY, JOINING, DRAINING = MemberState.READY, MemberState.JOINING, MemberState.DRAINING


def spec(member_id: str = "p0", incarnation: int = 1, model: str = "m") -> MemberSpec:
    return MemberSpec(id=member_id, incarnation=incarnation, role=Role.PREFILL, model=model,
                      protocol="reference", endpoints=Endpoints(http="http://127.0.0.1:9000"))


def fresh(config: DetectorConfig = CONFIG) -> Membership:
    return Membership(epoch=7, config=config)


def ticks(m: Membership, start: float, end: float, step: float = 0.1) -> None:
    """Tick like the loop does: at least once per tick period."""
    t = start
    while t < end:
        t = min(end, t + step)
        m.tick(t)


IDS = ["a", "b", "c", "d"]


@dataclass(frozen=True)
class Op:
    kind: str
    member: str = "a"
    incarnation: int = 1
    state: MemberState = READY
    dt: float = 0.0


ops = st.one_of(
    st.builds(Op, st.just("register"), st.sampled_from(IDS), st.integers(1, 4),
              st.sampled_from(list(MemberState))),
    st.builds(Op, st.just("heartbeat"), st.sampled_from(IDS), st.integers(0, 5),
              st.sampled_from(list(MemberState))),
    st.builds(Op, st.just("bye"), st.sampled_from(IDS), st.integers(1, 4)),
    st.builds(Op, st.just("report"), st.sampled_from(IDS), st.integers(1, 4)),
    st.builds(Op, st.just("drain"), st.sampled_from(IDS)),
    st.builds(Op, st.just("evict"), st.sampled_from(IDS)),
    st.builds(Op, st.just("wait"), dt=st.floats(0.01, 2.0)),
)


def apply(m: Membership, op: Op, now: float) -> float:
    if op.kind == "register":
        m.register(spec(op.member, op.incarnation), op.state, Load(), now)
    elif op.kind == "heartbeat":
        m.heartbeat(op.member, op.incarnation, op.state, Load(running=op.incarnation), now)
    elif op.kind == "bye":
        m.bye(op.member, op.incarnation, ByeReason.SHUTDOWN)
    elif op.kind == "report":
        m.report(op.member, op.incarnation, now)
    elif op.kind == "drain":
        m.drain(op.member)
    elif op.kind == "evict":
        m.evict(op.member)
    else:
        end = now + op.dt
        ticks(m, now, end)
        return end
    m.tick(now)
    return now


def essence(record: MemberRecord) -> tuple:
    """What events must reproduce (load travels in digests, not events)."""
    return (record.spec, record.state, record.suspect)


