"""A router's KV index report (control channel): what its index knows of each member.

Part of the control channel's messages (`wire.protocol.ControlMessage`); kept apart
because only routers send it and only the registry's KV report table reads it
(registry/kv_reports.py).
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec

from wire.limits import NO_PROOF, Incarnation, MemberId, Proof, Seq

MAX_KV_ENTRIES: Final = 4096  # per KvIndexReport (the message must fit MAX_MESSAGE_BYTES too)
MAX_KV_BLOCKS: Final = 2**40 - 1
MAX_KV_LAG_MS: Final = 2**22 - 1  # ~70 minutes: "very late" needs no finer figure


class KvIndexState(enum.IntEnum):
    """What a router's KV index knows of a member (router/kv/index.py `IndexState`).

    Ordered from best to worst: a summary over several routers shows the worst. GONE is
    not a state: it tells the registry to forget what this router said of the member.
    """

    GONE = 0  # this router no longer follows the member
    LIVE = 1  # every event applied: exact
    SYNCING = 2  # subscribed; the first replay has not answered yet
    REPLAYING = 3  # a gap is open
    UNKNOWN = 4  # history lost: a lower bound only


class KvIndexEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One member as one router's KV index sees it. `lag_ms`: how old the last event
    batch the router applied is (engine clock to router clock), capped at MAX_KV_LAG_MS."""

    member_id: MemberId
    incarnation: Incarnation
    state: KvIndexState
    blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_BLOCKS)] = 0
    lag_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_LAG_MS)] = 0


class KvIndexReport(msgspec.Struct, frozen=True, tag=True, array_like=True,
                    omit_defaults=True):
    """A router's KV index, per member: the changes since its last report plus a slice
    of a rolling refresh (router/kv/reporter.py). Shown by the registry's /v1/members
    and dashboard; it never changes membership (registry/kv_reports.py).

    Sent and proved like `Report`: `id`, `incarnation`, `seq` and `proof` are the
    reporting router's own, and only `api_server` members may send it.
    """

    id: MemberId
    incarnation: Incarnation
    seq: Seq
    entries: Annotated[list[KvIndexEntry], msgspec.Meta(max_length=MAX_KV_ENTRIES)] = []
    proof: Proof = NO_PROOF
