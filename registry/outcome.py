"""What a membership transition tells the sender: a reply status and why."""

from __future__ import annotations

from dataclasses import dataclass

from registry.protocol import ReplyStatus

__all__ = ["BAD_PROOF", "DRAIN", "OK", "UNKNOWN", "Outcome", "refused"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """`kind` names a refusal for metrics; `session` is set on an accepted Register;
    `drain` and `banned_s` go into the reply (see `Reply`)."""

    status: ReplyStatus
    reason: str = ""
    session: bytes = b""
    kind: str = ""
    drain: bool = False
    banned_s: float = 0.0


OK = Outcome(ReplyStatus.OK)
# A heartbeat accepted from a member an operator drained here: tells it to drain everywhere.
DRAIN = Outcome(ReplyStatus.OK, drain=True)
UNKNOWN = Outcome(ReplyStatus.UNKNOWN, "unknown member, register again")
BAD_PROOF = Outcome(ReplyStatus.REJECTED, "no valid session proof for this member",
                    kind="proof")


def refused(reason: str, kind: str) -> Outcome:
    return Outcome(ReplyStatus.REJECTED, reason, kind=kind)
