"""Local quarantine: members this router saw fail, kept out of pairing for a while.

The router does not wait for the registry to notice a dead engine: one connection error
or 5xx is enough to stop sending it work here. The entry names the failing incarnation,
so a restarted member (a new incarnation) is a new peer and routable at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

__all__ = ["QUARANTINE_S", "Quarantine"]

logger = logging.getLogger(__name__)

QUARANTINE_S: Final = 5.0  # long enough for the registry to suspect or expire it


class Quarantine:
    """id -> (incarnation, until). Clock passed in; one event-loop thread uses it."""

    def __init__(self, duration_s: float = QUARANTINE_S) -> None:
        self.duration_s = duration_s
        self._until: dict[str, tuple[int, float]] = {}
        self._active: dict[str, int] = {}
        self._next_expiry = float("inf")

    def add(self, member_id: str, incarnation: int, now: float) -> bool:
        """Quarantine (or extend). Returns True if it was not quarantined before."""
        fresh = self._active.get(member_id) != incarnation
        until = now + self.duration_s
        self._until[member_id] = (incarnation, until)
        self._active[member_id] = incarnation
        self._next_expiry = min(self._next_expiry, until)
        if fresh:
            logger.warning("[router] quarantine id=%s incarnation=%d for %.1fs",
                           member_id, incarnation, self.duration_s)
        return fresh

    def active(self, now: float) -> Mapping[str, int]:
        """id -> quarantined incarnation. Cheap when nothing expires (the common case)."""
        if now >= self._next_expiry:
            for member_id, (_, until) in list(self._until.items()):
                if until <= now:
                    del self._until[member_id]
                    del self._active[member_id]
                    logger.info("[router] quarantine over id=%s", member_id)
            self._next_expiry = min((u for _, u in self._until.values()), default=float("inf"))
        return self._active
