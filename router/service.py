"""Run a `Router` on its own uvloop event loop in a background thread.

The same class serves tests (port 0, start/close) and `pdreg router` (the main thread
waits for a signal, then closes). Shape follows `registry.server.RegistryServer`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Final

import uvloop
from aiohttp import web

from router.app import MAX_ATTEMPTS, MembershipSource, Router
from router.policies import DEFAULT_POLICY, DEFAULT_STALE_LOAD_S
from router.quarantine import QUARANTINE_S

__all__ = ["RouterConfig", "RouterServer"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0
# Requests in flight get this long to finish when the router stops.
SHUTDOWN_GRACE_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = the OS picks
    policy: str = DEFAULT_POLICY
    api_key: str = ""
    locality_label: str = ""
    max_attempts: int = MAX_ATTEMPTS
    quarantine_s: float = QUARANTINE_S
    stale_load_s: float = DEFAULT_STALE_LOAD_S
    member_id: str = "router"


class RouterServer:
    def __init__(self, config: RouterConfig, view: MembershipSource) -> None:
        self.config = config
        self.router = Router(
            view, policy=config.policy, locality_label=config.locality_label,
            api_key=config.api_key, max_attempts=config.max_attempts,
            quarantine_s=config.quarantine_s, stale_load_s=config.stale_load_s,
            member_id=config.member_id)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> RouterServer:
        """Bind and serve; returns once the socket accepts connections."""
        loop = self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="pdreg-router",
                                        daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._serve(), loop)
        try:
            future.result(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        logger.info("[router] serving url=%s policy=%s", self.url, self.config.policy)
        return self

    async def _serve(self) -> None:
        runner = web.AppRunner(self.router.build_app(), handler_cancellation=True,
                               access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, self.config.host, self.config.port, backlog=1024)
        await site.start()
        self.port = runner.addresses[0][1]

    def close(self) -> None:
        """Stop accepting, let requests finish (bounded), stop the loop. Safe twice."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._runner is not None:
            runner, self._runner = self._runner, None
            try:
                asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(
                    SHUTDOWN_GRACE_S + STOP_TIMEOUT_S)
            except Exception:
                logger.exception("[router] cleanup failed")
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
        if not loop.is_running():
            loop.close()
        logger.info("[router] stopped")

    def __enter__(self) -> RouterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
