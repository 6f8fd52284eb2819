"""Who closes a thread's ZeroMQ sockets: whichever of the closer and the thread is last.

ZeroMQ sockets are not thread-safe, and a context destroyed under a thread still using
its sockets makes libzmq fail with "Socket operation on non-socket" or abort the whole
process: a real risk for anyone who embeds registries or views (tests, a control plane
running two, a restart inside one process). So `close()` waits for the owner thread a
while; if it stopped (or never ran), the closer tears down, else the thread does on its
way out. Exactly once either way, never under a running owner.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Teardown"]


class Teardown:
    def __init__(self, teardown: Callable[[], None]) -> None:
        self._teardown = teardown
        self._lock = threading.Lock()
        self._exited = False  # the owner thread left its loop
        self._left_to_thread = False

    def owning(self, run: Callable[[], None]) -> Callable[[], None]:
        """`run` as the owner thread's target: `thread_exited` follows it, however it ends."""
        def target() -> None:
            try:
                run()
            finally:
                self.thread_exited()
        return target

    def thread_exited(self) -> None:
        """The owner thread's last call: it tears down if `close` left that to it."""
        with self._lock:
            self._exited = True
            left = self._left_to_thread
        if left:
            self._teardown()

    def close(self, thread: threading.Thread | None, timeout_s: float) -> bool:
        """From `close()`: wait up to `timeout_s` for `thread` (None: it never started),
        then tear down now if it has stopped; else leave it to the thread. Whether the
        teardown ran now. Call once."""
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self._lock:
            if thread is not None and not self._exited:
                self._left_to_thread = True
                return False
        self._teardown()
        return True
