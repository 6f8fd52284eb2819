"""The registry's HTTP side: members, health, metrics, admin actions, OpenAPI.

Reads only `published` (an immutable snapshot the loop swaps); admin actions are
submitted to the loop, which stays the only writer. Depends on what `RegistryHandle`
names, not on the server module: arrows run server -> http, never back.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import FastAPI, Header, HTTPException, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from registry.dashboard import dashboard_router
from registry.metrics import LoopStats, make_metrics_registry
from registry.protocol import ReplyStatus, parse_role
from registry.published import Published
from registry.views import matches, member_json

if TYPE_CHECKING:
    from registry.membership import Membership
    from registry.outcome import Outcome

ADMIN_TIMEOUT_S = 5.0
MAX_BAN_S = 30 * 24 * 3600.0


class RegistryHandle(Protocol):
    """What the HTTP side needs of the registry (`registry.server.RegistryServer`)."""

    stats: LoopStats

    @property
    def published(self) -> Published: ...
    def submit(self, action: Callable[[Membership, float], Outcome]) -> Future[Outcome]: ...
    def loop_stall_s(self) -> float: ...
    def loop_stall_limit_s(self) -> float: ...


def create_app(server: RegistryHandle, *, admin_token: str = "") -> FastAPI:
    app = FastAPI(title="pdreg registry", version="2",
                  description="Live membership of a prefill/decode serving fleet.")
    metrics_registry = make_metrics_registry(server.stats, lambda: server.published)

    def require_admin(authorization: str | None) -> None:
        expected = admin_token
        if not expected:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise HTTPException(401, "admin token required: Authorization: Bearer <token>")

    async def run_on_loop(action: Any) -> Outcome:
        future = server.submit(action)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), ADMIN_TIMEOUT_S)
        except TimeoutError:
            raise HTTPException(503, "registry loop did not answer in time") from None

    @app.get("/healthz", responses={503: {"description": "the registry loop is stuck"}})
    def healthz() -> JSONResponse:
        """200 while the loop turns; 503 once it has not for several heartbeat intervals."""
        published = server.published
        stall_s, limit_s = server.loop_stall_s(), server.loop_stall_limit_s()
        body = {"status": "ok", "epoch": published.epoch, "version": published.version,
                "members": len(published.members),
                "self_preservation": published.self_preserving,
                "loop_stall_s": round(stall_s, 3)}
        if stall_s > limit_s:
            body["status"] = "stalled"
            body["detail"] = (f"registry loop has not turned for {stall_s:.1f}s "
                              f"(limit {limit_s:.1f}s)")
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    @app.get("/v1/members")
    def list_members(
        role: Annotated[str | None, Query(description="prefill, decode, mixed, api_server")] = None,
        model: str | None = None,
        state: Annotated[str | None, Query(
            description="joining, ready, draining, suspect or routable")] = None,
    ) -> list[dict[str, Any]]:
        try:
            wanted_role = parse_role(role) if role else None
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        states = {"joining", "ready", "draining", "suspect", "routable"}
        if state is not None and state not in states:
            raise HTTPException(400, f"unknown state {state!r}; expected one of {sorted(states)}")
        now = time.time()
        return [member_json(record, now) for record in server.published.members
                if matches(record, role=wanted_role, model=model, state=state)]

    @app.get("/v1/members/{member_id}")
    def get_member(member_id: str) -> dict[str, Any]:
        for record in server.published.members:
            if record.spec.id == member_id:
                return member_json(record, time.time())
        raise HTTPException(404, f"no member {member_id!r}")

    @app.post("/v1/members/{member_id}/drain")
    async def drain_member(member_id: str,
                           authorization: Annotated[str | None, Header()] = None) -> Any:
        require_admin(authorization)

        def drain(membership: Membership, now: float) -> Outcome:
            return membership.drain(member_id)

        return _admin_result(await run_on_loop(drain), member_id, "draining")

    @app.delete("/v1/members/{member_id}")
    async def evict_member(
        member_id: str,
        ban: Annotated[float, Query(ge=0, le=MAX_BAN_S, description=(
            "seconds during which the id may not register again (0: no ban)"))] = 0.0,
        authorization: Annotated[str | None, Header()] = None,
    ) -> Any:
        require_admin(authorization)

        def evict(membership: Membership, now: float) -> Outcome:
            return membership.evict(member_id, now, ban_s=ban)

        return _admin_result(await run_on_loop(evict), member_id,
                             f"evicted, banned for {ban:g}s" if ban else "evicted")

    @app.get("/v1/bans")
    def bans() -> list[dict[str, Any]]:
        """Ids an operator evicted with a ban, and the seconds each ban has left."""
        published = server.published
        elapsed = time.time() - published.taken_at
        return [{"id": member_id, "seconds_left": round(max(0.0, left - elapsed), 1)}
                for member_id, left in published.banned]

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(dashboard_router(lambda: server.published))
    return app


def _admin_result(outcome: Outcome, member_id: str, done: str) -> JSONResponse:
    if outcome.status is ReplyStatus.OK:
        return JSONResponse({"id": member_id, "result": done})
    status = 404 if outcome.status is ReplyStatus.UNKNOWN else 409
    return JSONResponse({"detail": outcome.reason}, status_code=status)
