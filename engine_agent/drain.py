"""Waiting for an engine's in-flight work to finish before it leaves."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

logger = logging.getLogger(__name__)

DRAIN_POLL_S: Final = 0.05  # how often wait_for_idle asks in_flight()
DRAIN_QUIET_S: Final = 0.5  # in_flight() must read 0 this long before a drain is done


def wait_for_idle(in_flight: Callable[[], int], timeout_s: float, member_id: str,
                  quiet_s: float = DRAIN_QUIET_S) -> bool:
    """Wait until in_flight() has read 0 for `quiet_s` in a row, or timeout_s passes.

    The quiet period covers requests a router sent just before it saw DRAINING, and
    requests an engine's HTTP server holds before its scheduler counts them. Returns
    whether the work drained (idle at the deadline counts). A raising in_flight() counts
    as "not yet" (logged once).
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    pause = threading.Event()
    failed = False
    idle_since: float | None = None
    while True:
        try:
            busy = int(in_flight()) > 0
        except Exception:
            if not failed:
                logger.exception("[agent] drain id=%s: in_flight() failed", member_id)
            failed = True
            busy = True
        now = time.monotonic()
        idle_since = None if busy else (idle_since if idle_since is not None else now)
        if idle_since is not None and now - idle_since >= quiet_s:
            logger.info("[agent] drain id=%s done", member_id)
            return True
        if now >= deadline:
            if idle_since is not None:
                return True
            logger.warning("[agent] drain id=%s timed out after %.1fs", member_id, timeout_s)
            return False
        pause.wait(DRAIN_POLL_S)
