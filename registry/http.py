"""The registry's HTTP side: members, health, metrics, admin actions, OpenAPI.

Reads only `server.published` (an immutable snapshot the loop swaps); admin actions are
submitted to the loop, which stays the only writer.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from registry.dashboard import dashboard_router
from registry.metrics import make_metrics_registry
from registry.protocol import ReplyStatus, parse_role
from registry.views import matches, member_json

if TYPE_CHECKING:
    from registry.membership import Membership, Outcome
    from registry.server import RegistryServer

ADMIN_TIMEOUT_S = 5.0


def create_app(server: RegistryServer) -> FastAPI:
    app = FastAPI(title="pdreg registry", version="1",
                  description="Live membership of a prefill/decode serving fleet.")
    metrics_registry = make_metrics_registry(server.stats, lambda: server.published)

    def require_admin(authorization: str | None) -> None:
        expected = server.config.admin_token
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

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        published = server.published
        return {"status": "ok", "epoch": published.epoch, "version": published.version,
                "members": len(published.members),
                "self_preservation": published.self_preserving}

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

        def drain(membership: Membership) -> Outcome:
            return membership.drain(member_id)

        return _admin_result(await run_on_loop(drain), member_id, "draining")

    @app.delete("/v1/members/{member_id}")
    async def evict_member(member_id: str,
                           authorization: Annotated[str | None, Header()] = None) -> Any:
        require_admin(authorization)

        def evict(membership: Membership) -> Outcome:
            return membership.evict(member_id)

        return _admin_result(await run_on_loop(evict), member_id, "evicted")

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(dashboard_router(server))
    return app


def _admin_result(outcome: Outcome, member_id: str, done: str) -> JSONResponse:
    if outcome.status is ReplyStatus.OK:
        return JSONResponse({"id": member_id, "result": done})
    status = 404 if outcome.reason.startswith("no member") else 409
    return JSONResponse({"detail": outcome.reason}, status_code=status)
