"""What a membership transition tells the sender: a reply status and why."""

from __future__ import annotations

from dataclasses import dataclass

from registry.protocol import ReplyStatus

__all__ = ["BAD_PROOF", "OK", "UNKNOWN", "Outcome", "refused"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """`kind` names a refusal for metrics; `session` is set on an accepted Register."""

    status: ReplyStatus
    reason: str = ""
    session: bytes = b""
    kind: str = ""


OK = Outcome(ReplyStatus.OK)
UNKNOWN = Outcome(ReplyStatus.UNKNOWN, "unknown member, register again")
BAD_PROOF = Outcome(ReplyStatus.REJECTED, "no valid session proof for this member",
                    kind="proof")


def refused(reason: str, kind: str) -> Outcome:
    return Outcome(ReplyStatus.REJECTED, reason, kind=kind)
