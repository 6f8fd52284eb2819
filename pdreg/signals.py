"""The one signal wiring of pdreg's foreground commands that run a cluster (the demos).

SIGTERM stops such a command the way Ctrl-C does. SIGINT is set even when the command
was started in the background, where a shell leaves it ignored. Once the command is
cleaning up, both are ignored: a second Ctrl-C must not cut the clean-up short and leave
processes behind.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["interrupt_on_signals"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def interrupt_on_signals(on_interrupt: Callable[[], None]) -> Iterator[None]:
    """Within: SIGTERM or SIGINT calls `on_interrupt()` (which must stick, e.g. set an
    Event, even if the KeyboardInterrupt raised next is swallowed somewhere) and raises
    KeyboardInterrupt. On leaving: both signals are ignored."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        on_interrupt()
        raise KeyboardInterrupt

    for signum in _SIGNALS:
        signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum in _SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
