"""What the registry loop shows everyone else: one immutable snapshot, swapped whole.

The HTTP API, the dashboard and the metrics collector read only this, so they depend on
this module and the protocol, never on the server that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from wire.protocol import MemberRecord, MembershipEvent

__all__ = ["Published"]


@dataclass(frozen=True, slots=True)
class Published:
    """Swapped by reference by the loop, never mutated."""

    epoch: int
    version: int
    members: tuple[MemberRecord, ...]
    heartbeat_interval_s: float
    lease_s: float
    self_preserving: bool
    taken_at: float  # unix time
    recent_events: tuple[MembershipEvent, ...] = ()  # newest last, for the dashboard
    banned: tuple[tuple[str, float], ...] = ()  # (id, seconds left) of evict bans
