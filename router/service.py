"""Run a `Router` on its own uvloop event loop in a background thread.

The same class serves tests (port 0, start/close) and `pdreg router` (the main thread
waits for a signal, then drains and closes). Shape follows `registry.server.RegistryServer`.

Shutdown is two steps, so load balancers take the router out before it stops:
`drain()` fails readiness and closes each keep-alive connection after its next answer,
while still serving; `close()` stops accepting, lets in-flight requests (streams
included) finish for at most `drain_timeout_s`, cancels the rest, and stops the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Final

import uvloop
from aiohttp import web

from router.adapters import Adapters
from router.app import MAX_ATTEMPTS, MAX_MIGRATIONS, MembershipSource, Router
from router.guard import UpstreamPolicy
from router.latency import DECAY_S
from router.policies import DEFAULT_POLICY, DEFAULT_STALE_LOAD_S
from router.quarantine import QUARANTINE_S
from router.upstream_bounds import (
    CONNECT_TIMEOUT_S,
    FIRST_BYTE_TIMEOUT_S,
    IDLE_READ_TIMEOUT_S,
    Timeouts,
)

__all__ = ["RouterConfig", "RouterServer"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0
DRAIN_DELAY_S: Final = 5.0  # after SIGTERM: serve on, unready, so balancers take us out
DRAIN_TIMEOUT_S: Final = 30.0  # then: in-flight requests get this long to finish


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
    max_migrations: int = MAX_MIGRATIONS
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S
    stream_idle_timeout_s: float = IDLE_READ_TIMEOUT_S
    allow_upstream: str = ""  # CIDRs; "" = every address but link-local and metadata
    drain_delay_s: float = DRAIN_DELAY_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    latency_decay_s: float = DECAY_S
    tokenizers: tuple[tuple[str, str], ...] = ()  # (model, path): --tokenizer MODEL=PATH
    disagg_min_uncached_tokens: int = 0  # kv policy: skip the prefill leg below this


class RouterServer:
    def __init__(self, config: RouterConfig, view: MembershipSource, *,
                 adapters: Adapters | None = None) -> None:
        """`adapters`: the handshakes to speak (default: every one, unseeded)."""
        self.config = config
        self.router = Router(
            view, policy=config.policy, locality_label=config.locality_label,
            api_key=config.api_key, max_attempts=config.max_attempts,
            max_migrations=config.max_migrations, quarantine_s=config.quarantine_s,
            stale_load_s=config.stale_load_s, member_id=config.member_id,
            timeouts=Timeouts(connect_s=config.connect_timeout_s,
                              first_byte_s=config.first_byte_timeout_s,
                              idle_read_s=config.stream_idle_timeout_s),
            upstream_policy=UpstreamPolicy.build(config.allow_upstream),
            latency_decay_s=config.latency_decay_s, adapters=adapters,
            tokenizers=dict(config.tokenizers),
            disagg_min_uncached_tokens=config.disagg_min_uncached_tokens)
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
                               access_log=None, shutdown_timeout=self.config.drain_timeout_s)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, self.config.host, self.config.port, backlog=1024)
        await site.start()
        self.port = runner.addresses[0][1]

    def drain(self) -> None:
        """Fail readiness; keep serving (each keep-alive connection closes after its next
        answer). From any thread; safe twice."""
        loop = self._loop
        if loop is not None and not self.router.draining:
            loop.call_soon_threadsafe(setattr, self.router, "draining", True)
            logger.info("[router] draining: /ready answers 503")

    def close(self) -> None:
        """Stop accepting, let requests finish (up to drain_timeout_s), stop the loop.
        Safe twice."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._runner is not None:
            runner, self._runner = self._runner, None
            try:
                asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(
                    self.config.drain_timeout_s + STOP_TIMEOUT_S)
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
