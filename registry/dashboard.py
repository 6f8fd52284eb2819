"""The registry's live dashboard: a page at `/` and its Server-Sent Events at `/v1/stream`.

A stream sends the whole state once (`event: state`), then every `STREAM_POLL_S` what
changed since (`event: changes`: ordered ops, from registry/change_log.py), so an open
page costs the registry the changes, never a walk over the members; a stream that falls
behind the log gets the whole state again. A comment line every `KEEPALIVE_S` keeps
proxies from closing an idle stream. The whole state's JSON is computed once per
snapshot and a change's once, both shared by every viewer, and at most `MAX_STREAMS`
streams are open at once, so viewers cannot make the registry do work in proportion to
their number. The page is one self-contained file (no CDN: nothing is fetched at run
time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from registry.change_log import ChangeLog, Chunk
from registry.kv_reports import KvSummary, kv_index_json, summary_json
from registry.published import Published
from registry.views import member_json
from wire.figures import PREFIX_CACHE_HIT_RATE
from wire.protocol import (
    LeaveReason,
    LoadEntry,
    MemberJoined,
    MemberLeft,
    MembershipEvent,
    role_name,
)

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode  # ~5x json.dumps: loads are the bulk of a push

STREAM_POLL_S = 0.5
KEEPALIVE_S = 15.0
MAX_STREAMS = 32  # open SSE streams at once; more get 503
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


def dashboard_state(published: Published,
                    kv_index: Mapping[str, KvSummary] | None = None) -> dict[str, Any]:
    """Everything the page shows, from one snapshot (ages as of when it was taken), and
    per member what the routers' KV indexes say (`kv_index`, for those that have one)."""
    now = published.taken_at
    members = [member_json(record, now) for record in published.members]
    kv = kv_index_json(published.members, kv_index or {})
    for member in members:
        shown = kv.get(member["id"])
        if shown is not None:
            member["kv_index"] = shown
    return {
        "epoch": published.epoch,
        "version": published.version,
        "heartbeat_interval_s": published.heartbeat_interval_s,
        "lease_s": published.lease_s,
        "self_preserving": published.self_preserving,
        "taken_at": published.taken_at,
        "members": members,
        "events": [event_json(event) for event in published.recent_events],
    }


def render_ops(chunk: Chunk) -> str:
    """A chunk of the change log as the page's ops (a JSON array's inside): a member
    joined or changed (with its event), left; new loads, as rows of (id, incarnation,
    running, waiting, kv_usage, heartbeat_age_s[, prefix cache hit rate]) in one op (the
    bulk: ~20k a second at 100k members); a router's KV summary."""
    ops: list[dict[str, Any]] = []
    if chunk.kind == "events":
        for event in chunk.items:
            op: dict[str, Any] = {"event": event_json(event)}
            if not isinstance(event, MemberLeft):
                op["member"] = member_json(event.member, chunk.wall)
            ops.append(op)
    elif chunk.kind == "loads":
        ops.append({"loads": [_load_row(e) for e in chunk.items]})
    elif chunk.kind == "kv":
        assert isinstance(chunk.items, dict)
        ops.extend({"kv": {"id": member_id,
                           "incarnation": summary.incarnation if summary else 0,
                           "summary": summary_json(summary) if summary else None}}
                   for member_id, summary in chunk.items.items())
    return _encode(ops)[1:-1].decode()


def changes_text(chunks: list[Chunk], meta: Mapping[str, Any]) -> str:
    """One `changes` message: the registry's figures now and the chunks' ops, in order."""
    ops = ",".join(text for chunk in chunks if (text := chunk.rendered(render_ops)))
    return f'{{"meta":{json.dumps(meta, allow_nan=False)},"ops":[{ops}]}}'


@cache
def _page() -> str:
    return PAGE_PATH.read_text(encoding="utf-8")


_NO_KV: Mapping[str, KvSummary] = {}


