"""Self-preservation as a small state machine: when to pause expiry, and when to stop.

On when a large share of members is silent at once (`is_self_preserving`): the likelier
fault is the registry's own. Off when that share drops (members are back), or after
`self_preservation_max_s` (then a real mass failure is cleaned up; the same silence does
not pause expiry a second time). Pure: the clock is passed in.
"""

from __future__ import annotations

import enum
import logging

from registry.detector import DetectorConfig, is_self_preserving

logger = logging.getLogger(__name__)


class Change(enum.Enum):
    NONE = "none"
    ON = "on"
    OFF = "off"  # the silent share dropped: members are coming back
    GAVE_UP = "gave_up"  # held for self_preservation_max_s: expiry resumes


class SelfPreservation:
    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.since: float | None = None
        # Set when it gave up; cleared once the silent share drops, so the same mass
        # silence does not pause expiry a second time.
        self._spent = False

    @property
    def active(self) -> bool:
        return self.since is not None

    def update(self, silent: int, total: int, now: float) -> Change:
        preserving = is_self_preserving(silent, total, self.config)
        if not preserving:
            self._spent = False
        if self.since is None:
            if preserving and not self._spent:
                self.since = now
                logger.warning("[registry] self-preservation on: %d of %d members silent at "
                               "once; expiry paused (fault assumed on the registry's side)",
                               silent, total)
                return Change.ON
            return Change.NONE
        held_for = now - self.since
        if not preserving:
            self.since = None
            logger.warning("[registry] self-preservation off after %.1fs", held_for)
            return Change.OFF
        if held_for > self.config.self_preservation_max_s:
            self.since = None
            self._spent = True
            logger.warning("[registry] self-preservation gave up after %.1fs: expiring %d "
                           "silent members", held_for, silent)
            return Change.GAVE_UP
        return Change.NONE
