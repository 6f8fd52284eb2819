"""What a membership transition tells the sender: a reply status and why."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from wire.protocol import ReplyStatus

__all__ = ["BAD_PROOF", "DRAIN", "OK", "UNKNOWN", "Outcome", "Refusal", "refused"]


class Refusal(enum.StrEnum):
    """Why a control message was refused: the `reason` label of
    pdreg_rejected_messages_total. Every refusal names one of these, so the metric lists
    each one from the start (at 0) and a new kind cannot be missed."""

    # the message itself
    MALFORMED = "malformed"
    INVALID = "invalid"
    OVERSIZED = "oversized"
    FRAMES = "frames"
    UNHANDLED = "unhandled"  # a type the control channel has no handler for
    # registration
    TOKEN = "token"
    VERSION = "version"
    BANNED = "banned"
    BANS = "bans"  # the ban table is full
    DEPARTED = "departed"
    INCARNATION = "incarnation"
    CAP = "cap"
    TAKEOVER = "takeover"
    CONTESTED = "contested"
    # sessions, reports, syncs
    PROOF = "proof"
    REPLAY = "replay"
    SEQ = "seq"
    REPORTER = "reporter"
    RATE = "rate"


@dataclass(frozen=True, slots=True)
class Outcome:
    """`kind` names a refusal for metrics; `session` is set on an accepted Register;
    `drain` and `banned_s` go into the reply (see `Reply`)."""

    status: ReplyStatus
    reason: str = ""
    session: bytes = b""
    kind: str = ""  # a Refusal when status is REJECTED; what a report did otherwise
    drain: bool = False
    banned_s: float = 0.0


OK = Outcome(ReplyStatus.OK)
# A heartbeat accepted from a member an operator drained here: tells it to drain everywhere.
DRAIN = Outcome(ReplyStatus.OK, drain=True)
UNKNOWN = Outcome(ReplyStatus.UNKNOWN, "unknown member, register again")
BAD_PROOF = Outcome(ReplyStatus.REJECTED, "no valid session proof for this member",
                    kind=Refusal.PROOF)


def refused(reason: str, kind: Refusal) -> Outcome:
    return Outcome(ReplyStatus.REJECTED, reason, kind=kind)
