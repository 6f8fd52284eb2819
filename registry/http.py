"""The registry's HTTP side: members, health, metrics, admin actions, OpenAPI.

Reads only `published` (an immutable snapshot the loop swaps) and, for /metrics and
/healthz, `figures` (the membership's counts, copied by the loop); admin actions go to
the store and reach the loop, which stays the only writer, from there
(`registry.http_admin`). Depends on what `RegistryHandle`
names, not on the server module: arrows run server -> http, never back.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from registry.change_log import ChangeLog
from registry.dashboard import dashboard_router
from registry.fleet_stats import FleetFigures
from registry.http_admin import StoreHandle, admin_routes, store_routes
from registry.http_auth import Access
from registry.http_guard import BodyLimit
from registry.kv_reports import KvSummary, kv_index_json
from registry.metrics import LoopStats, make_metrics_registry
from registry.published import Published
from registry.sessions import token_lines
from registry.store.metrics import StoreCollector
from registry.views import matches, member_json
from wire.protocol import parse_role


class RegistryHandle(StoreHandle, Protocol):
    """What the HTTP side needs of the registry (`registry.server.RegistryServer`)."""

    stats: LoopStats
    changes: ChangeLog  # what the loop changed, for dashboard streams

    @property
    def published(self) -> Published: ...
    @property
    def figures(self) -> FleetFigures: ...
    @property
    def kv_index(self) -> Mapping[str, KvSummary]: ...
    def loop_stall_s(self) -> float: ...
    def loop_stall_limit_s(self) -> float: ...


def create_app(server: RegistryHandle, *, admin_token: str = "", read_token: str = "",
               exposed: bool = False) -> FastAPI:
    """The registry's HTTP app: health and metrics (open), members (readers), admin
    actions (operators), the dashboard (readers). Who may do what: `registry.http_auth`."""
    app = FastAPI(title="pdreg registry", version="2",
                  description="Live membership of a prefill/decode serving fleet.")
    access = Access.of(admin_tokens=token_lines(admin_token),
                       read_tokens=token_lines(read_token), exposed=exposed)
    reader = [Depends(access.require_reader)]
    app.include_router(health_routes(server))
    app.include_router(member_routes(server), dependencies=reader)
    app.include_router(store_routes(server), dependencies=reader)
    app.include_router(admin_routes(server), dependencies=[Depends(access.require_admin)])
    app.include_router(dashboard_router(lambda: server.published, lambda: server.kv_index,
                                        server.changes), dependencies=reader)
    # Outermost: a body is refused before anything reads it (no endpoint takes one).
    app.add_middleware(BodyLimit)
    return app


def health_routes(server: RegistryHandle) -> APIRouter:
    """/healthz for probes and /metrics for Prometheus: open to anyone who can connect."""
    routes = APIRouter()
    metrics_registry = make_metrics_registry(server.stats, lambda: server.figures)
    metrics_registry.register(StoreCollector(server.store_stats))

    @routes.get("/healthz", responses={503: {"description": "the registry loop is stuck"}})
    def healthz() -> JSONResponse:
        """200 while the loop turns; 503 once it has not for several heartbeat intervals.

        Reads `figures`, not `published`: probes come every few seconds, and at 100k
        members a snapshot is O(members) of the loop's time, these counts are not."""
        figures = server.figures
        stall_s, limit_s = server.loop_stall_s(), server.loop_stall_limit_s()
        body = {"status": "ok", "epoch": figures.epoch, "version": figures.version,
                "members": figures.members,
                "self_preservation": figures.self_preserving,
                "loop_stall_s": round(stall_s, 3)}
        if stall_s > limit_s:
            body["status"] = "stalled"
            body["detail"] = (f"registry loop has not turned for {stall_s:.1f}s "
                              f"(limit {limit_s:.1f}s)")
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    @routes.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return routes


def member_routes(server: RegistryHandle) -> APIRouter:
    """What the registry holds: members (the same JSON as `pdreg status --json`), bans."""
    routes = APIRouter()

    @routes.get("/v1/members")
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
        members = server.published.members
        kv = kv_index_json(members, server.kv_index)
        return [_with_kv(member_json(record, now), kv) for record in members
                if matches(record, role=wanted_role, model=model, state=state)]

    @routes.get("/v1/members/{member_id}")
    def get_member(member_id: str) -> dict[str, Any]:
        members = server.published.members
        for record in members:
            if record.spec.id == member_id:
                return _with_kv(member_json(record, time.time()),
                                kv_index_json(members, server.kv_index))
        raise HTTPException(404, f"no member {member_id!r}")

    @routes.get("/v1/bans")
    def bans() -> list[dict[str, Any]]:
        """Ids an operator evicted with a ban (here, or at another registry: the banned
        member passed it on), and the seconds each ban has left."""
        published = server.published
        elapsed = time.time() - published.taken_at
        return [{"id": member_id, "seconds_left": round(max(0.0, left - elapsed), 1)}
                for member_id, left in published.banned]

    return routes


def _with_kv(member: dict[str, Any], kv: dict[str, dict[str, object]]) -> dict[str, Any]:
    """`kv_index` (what routers' KV indexes say of it) when routers report one."""
    shown = kv.get(member["id"])
    if shown is not None:
        member["kv_index"] = shown
    return member
