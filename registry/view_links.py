"""What a `MembershipView` keeps per registry: the link's state, its sockets and timers.

    SYNCING   Sync sent on the DEALER; events already arriving on the SUB are buffered
    LIVE      snapshot applied; events applied in version order; digests refresh loads
    AWAY      silent past its lease: out of the merge, Sync retried

Only the view thread touches a link (registry/client.py).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Final

import zmq

from registry.replica import Replica
from wire.protocol import Event

__all__ = ["SYNC_TIMEOUT_S", "Link", "LinkState", "LinkStatus"]

SYNC_TIMEOUT_S: Final = 1.0  # a Sync unanswered by then: a new socket asks again


class LinkState(enum.Enum):
    SYNCING = "syncing"
    LIVE = "live"
    AWAY = "away"


@dataclass(frozen=True, slots=True)
class LinkStatus:
    address: str
    state: LinkState
    epoch: int
    version: int
    members: int
    snapshots: int = 0  # taken since start: the first, then one per gap or restart
    # Models whose loads are not current: passed over as nobody asked for them (a view
    # with loads on demand), or asked for and not fetched yet
    loads_missed: int = 0


@dataclass
class Link:
    """One registry, as seen from the view thread (which alone touches it)."""

    index: int  # in the merge
    address: str
    replica: Replica
    dealer: zmq.Socket | None = None
    sub: zmq.Socket | None = None
    events_port: int = 0
    state: LinkState = LinkState.SYNCING
    # The Sync in flight asks for the empty topic alone (a few routers' records), to learn
    # the event port: the snapshot the view follows is asked for once subscribed.
    probing: bool = False
    buffered: list[Event] = field(default_factory=list)  # events seen while syncing
    sync_sent_at: float = 0.0
    next_sync_at: float = 0.0
    backoff_s: float = 0.1
    # Loads on demand: a DEALER of its own for the Syncs that fetch the current loads of
    # models whose digests were passed over (answered in order: the models each asked
    # for), and when the oldest unanswered one went out
    loads_dealer: zmq.Socket | None = None
    loads_asked: deque[frozenset[str]] = field(default_factory=deque)
    loads_asked_at: float = 0.0
