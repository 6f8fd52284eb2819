"""Run a `Router` on its own event loop in a background thread (`ServingThread`).

The same class serves tests (port 0, start/close) and `pdreg router` (the main thread
waits for a signal, then drains and closes).

Shutdown is two steps, so load balancers take the router out before it stops:
`drain()` fails readiness and closes each keep-alive connection after its next answer,
while still serving; `close()` stops accepting, lets in-flight requests (streams
included) finish for at most `clients.drain_timeout_s`, cancels the rest, and stops
the loop.
"""

from __future__ import annotations

import gc
import logging
from typing import Final

from router.app import Router
from router.config import RouterConfig
from router.handshakes.catalog import Handshakes
from router.pairing import MembershipSource
from serving.lifecycle import ServingThread, ShutdownState

__all__ = ["RouterConfig", "RouterServer", "settle_heap"]

logger = logging.getLogger(__name__)

# Young objects (net allocations) before a collection, against CPython's 700: a request
# in flight holds a few dozen, so at 700 every collection walks the requests in flight
# again, a few hundred microseconds each, dozens of times a second under load.
GC_YOUNG_THRESHOLD: Final = 20_000


def settle_heap() -> None:
    """For a router process, once it serves: what start-up made (imports, the app, the
    first snapshot) lives as long as the process, so keep it out of every collection
    (gc.freeze), and collect young objects less often. The request path makes few
    reference cycles; measured (bench_router, c=32) the collector cost about 13 µs a
    request before this, a tenth of the router's CPU. Not for a process that hosts a
    router among other things (tests): freezing keeps their garbage for good."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


class RouterServer:
    def __init__(self, config: RouterConfig, view: MembershipSource, *,
                 handshakes: Handshakes | None = None) -> None:
        """`handshakes`: the ones to speak (default: every one, unseeded)."""
        self.config = config
        self.router = Router(view, config, handshakes=handshakes)
        # The app (serving/http_server.py) holds the header and body deadlines and the
        # bound on in-flight requests at close.
        self._serving = ServingThread(
            self.router.build_app(serve_metrics=config.metrics_port is None), config.host,
            config.port, name="pdreg-router")
        self.metrics_port: int | None = None  # bound port when config.metrics_port is set

    @property
    def port(self) -> int:
        return self._serving.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> RouterServer:
        """Bind and serve; returns once the socket accepts connections. On a started
        router it does nothing."""
        if self._serving.started:
            return self
        self._serving.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self._serving.add_app(self.router.build_metrics_app(),
                                                      self.config.metrics_port)
        logger.info("[router] serving url=%s policy=%s", self.url, self.config.policy)
        return self

    def drain(self) -> None:
        """Fail readiness; keep serving (each keep-alive connection closes after its next
        answer). From any thread; safe twice."""
        if not self.router.draining:
            self._serving.call_soon(setattr, self.router, "draining", True)
            logger.info("[router] draining: /ready answers 503")

    def close(self) -> None:
        """Stop accepting, let requests finish (up to clients.drain_timeout_s), stop the loop.
        Safe twice."""
        if self._serving.state is ShutdownState.STOPPED:
            return
        self._serving.close()
        logger.info("[router] stopped")

    def __enter__(self) -> RouterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
