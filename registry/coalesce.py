"""Coalescing: under a high message rate, the loop pauses briefly between turns.

At 20,000 heartbeats/s a loop that turns as soon as anything arrives turns ~10,000 times
a second with two messages each: every turn pays a poll, a detector tick and a reply that
wakes libzmq's I/O thread on its own. Pausing `pause_s` after a turn that handled
messages lets the next turn take the ~20 that arrived meanwhile in one go, with one poll,
one tick and one burst of replies (see `ControlChannel.flush_replies`). That costs each
message at most `pause_s` more latency, so it applies only while the rate over the last
window is at least `above_per_s` (a big fleet); a small one has every message handled as
it arrives. A full batch means more is waiting: no pause then.

Pure: the caller passes the clock.
"""

from __future__ import annotations

from typing import Final

PAUSE_S: Final = 0.001
ABOVE_PER_S: Final = 2_000.0
WINDOW_S: Final = 1.0


class Coalescer:
    def __init__(self, pause_s: float = PAUSE_S, above_per_s: float = ABOVE_PER_S,
                 window_s: float = WINDOW_S) -> None:
        self.pause_s = pause_s
        self.above_per_s = above_per_s
        self.window_s = window_s
        self.active = False  # the last window's rate was at or above above_per_s
        self._window_start: float | None = None
        self._handled = 0

    def pause_after(self, handled: int, batch_full: bool, now: float) -> float:
        """Seconds to pause before the next poll, after a turn that handled `handled`
        control messages at `now`."""
        if self._window_start is None:
            self._window_start = now
        self._handled += handled
        elapsed = now - self._window_start
        if elapsed >= self.window_s:
            self.active = self.pause_s > 0 and self._handled >= self.above_per_s * elapsed
            self._window_start, self._handled = now, 0
        if not self.active or handled == 0 or batch_full:
            return 0.0
        return self.pause_s