class SharedState:
    """The page's state per snapshot (and KV index view), computed once for every viewer.

    `kv_index`: the registry's KV summaries, an immutable mapping swapped whole on each
    change (registry.kv_reports), so its identity says whether it changed."""

    def __init__(self, published: Callable[[], Published],
                 kv_index: Callable[[], Mapping[str, KvSummary]] = lambda: _NO_KV) -> None:
        self._published = published
        self._kv_index = kv_index
        self._cached: tuple[Published, Mapping[str, KvSummary], str] | None = None

    def current(self) -> str:
        """The JSON text of the current snapshot's whole state."""
        published, kv = self._published(), self._kv_index()
        cached = self._cached
        if cached is None or cached[0] is not published or cached[1] is not kv:
            cached = (published, kv,
                      json.dumps(dashboard_state(published, kv), allow_nan=False))
            self._cached = cached  # one reference swap: safe across threads
        return cached[2]


class _StreamSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def take(self) -> Callable[[], None] | None:
        """A release function for one more stream, or None when all are taken."""
        if self.active >= self.limit:
            return None
        self.active += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1

        return release


def dashboard_router(published: Callable[[], Published],
                     kv_index: Callable[[], Mapping[str, KvSummary]] = lambda: _NO_KV,
                     changes: ChangeLog | None = None) -> APIRouter:
    """`changes`: the loop's change log (registry/change_log.py) that streams follow."""
    router = APIRouter()
    log = changes if changes is not None else ChangeLog()
    shared = SharedState(published, kv_index)
    slots = _StreamSlots(MAX_STREAMS)

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(_page())

    @router.get("/v1/dashboard")
    def state() -> Response:
        """The dashboard's state once (what each stream message carries)."""
        return Response(shared.current(), media_type="application/json")

    @router.get("/v1/stream", summary="Live membership as Server-Sent Events",
                responses={503: {"description": f"{MAX_STREAMS} streams are open already"}})
    async def stream(request: Request) -> StreamingResponse:
        release = slots.take()
        if release is None:
            raise HTTPException(503, f"{MAX_STREAMS} dashboard streams are open already; "
                                     f"close one or poll /v1/dashboard")
        events = _events(shared, log, request, release)
        # A stream the server never started (the client left at once) never runs its
        # `finally`; the slot then comes back when the generator is collected.
        weakref.finalize(events, release)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers=_SSE_HEADERS)

    return router


async def _events(shared: SharedState, log: ChangeLog, request: Request,
                  release: Callable[[], None]) -> AsyncIterator[str]:
    cursor = log.follow()  # before the snapshot: what follows it is in the log
    try:
        yield f"retry: {int(STREAM_POLL_S * 2000)}\n\n"  # reconnect soon after a restart
        yield f"event: state\ndata: {await asyncio.to_thread(shared.current)}\n\n"
        last_sent = time.monotonic()
        while not await request.is_disconnected():
            await asyncio.sleep(STREAM_POLL_S)
            got = log.since(cursor)
            now = time.monotonic()
            if got is None:  # fell behind the log: the whole state again
                cursor = log.head
                last_sent = now
                yield f"event: state\ndata: {await asyncio.to_thread(shared.current)}\n\n"
                continue
            chunks, cursor = got
            if chunks:
                last_sent = now
                yield f"event: changes\ndata: {changes_text(chunks, log.meta)}\n\n"
            elif now - last_sent >= KEEPALIVE_S:
                last_sent = now
                yield ": keep-alive\n\n"
    finally:
        log.unfollow()
        release()


def _load_row(e: LoadEntry) -> tuple[Any, ...]:
    """One member's load row; the hit rate only from engines that report one, so a
    fleet without it pays nothing for it."""
    row = (e.id, e.incarnation, e.load.running, e.load.waiting, e.load.kv_usage,
           round(e.heartbeat_age_s, 3))
    hit_rate = e.load.extra.get(PREFIX_CACHE_HIT_RATE)
    return row if hit_rate is None else (*row, hit_rate)
