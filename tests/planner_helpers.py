"""Pieces the planner tests share: members as a view holds them, a membership source
the test sets by hand, and a real HTTP server that answers /metrics like a router."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from registry.client import LinkState, LinkStatus, LiveMember
from router.metrics import RouterMetrics
from wire.protocol import Endpoints, Load, MemberRecord, MemberSpec, MemberState, Role


def member(member_id: str, role: Role, *, model: str = "tiny", protocol: str = "vllm-nixl",
           state: MemberState = MemberState.READY, load: Load | None = None,
           capacity: int = 0, suspect: bool = False, incarnation: int = 1,
           http: str = "http://127.0.0.1:9") -> LiveMember:
    spec = MemberSpec(id=member_id, incarnation=incarnation, role=role, model=model,
                      protocol=protocol, endpoints=Endpoints(http=http), capacity=capacity)
    record = MemberRecord(spec, state, suspect=suspect, load=load or Load())
    return LiveMember(record, record.load, time.monotonic(), "127.0.0.1:7600")


@dataclass
class HandView:
    """A MembershipSource whose members and link state the test sets."""

    current: dict[str, LiveMember] = field(default_factory=dict)
    state: LinkState = LinkState.LIVE
    epoch: int = 1  # 0: no snapshot yet

    def set(self, *members: LiveMember) -> None:
        self.current = {m.id: m for m in members}

    def members(self) -> Mapping[str, LiveMember]:
        return dict(self.current)

    def links(self) -> list[LinkStatus]:
        return [LinkStatus("127.0.0.1:7600", self.state, self.epoch, 1, len(self.current))]


class FakeRouterMetrics:
    """A real HTTP server answering GET /metrics with a router's real metrics page (or
    whatever status and body the test sets), on an OS-chosen loopback port."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics()
        self.status = 200
        self.body: bytes | None = None  # None: render self.metrics
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests += 1
                body = owner.body if owner.body is not None else owner.metrics.render()
                self.send_response(owner.status if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeRouterMetrics:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeRouterMetrics:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def observe_ttft(self, model: str, seconds: float, times: int = 1) -> None:
        for _ in range(times):
            self.metrics.ttft_of(model).observe(seconds)
        self.metrics.requests_of(model, "ok").inc(times)
