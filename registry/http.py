"""The registry's HTTP side: members, health, metrics, admin actions, OpenAPI.

Reads only `published` (an immutable snapshot the loop swaps) and, for /metrics and
/healthz, `figures` (the membership's counts, copied by the loop); admin actions are
submitted to the loop, which stays the only writer. Depends on what `RegistryHandle`
names, not on the server module: arrows run server -> http, never back.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from registry.admission import MAX_BAN_S
from registry.dashboard import dashboard_router
from registry.fleet_stats import FleetFigures
from registry.http_guard import BodyLimit
from registry.kv_reports import KvSummary, kv_index_json
from registry.metrics import LoopStats, make_metrics_registry
from registry.published import Published
from registry.views import matches, member_json
from wire.protocol import ReplyStatus, parse_role

if TYPE_CHECKING:
    from registry.membership import Membership
    from registry.outcome import Outcome

ADMIN_TIMEOUT_S = 5.0


class RegistryHandle(Protocol):
    """What the HTTP side needs of the registry (`registry.server.RegistryServer`)."""

    stats: LoopStats

    @property
    def published(self) -> Published: ...
    @property
    def figures(self) -> FleetFigures: ...
    @property
    def kv_index(self) -> Mapping[str, KvSummary]: ...
    def submit(self, action: Callable[[Membership, float], Outcome]) -> Future[Outcome]: ...
    def loop_stall_s(self) -> float: ...
    def loop_stall_limit_s(self) -> float: ...


def create_app(server: RegistryHandle, *, admin_token: str = "", read_token: str = "",
               exposed: bool = False) -> FastAPI:
    """The registry's HTTP app.

    Who may do what (the threat model in docs/security.md):
    - admin actions (drain, evict): the admin token when one is set; without one, only
      clients on this machine (a loopback peer). Never a browser: a request carrying
      `Origin` or a cross-site `Sec-Fetch-Site` is refused, so no web page an operator
      visits can fire one (CSRF), not even through DNS rebinding.
    - reads (members, bans, dashboard): with `exposed` (bound beyond loopback) and a
      fleet token, the fleet or admin token, as `Authorization: Bearer T` or as the
      password of HTTP Basic (so a browser prompts for it once and the dashboard works).
      /healthz and /metrics stay open for probes and Prometheus.
    """
    app = FastAPI(title="pdreg registry", version="2",
                  description="Live membership of a prefill/decode serving fleet.")
    metrics_registry = make_metrics_registry(server.stats, lambda: server.figures)
    readers = [t.encode() for t in (read_token, admin_token) if t] if exposed else []

    def require_admin(request: Request) -> None:
        _refuse_browsers(request)
        if not admin_token:
            if not _from_loopback(request):
                raise HTTPException(403, "admin actions from another machine need the "
                                         "registry's --admin-token")
            return
        if not _token_matches(request, [admin_token.encode()]):
            raise HTTPException(401, "admin token required: Authorization: Bearer <token>")

    def require_reader(request: Request) -> None:
        if readers and not _token_matches(request, readers):
            raise HTTPException(401, "the fleet token is required: Authorization: Bearer "
                                     "<token>", headers={"WWW-Authenticate": 'Basic '
                                                         'realm="pdreg registry"'})

    reader = [Depends(require_reader)]

    async def run_on_loop(action: Any) -> Outcome:
        future = server.submit(action)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), ADMIN_TIMEOUT_S)
        except TimeoutError:
            raise HTTPException(503, "registry loop did not answer in time") from None

    @app.get("/healthz", responses={503: {"description": "the registry loop is stuck"}})
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

    @app.get("/v1/members", dependencies=reader)
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

    @app.get("/v1/members/{member_id}", dependencies=reader)
    def get_member(member_id: str) -> dict[str, Any]:
        members = server.published.members
        for record in members:
            if record.spec.id == member_id:
                return _with_kv(member_json(record, time.time()),
                                kv_index_json(members, server.kv_index))
        raise HTTPException(404, f"no member {member_id!r}")

    @app.post("/v1/members/{member_id}/drain", dependencies=[Depends(require_admin)])
    async def drain_member(member_id: str) -> Any:
        def drain(membership: Membership, now: float) -> Outcome:
            return membership.drain(member_id)

        return _admin_result(await run_on_loop(drain), member_id, "draining")

    @app.delete("/v1/members/{member_id}", dependencies=[Depends(require_admin)])
    async def evict_member(
        member_id: str,
        ban: Annotated[float, Query(ge=0, le=MAX_BAN_S, description=(
            "seconds during which the id may not register again (0: no ban)"))] = 0.0,
    ) -> Any:
        def evict(membership: Membership, now: float) -> Outcome:
            return membership.evict(member_id, now, ban_s=ban)

        return _admin_result(await run_on_loop(evict), member_id,
                             f"evicted, banned for {ban:g}s" if ban else "evicted")

    @app.get("/v1/bans", dependencies=reader)
    def bans() -> list[dict[str, Any]]:
        """Ids an operator evicted with a ban (here, or at another registry: the banned
        member passed it on), and the seconds each ban has left."""
        published = server.published
        elapsed = time.time() - published.taken_at
        return [{"id": member_id, "seconds_left": round(max(0.0, left - elapsed), 1)}
                for member_id, left in published.banned]

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(dashboard_router(lambda: server.published, lambda: server.kv_index),
                       dependencies=reader)
    # Outermost: a body is refused before anything reads it (no endpoint takes one).
    app.add_middleware(BodyLimit)
    return app


def _with_kv(member: dict[str, Any], kv: dict[str, dict[str, object]]) -> dict[str, Any]:
    """`kv_index` (what routers' KV indexes say of it) when routers report one."""
    shown = kv.get(member["id"])
    if shown is not None:
        member["kv_index"] = shown
    return member


def _refuse_browsers(request: Request) -> None:
    """403 for what a web page can send: browsers set `Origin` on every POST and DELETE
    (and `Sec-Fetch-Site`); pdreg, curl and scripts set neither."""
    site = request.headers.get("sec-fetch-site", "none")
    if "origin" in request.headers or site != "none":
        raise HTTPException(403, "admin actions are not taken from web pages (a request "
                                 "with Origin or Sec-Fetch-Site); use pdreg drain/evict "
                                 "or curl")


def _from_loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _token_matches(request: Request, tokens: list[bytes]) -> bool:
    """Whether `Authorization` carries one of `tokens` (Bearer, or Basic's password)."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    given = value.strip().encode()
    if scheme.lower() == "basic":
        try:
            given = base64.b64decode(given, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    elif scheme.lower() != "bearer":
        return False
    # Every token compared, in constant time each: which one matched is not timed either.
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given, token)
    return matched


def _admin_result(outcome: Outcome, member_id: str, done: str) -> JSONResponse:
    if outcome.status is ReplyStatus.OK:
        return JSONResponse({"id": member_id, "result": done})
    status = 404 if outcome.status is ReplyStatus.UNKNOWN else 409
    return JSONResponse({"detail": outcome.reason}, status_code=status)
