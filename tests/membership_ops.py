"""Random membership histories, shared by the membership and replica property tests.

`Fleet` is a `Membership` plus what its legitimate members hold (their nonces, the
sessions the registry gave them, their seqs), with short helpers that sign as a real agent
does: `join`, `beat`, `leave`, `accuse` (a router's failure report).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from hypothesis import strategies as st

from registry import sessions
from registry.admission import Limits
from registry.detector import DetectorConfig
from registry.membership import Membership, Outcome
from registry.store.records import CordonIntent, DrainIntent, EvictIntent, IntentKind
from wire.protocol import (
    Bye,
    ByeReason,
    Endpoints,
    Heartbeat,
    Load,
    MemberRecord,
    MemberSpec,
    MemberState,
    ReplyStatus,
    Report,
    Role,
    make_encoder,
)

CONFIG = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0, tick_period_s=0.1)
READY, JOINING, DRAINING = MemberState.READY, MemberState.JOINING, MemberState.DRAINING
ROUTER = "router-0"
_encode = make_encoder().encode
M = TypeVar("M")


def spec(member_id: str = "p0", incarnation: int = 1, model: str = "m",
         role: Role = Role.PREFILL) -> MemberSpec:
    return MemberSpec(id=member_id, incarnation=incarnation, role=role,
                      model="" if role is Role.API_SERVER else model,
                      protocol="reference", endpoints=Endpoints(http="http://127.0.0.1:9000"))


def nonce_for(member_id: str, incarnation: int) -> bytes:
    """The nonce the legitimate process of (id, incarnation) registers with."""
    return hashlib.blake2b(f"{member_id}/{incarnation}".encode(), digest_size=16).digest()


def signed(session: bytes, message: M) -> tuple[M, bytes]:
    """`message` sealed with `session` as it arrives at the registry: decoded, and bytes."""
    payload = sessions.seal(session, _encode(message))
    return msgspec.msgpack.decode(payload, type=type(message)), payload


class Fleet(Membership):
    def __init__(self, config: DetectorConfig = CONFIG, limits: Limits | None = None,
                 epoch: int = 7) -> None:
        super().__init__(epoch=epoch, config=config, limits=limits)
        self.sessions: dict[tuple[str, int], bytes] = {}
        self._seq = itertools.count(1)

    def join(self, spec: MemberSpec, state: MemberState = READY, load: Load | None = None,
             now: float = 0.0) -> Outcome:
        outcome = self.register(spec, state, load or Load(), now,
                                nonce=nonce_for(spec.id, spec.incarnation))
        if outcome.status is ReplyStatus.OK:
            self.sessions[(spec.id, spec.incarnation)] = outcome.session
        return outcome

    def session_of(self, member_id: str, incarnation: int) -> bytes:
        return self.sessions.get((member_id, incarnation), b"\0" * sessions.SESSION_BYTES)

    def beat(self, member_id: str, incarnation: int, state: MemberState = READY,
             load: Load | None = None, now: float = 0.0) -> Outcome:
        beat = Heartbeat(member_id, incarnation, next(self._seq), state, load or Load())
        return self.heartbeat(*signed(self.session_of(member_id, incarnation), beat), now)

    def leave(self, member_id: str, incarnation: int,
              reason: ByeReason = ByeReason.SHUTDOWN) -> Outcome:
        bye = Bye(member_id, incarnation, next(self._seq), reason)
        return self.bye(*signed(self.session_of(member_id, incarnation), bye))

    def accuse(self, member_id: str, incarnation: int, now: float,
               problem: str = "connect refused") -> Outcome:
        """A registered router reports `member_id` (the router joins first if need be)."""
        router = self.get(ROUTER)
        if router is None:
            self.join(spec(ROUTER, 1, role=Role.API_SERVER), now=now)
            router = self.get(ROUTER)
        assert router is not None
        inc = router.spec.incarnation
        report = Report(ROUTER, inc, next(self._seq), member_id, incarnation, problem)
        return self.report(*signed(self.session_of(ROUTER, inc), report), now)


def fresh(config: DetectorConfig = CONFIG, limits: Limits | None = None,
          epoch: int = 7) -> Fleet:
    return Fleet(config, limits, epoch)


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
    # What the store's watch brings (registry.store): intents an operator set anywhere.
    st.builds(Op, st.just("store_drain"), st.sampled_from(IDS), st.integers(1, 4)),
    st.builds(Op, st.just("store_evict"), st.sampled_from(IDS), st.integers(1, 4)),
    st.builds(Op, st.just("cordon"), st.sampled_from(IDS)),
    st.builds(Op, st.just("uncordon"), st.sampled_from(IDS)),
    st.builds(Op, st.just("store_reload"), st.sampled_from(IDS)),  # holds one cordon only
    st.builds(Op, st.just("wait"), dt=st.floats(0.01, 2.0)),
)


def apply(m: Fleet, op: Op, now: float) -> float:
    if op.kind == "register":
        m.join(spec(op.member, op.incarnation), op.state, Load(), now)
    elif op.kind == "heartbeat":
        m.beat(op.member, op.incarnation, op.state, Load(running=op.incarnation), now)
    elif op.kind == "bye":
        m.leave(op.member, op.incarnation)
    elif op.kind == "report":
        m.accuse(op.member, op.incarnation, now)
    elif op.kind == "drain":
        m.drain(op.member)
    elif op.kind == "evict":
        m.evict(op.member, now)
    elif op.kind == "store_reload":
        m.reload_intents({(IntentKind.CORDON, op.member): CordonIntent(at=now)}, now)
    elif op.kind in _INTENTS:
        kind, intent = _INTENTS[op.kind](op, now)
        m.apply_intent(kind, op.member, intent, now)
    else:
        end = now + op.dt
        ticks(m, now, end)
        return end
    m.tick(now)
    return now


_INTENTS = {
    "store_drain": lambda op, now: (IntentKind.DRAIN,
                                    DrainIntent(incarnation=op.incarnation, at=now)),
    "store_evict": lambda op, now: (IntentKind.EVICT,
                                    EvictIntent(incarnation=op.incarnation, at=now)),
    "cordon": lambda op, now: (IntentKind.CORDON, CordonIntent(at=now)),
    "uncordon": lambda op, now: (IntentKind.CORDON, None),
}


def essence(record: MemberRecord) -> tuple:
    """What events must reproduce (load travels in digests, not events)."""
    return (record.spec, record.state, record.suspect, record.cordoned)
