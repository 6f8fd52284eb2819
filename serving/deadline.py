"""One timer per connection, moved lazily (the router's HTTP server and its upstream
client): a wait only writes its deadline, and the timer re-checks it when it fires. A
timer per wait cost a call_at and a cancel per request leg, and per read of a stream.
Only a deadline sooner than the pending timer reschedules it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Deadline:
    __slots__ = ("_expired", "_loop", "_timer", "at")

    def __init__(self, loop: asyncio.AbstractEventLoop, expired: Callable[[], None]) -> None:
        self._loop = loop
        self._expired = expired  # called once the armed wait's deadline has passed
        self._timer: asyncio.TimerHandle | None = None
        self.at = 0.0  # loop time the current wait must end by; 0: none

    def arm(self, seconds: float) -> None:
        """The current wait must end within `seconds`."""
        at = self.at = self._loop.time() + seconds
        timer = self._timer
        if timer is not None and at < timer.when():  # sooner than it would fire
            timer.cancel()
            timer = None
        if timer is None:
            self._timer = self._loop.call_at(at, self._fire)

    def disarm(self) -> None:
        """The wait ended in time (the timer, if pending, finds nothing to do)."""
        self.at = 0.0

    def cancel(self) -> None:
        """No more waits (the connection is gone)."""
        self.at = 0.0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        at = self.at
        if not at:
            return
        if self._loop.time() < at:  # moved since: wait for the new one
            self._timer = self._loop.call_at(at, self._fire)
            return
        self.at = 0.0
        self._expired()
