"""Run a `Router` on its own event loop in a background thread (`ServingThread`).

The same class serves tests (port 0, start/close) and `pdreg router` (the main thread
waits for a signal, then drains and closes).

Shutdown is two steps, so load balancers take the router out before it stops:
`drain()` fails readiness and closes each keep-alive connection after its next answer,
while still serving; `close()` stops accepting, lets in-flight requests (streams
included) finish for at most `drain_timeout_s`, cancels the rest, and stops the loop.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Final

from router.adapters import Adapters
from router.app import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_ATTEMPTS,
    MAX_MIGRATIONS,
    Router,
)
from router.guard import UpstreamPolicy
from router.http.bounds import (
    CONNECT_TIMEOUT_S,
    FIRST_BYTE_TIMEOUT_S,
    IDLE_READ_TIMEOUT_S,
    Timeouts,
)
from router.latency import DECAY_S
from router.pairing import MembershipSource
from router.policies import DEFAULT_POLICY, DEFAULT_STALE_LOAD_S
from router.quarantine import QUARANTINE_S
from router.warmup import WARM_CONNECTIONS
from serving.lifecycle import ServingThread, ShutdownState

__all__ = ["RouterConfig", "RouterServer", "settle_heap"]

logger = logging.getLogger(__name__)

# Young objects (net allocations) before a collection, against CPython's 700: a request
# in flight holds a few dozen, so at 700 every collection walks the requests in flight
# again, a few hundred microseconds each, dozens of times a second under load.
GC_YOUNG_THRESHOLD: Final = 20_000
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
    allow_upstream: str = ""  # CIDRs; "" = public addresses only (guard.DEFAULT_DENY)
    drain_delay_s: float = DRAIN_DELAY_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    latency_decay_s: float = DECAY_S
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    warm_connections: int = WARM_CONNECTIONS  # opened to each member that becomes routable
    # None: /metrics on the API port. A port (0 = the OS picks): /metrics there only.
    metrics_port: int | None = None
    tokenizers: tuple[tuple[str, str], ...] = ()  # (model, path): --tokenizer MODEL=PATH
    disagg_min_uncached_tokens: int = 0  # kv policy: skip the prefill leg below this


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
            latency_decay_s=config.latency_decay_s, body_timeout_s=config.body_timeout_s,
            header_timeout_s=config.header_timeout_s,
            shutdown_timeout_s=config.drain_timeout_s,
            warm_connections=config.warm_connections, adapters=adapters,
            tokenizers=dict(config.tokenizers),
            disagg_min_uncached_tokens=config.disagg_min_uncached_tokens)
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
        """Bind and serve; returns once the socket accepts connections."""
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
        """Stop accepting, let requests finish (up to drain_timeout_s), stop the loop.
        Safe twice."""
        if self._serving.state is ShutdownState.STOPPED:
            return
        self._serving.close()
        logger.info("[router] stopped")

    def __enter__(self) -> RouterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
