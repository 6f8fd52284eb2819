"""The registry's live dashboard: a page at `/` and its Server-Sent Events at `/v1/stream`.

The stream polls `server.published` (the loop's immutable snapshot) every
`STREAM_POLL_S` and pushes the whole state when the membership version or any load,
state or suspicion changed; a comment line every `KEEPALIVE_S` keeps proxies from
closing an idle stream. The page is one self-contained file (no CDN: nothing can be
fetched at run time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from registry.protocol import LeaveReason, MemberJoined, MemberLeft, MembershipEvent, role_name
from registry.views import member_json

if TYPE_CHECKING:
    from registry.server import Published, RegistryServer

logger = logging.getLogger(__name__)

STREAM_POLL_S = 0.5
KEEPALIVE_S = 15.0
PAGE_PATH = Path(__file__).resolve().parent / "static" / "dashboard.html"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_json(event: MembershipEvent) -> dict[str, Any]:
    """One membership event as the page lists it."""
    if isinstance(event, MemberLeft):
        return {"version": event.version, "kind": "left", "id": event.id,
                "model": event.model, "reason": LeaveReason(event.reason).name.lower()}
    record = event.member
    return {"version": event.version,
            "kind": "joined" if isinstance(event, MemberJoined) else "updated",
            "id": record.spec.id, "role": role_name(record.spec.role),
            "model": record.spec.model, "state": record.state.name.lower(),
            "suspect": record.suspect}


def dashboard_state(published: Published) -> dict[str, Any]:
    """Everything the page shows, from one snapshot."""
    now = time.time()
    return {
        "epoch": published.epoch,
        "version": published.version,
        "heartbeat_interval_s": published.heartbeat_interval_s,
        "lease_s": published.lease_s,
        "self_preserving": published.self_preserving,
        "taken_at": published.taken_at,
        "members": [member_json(record, now) for record in published.members],
        "events": [event_json(event) for event in published.recent_events],
    }


def _fingerprint(published: Published) -> tuple[Any, ...]:
    """What, when it changes, is worth a push (heartbeat ages alone are not)."""
    return (published.epoch, published.version, published.self_preserving,
            tuple((r.spec.id, r.state, r.suspect, r.load) for r in published.members))


@cache
def _page() -> str:
    return PAGE_PATH.read_text(encoding="utf-8")


def dashboard_router(server: RegistryServer) -> APIRouter:
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(_page())

    @router.get("/v1/dashboard")
    def state() -> dict[str, Any]:
        """The dashboard's state once (what each stream message carries)."""
        return dashboard_state(server.published)

    @router.get("/v1/stream", summary="Live membership as Server-Sent Events")
    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(_events(server, request), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)

    return router


async def _events(server: RegistryServer, request: Request) -> AsyncIterator[str]:
    last: tuple[Any, ...] | None = None
    last_sent = time.monotonic()
    yield f"retry: {int(STREAM_POLL_S * 2000)}\n\n"  # reconnect soon after a restart
    while not await request.is_disconnected():
        published = server.published
        fingerprint = _fingerprint(published)
        now = time.monotonic()
        if fingerprint != last:
            last = fingerprint
            last_sent = now
            yield f"event: state\ndata: {json.dumps(dashboard_state(published))}\n\n"
        elif now - last_sent >= KEEPALIVE_S:
            last_sent = now
            yield ": keep-alive\n\n"
        await asyncio.sleep(STREAM_POLL_S)
