"""Connections to a member opened when it becomes routable, before its first request.

A new engine's first requests would otherwise each pay a TCP connect (and a burst of
them, one connect per concurrent request). The warmer watches the pairing table and,
for each member that appears in it, fills the pool with a few idle connections.
Pooled connections live KEEPALIVE_S (router/http/upstream.py): the warm-up helps the
requests that follow a member's arrival, as intended, not one that comes much later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from router.http.upstream import UpstreamPool
from router.pairing import Pairing

__all__ = ["WARM_CONNECTIONS", "Warmer"]

logger = logging.getLogger(__name__)

WARM_CONNECTIONS: Final = 8  # idle connections opened to each new member
WARM_CHECK_S: Final = 0.1  # how often the table is looked at for new members


class Warmer:
    def __init__(self, pairing: Pairing, pool: UpstreamPool, *,
                 connections: int = WARM_CONNECTIONS, period_s: float = WARM_CHECK_S) -> None:
        self._pairing = pairing
        self._pool = pool
        self._connections = connections
        self._period_s = period_s
        self._tasks: set[asyncio.Task[int]] = set()
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        """On the router's loop: watch the table until `stop()`."""
        self._runner = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for task in (self._runner, *self._tasks):
            if task is not None:
                task.cancel()
        for task in (self._runner, *self._tasks):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _run(self) -> None:
        mark = 0  # the table's count of URLs become routable, as of the last look
        while True:
            # Only the URLs that became routable since the last look: at 100k members a
            # comparison of every URL, ten times a second, cost the router ~30 ms/s.
            try:
                mark, urls = self._pairing.routable_urls_since(mark)
            except Exception:  # a bad table must not end warming for good
                logger.exception("[router] warm-up: reading the table failed")
                urls = []
            for url in urls:  # a member that leaves and comes back is warmed again
                task = asyncio.get_running_loop().create_task(
                    self._pool.warm(url, self._connections))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self._period_s)
