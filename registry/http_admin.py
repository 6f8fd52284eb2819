"""The registry's admin endpoints, and what they leave behind: intents and the replica set.

Every admin write goes to the store first (`registry.store`), then takes effect on every
registry following that store, this one included, from the store's report of it. So
this registry answers once it has applied the write itself (read your writes: a
`pdreg status` right after shows it), 202 if that took longer than APPLY_WAIT_S.

    POST   /v1/members/{id}/drain    drain the incarnation held here (404 if none)
    DELETE /v1/members/{id}?ban=S    evict it where held; with S, refuse the id for S
    POST   /v1/members/{id}/cordon   keep the id out of routing until uncordoned
    DELETE /v1/members/{id}/cordon   uncordon (404 if it was not cordoned)
    GET    /v1/intents               the intents the store holds (readers)
    GET    /v1/registries            the replica set: every live registry (readers)

Refusals, each counted (pdreg_admin_requests_refused_total{reason}) and changing nothing:
a bad id or ban (400), no such member here (404), the store unavailable (503, with the
store's reason; with etcd down, membership and routing go on).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, Protocol

import msgspec
from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse

from registry.admission import MAX_BAN_S
from registry.store.base import StoreUnavailable
from registry.store.metrics import StoreStats
from registry.store.records import CordonIntent, DrainIntent, EvictIntent, Intent, IntentKind
from registry.store.sync import StoreSync
from wire.validation import validate_member_id

__all__ = ["ADMIN_TIMEOUT_S", "APPLY_WAIT_S", "StoreHandle", "admin_routes", "store_routes"]

ADMIN_TIMEOUT_S: Final = 5.0  # the loop answers a question within this, or 503
APPLY_WAIT_S: Final = 2.0  # a stored write is applied here within this, or 202


class StoreHandle(Protocol):
    """What these routes need of the registry (`registry.server.RegistryServer`)."""

    store: StoreSync | None
    store_stats: StoreStats

    def submit(self, action: Callable[[Any, float], Any]) -> Future[Any]: ...


def admin_routes(server: StoreHandle) -> APIRouter:
    """What operators change. The caller guards these with the admin credential."""
    routes = APIRouter()
    stats = server.store_stats

    @routes.post("/v1/members/{member_id}/drain")
    async def drain_member(member_id: str) -> JSONResponse:
        _check_id(member_id, stats)
        incarnation = await _incarnation(server, member_id)
        if incarnation is None:
            raise _refused(stats, "unknown", 404, f"no member {member_id!r}")
        intent = DrainIntent(incarnation=incarnation, at=time.time(), by=_own_id(server))
        return await _write(server, IntentKind.DRAIN, member_id, intent, "draining")

    @routes.delete("/v1/members/{member_id}")
    async def evict_member(member_id: str, ban: str = "0") -> JSONResponse:
        _check_id(member_id, stats)
        ban_s = _ban_seconds(ban, stats)
        incarnation = await _incarnation(server, member_id)
        if incarnation is None and ban_s <= 0:
            raise _refused(stats, "unknown", 404, f"no member {member_id!r}")
        now = time.time()
        intent = EvictIntent(incarnation=incarnation or 0, at=now,
                             ban_until=now + ban_s if ban_s > 0 else 0.0, by=_own_id(server))
        done = f"evicted, banned for {ban_s:g}s" if ban_s > 0 else "evicted"
        return await _write(server, IntentKind.EVICT, member_id, intent, done)

    @routes.post("/v1/members/{member_id}/cordon")
    async def cordon_member(member_id: str) -> JSONResponse:
        _check_id(member_id, stats)
        intent = CordonIntent(at=time.time(), by=_own_id(server))
        return await _write(server, IntentKind.CORDON, member_id, intent, "cordoned")

    @routes.delete("/v1/members/{member_id}/cordon")
    async def uncordon_member(member_id: str) -> JSONResponse:
        _check_id(member_id, stats)
        return await _write(server, IntentKind.CORDON, member_id, None, "uncordoned",
                            missing=f"{member_id!r} is not cordoned")

    return routes


def store_routes(server: StoreHandle) -> APIRouter:
    """What the store holds, for readers: intents and the replica set."""
    routes = APIRouter()

    @routes.get("/v1/intents")
    def intents() -> list[dict[str, Any]]:
        store = _store(server)
        return [{"kind": kind.value, "id": member_id, **msgspec.to_builtins(intent),
                 "revision": revision}
                for (kind, member_id), (intent, revision) in sorted(store.intents.items())]

    @routes.get("/v1/registries")
    def registries() -> list[dict[str, Any]]:
        """Every registry in the replica set (with etcd: each one holding a live lease;
        with memory or file: this one alone)."""
        store = _store(server)
        return [{**msgspec.to_builtins(entry), "self": entry.id == store.own.id,
                 "store": str(store.store.url)}
                for _, entry in sorted(store.registries.items())]

    return routes


async def _write(server: StoreHandle, kind: IntentKind, member_id: str,
                 intent: Intent | None, done: str, missing: str = "") -> JSONResponse:
    """Store the intent (None: delete it; `missing` when there was none), then wait
    until it is applied here."""
    store = _store(server)
    try:
        if intent is None:
            revision = await asyncio.to_thread(store.remove, kind, member_id)
        else:
            revision = await asyncio.to_thread(store.write, kind, member_id, intent)
    except StoreUnavailable as exc:
        raise _refused(server.store_stats, "unavailable", 503,
                       f"the store ({store.store.url}) did not take the write: {exc}") \
            from None
    if not revision:
        raise _refused(server.store_stats, "unknown", 404, missing)
    applied = await asyncio.to_thread(store.wait_applied, revision, APPLY_WAIT_S)
    body = {"id": member_id, "result": done, "revision": revision,
            "store": str(store.store.url), "shared": store.store.url.shared,
            "applied": applied}
    return JSONResponse(body, status_code=200 if applied else 202)


async def _incarnation(server: StoreHandle, member_id: str) -> int | None:
    """The incarnation of `member_id` this registry holds, asked of the loop."""
    def ask(membership: Any, now: float) -> int | None:
        spec = membership.spec_of(member_id)
        return spec.incarnation if spec is not None else None

    try:
        return await asyncio.wait_for(asyncio.wrap_future(server.submit(ask)),
                                      ADMIN_TIMEOUT_S)
    except TimeoutError:
        raise HTTPException(503, "registry loop did not answer in time") from None


def _store(server: StoreHandle) -> StoreSync:
    if server.store is None:
        raise HTTPException(503, "the registry is starting")
    return server.store


def _own_id(server: StoreHandle) -> str:
    return _store(server).own.id


def _check_id(member_id: str, stats: StoreStats) -> None:
    problem = validate_member_id(member_id)
    if problem:
        raise _refused(stats, "id", 400, problem)


def _ban_seconds(text: str, stats: StoreStats) -> float:
    try:
        ban_s = float(text)
    except ValueError:
        ban_s = math.nan
    if not 0.0 <= ban_s <= MAX_BAN_S:  # also refuses nan
        raise _refused(stats, "ban", 400, f"ban {text[:50]!r} must be 0..{MAX_BAN_S:.0f} "
                                          f"seconds")
    return ban_s


def _refused(stats: StoreStats, reason: str, status: int, detail: str) -> HTTPException:
    stats.admin_refused[reason] += 1
    return HTTPException(status, detail)
