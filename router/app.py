"""The OpenAI-compatible HTTP front: admission, pairing, the handshake, relaying, retries.

One request: read and decode the body once; pick (P, D) from the pairing table (rebuilt
only when the view hands out a new membership mapping); drive the pair's adapter; relay
D's answer. A prefill failure quarantines that prefill and retries on a new pair; a
decode failure before the client has seen a byte retries too; a failure after that ends
the stream with an SSE error event. A client that leaves cancels the handler, which
closes both upstream legs.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import msgspec
from aiohttp import web

from registry.client import LiveMember
from router.adapters import ADAPTERS, Exchange, LegFailure, UpstreamRejected, adapter_for
from router.metrics import RouterMetrics
from router.policies import (
    DEFAULT_POLICY,
    DEFAULT_STALE_LOAD_S,
    Candidate,
    Pair,
    PairingTable,
    make_pairer,
    prefix_key,
    session_key,
)
from router.quarantine import QUARANTINE_S, Quarantine
from router.upstream import UpstreamPool

__all__ = ["MAX_ATTEMPTS", "MembershipSource", "Router"]

logger = logging.getLogger(__name__)

SESSION_HEADER: Final = "X-Session-Id"  # the `session` policy keeps a session on one pair
UNKNOWN_MODEL_LABEL: Final = "unknown"  # metrics label for models no member serves
MAX_ATTEMPTS: Final = 3  # pairs tried per request before giving up with 502
COMPANION_WAIT_S: Final = 5.0  # after D is done, how long SGLang's P leg may still take
_SSE_EVENT_END: Final = b"\n\n"
_SSE_DONE: Final = b"data: [DONE]\n\n"
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_READ_ERRORS: Final = OSError  # dropped (UpstreamError), reset, timed out

_decode = msgspec.json.decode
_encode = msgspec.json.encode


class MembershipSource(Protocol):
    """What the router needs of `registry.client.MembershipView`."""

    def members(self) -> Mapping[str, LiveMember]: ...
    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        """Queue a failure report for the registries; must not block (called on the loop)."""


def openai_error(status: int, message: str, kind: str, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.Response(status=status, body=_encode(body), content_type="application/json",
                        headers=headers)


class Router:
    """Request handling state: the view, the pairer, in-flight counts, quarantine, metrics.

    Lives on one event loop; nothing here is shared across threads except `view`, whose
    `members()` is a reference swap and whose `report()` only queues (it never blocks).
    """

    def __init__(self, view: MembershipSource, *, policy: str = DEFAULT_POLICY,
                 locality_label: str = "", api_key: str = "",
                 max_attempts: int = MAX_ATTEMPTS, quarantine_s: float = QUARANTINE_S,
                 stale_load_s: float = DEFAULT_STALE_LOAD_S, member_id: str = "router",
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view = view
        self.policy = policy
        self.pairer = make_pairer(policy, rng=rng, stale_after_s=stale_load_s)
        self.locality_label = locality_label
        self.max_attempts = max(1, max_attempts)
        self.quarantine = Quarantine(quarantine_s)
        self.metrics = RouterMetrics()
        self.member_id = member_id
        self._api_key = f"Bearer {api_key}".encode() if api_key else b""
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._seen: Mapping[str, LiveMember] | None = None
        self._table = PairingTable({})
        self._request_ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self.session: UpstreamPool | None = None

    # --- wiring -------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, app: web.Application) -> None:
        self.session = UpstreamPool()

    async def _close_session(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def table(self) -> PairingTable:
        """The pairing table for the current membership; rebuilt only when it changed."""
        members = self.view.members()
        if members is not self._seen:
            self._table = PairingTable.build(members, self.locality_label, ADAPTERS)
            self._seen = members
        return self._table

    # --- small handlers -----------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if not self._api_key:
            return True
        given = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, self._api_key)

    async def handle_models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _unauthorized()
        models = self.table().models(self.quarantine.active(self._clock()))
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdreg"}
                for m in sorted(models)]
        return web.Response(body=_encode({"object": "list", "data": data}),
                            content_type="application/json")

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    # --- the request path ---------------------------------------------------------------

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        started = self._clock()
        if not self._authorized(request):
            return _unauthorized()
        try:
            body = _decode(await request.read())
        except msgspec.DecodeError as exc:
            return openai_error(400, f"request body is not JSON: {exc}", "invalid_request_error")
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            return openai_error(400, "'model' is required", "invalid_request_error")
        stream = body.get("stream") is True
        key = self._affinity_key(request, body)
        request_id = f"pdreg-{self._id_prefix}-{next(self._request_ids)}"
        tried: list[str] = []
        last_failure = ""
        for _attempt in range(self.max_attempts):
            now = self._clock()
            pair = self.pairer.choose(self.table(), model, now=now, in_flight=self._in_flight,
                                      quarantined=self.quarantine.active(now), key=key,
                                      exclude=tried)
            if pair is None:
                break
            self._pick(pair)
            prefill_held = not pair.direct
            try:
                exchange = await adapter_for(pair).open(
                    self.session, pair, request.path, body, request_id)  # type: ignore[arg-type]
                if prefill_held:  # the prefill's part is done once D has answered
                    self._release(pair.prefill)
                    prefill_held = False
                try:
                    return await self._relay(request, exchange, pair, model, stream, started)
                finally:
                    exchange.close()
            except LegFailure as failure:
                self._on_failure(failure)
                tried.extend((pair.prefill.id, pair.decode.id))
                last_failure = str(failure)
                self.metrics.retries.labels(f"{failure.role}_failed").inc()
            except UpstreamRejected as rejected:
                self._count(model, "client_error")
                return web.Response(status=rejected.status, body=rejected.body,
                                    headers={"Content-Type": rejected.content_type})
            except (asyncio.CancelledError, ConnectionResetError):
                self._count(model, "cancelled")
                raise
            finally:
                if prefill_held:
                    self._release(pair.prefill)
                self._release(pair.decode)
        if not tried:
            self._count(model, "no_capacity")
            return openai_error(503, f"no routable prefill and decode for model {model!r}",
                                "service_unavailable", "no_capacity", {"Retry-After": "1"})
        self._count(model, "upstream_error")
        return openai_error(502, f"every pair tried failed; last: {last_failure}",
                            "upstream_error", "upstream_failed")

    async def _relay(self, request: web.Request, exchange: Exchange, pair: Pair, model: str,
                     stream: bool, started: float) -> web.StreamResponse:
        """Relay D's answer. Raises LegFailure only before the client saw anything."""
        upstream = exchange.response
        decode = pair.decode
        if not (stream and upstream.status == 200):
            try:
                data = await upstream.read()
            except _READ_ERRORS as exc:
                raise LegFailure(decode, "decode", f"read: {type(exc).__name__}") from None
            await self._check_companion(exchange)
            self._count(model, "ok" if upstream.status < 400 else "client_error")
            self.metrics.e2e_of(model).observe(self._clock() - started)
            return web.Response(status=upstream.status, body=data,
                                headers={"Content-Type": upstream.content_type})
        try:
            first = await upstream.readany()
        except _READ_ERRORS as exc:
            raise LegFailure(decode, "decode", f"stream: {type(exc).__name__}") from None
        if not first:
            raise LegFailure(decode, "decode", "stream ended before any data",
                             quarantine=False)
        self.metrics.ttft_of(model).observe(self._clock() - started)
        out = web.StreamResponse(headers=_SSE_HEADERS)
        try:
            return await self._stream(request, out, exchange, decode, model, first, started)
        except ConnectionError:
            # A write to the client's closing socket: the client hung up (often right
            # after [DONE], before the stream's end). A cancel, not an upstream failure.
            logger.debug("[router] client left mid-response model=%s", model)
            self._count(model, "cancelled")
            return out

    async def _stream(self, request: web.Request, out: web.StreamResponse,
                      exchange: Exchange, decode: Candidate, model: str, first: bytes,
                      started: float) -> web.StreamResponse:
        """Forward D's SSE stream. Writes to a departed client raise ConnectionError."""
        await out.prepare(request)
        upstream = exchange.response
        # Forward whole SSE events only, so an error event never lands inside a cut one.
        pending = first
        while True:
            cut = pending.rfind(_SSE_EVENT_END)
            if cut >= 0:
                await out.write(pending[:cut + 2])
                pending = pending[cut + 2:]
            try:
                chunk = await upstream.readany()
            except _READ_ERRORS as exc:
                failure = exchange.companion_failure() or LegFailure(
                    decode, "decode", f"mid-stream: {type(exc).__name__}")
                self._on_failure(failure)
                self._count(model, "failed_midstream")
                await self._write_stream_error(out, str(failure))
                return out
            if not chunk:
                break
            pending += chunk
        if pending:
            await out.write(pending)
        await self._check_companion(exchange)
        await out.write_eof()
        self._count(model, "ok")
        self.metrics.e2e_of(model).observe(self._clock() - started)
        return out

    async def _check_companion(self, exchange: Exchange) -> None:
        if exchange.companion is not None:
            failure = await exchange.finish(COMPANION_WAIT_S)
            if failure is not None:  # D answered anyway; still keep that P out for a while
                self._on_failure(failure)

    @staticmethod
    async def _write_stream_error(out: web.StreamResponse, message: str) -> None:
        event = {"error": {"message": message, "type": "upstream_error",
                           "code": "upstream_failed"}}
        try:
            await out.write(b"data: " + _encode(event) + b"\n\n" + _SSE_DONE)
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client is gone too

    # --- bookkeeping --------------------------------------------------------------------

    def _affinity_key(self, request: web.Request, body: dict[str, Any]) -> int:
        """What affinity policies hash: the session (header, else OpenAI's `user`) or the
        prompt's prefix; 0 for the policies that hash nothing."""
        if self.policy == "session":
            session = request.headers.get(SESSION_HEADER) or body.get("user")
            if isinstance(session, str) and session:
                return session_key(session)
        elif self.policy != "prefix":
            return 0
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prefix_key(prompt.encode())
        source = prompt if prompt is not None else body.get("messages")
        return prefix_key(_encode(source))

    def _pick(self, pair: Pair) -> None:
        """Count the pick and hold an in-flight slot per distinct member of the pair."""
        picks = self.metrics.picks_of
        picks(pair.decode.id, "decode").inc()
        self._acquire(pair.decode)
        if not pair.direct:
            picks(pair.prefill.id, "prefill").inc()
            self._acquire(pair.prefill)

    def _acquire(self, member: Candidate) -> None:
        self._in_flight[member.id] = self._in_flight.get(member.id, 0) + 1
        self.metrics.in_flight_of(member.id).inc()

    def _release(self, member: Candidate) -> None:
        count = self._in_flight.get(member.id, 0) - 1
        if count > 0:
            self._in_flight[member.id] = count
        else:
            self._in_flight.pop(member.id, None)
        self.metrics.in_flight_of(member.id).dec()

    def _count(self, model: str, outcome: str) -> None:
        # Clients name the model: only models the fleet serves get a series of their own,
        # so a typo or a scan cannot grow the metrics without bound.
        label = model if model in self._table.pools else UNKNOWN_MODEL_LABEL
        self.metrics.requests_of(label, outcome).inc()

    def _on_failure(self, failure: LegFailure) -> None:
        member = failure.member
        logger.warning("[router] leg failed role=%s id=%s: %s", failure.role, member.id,
                       failure.reason)
        if not failure.quarantine:
            return
        if self.quarantine.add(member.id, member.incarnation, self._clock()):
            self.metrics.quarantines.labels(member.id).inc()
            problem = f"{failure.role}: {failure.reason}"[:200]
            try:
                self.view.report(member.id, member.incarnation, problem)
            except Exception:  # a registry that is away must not break request handling
                logger.exception("[router] report to registry failed id=%s", member.id)


def _unauthorized() -> web.Response:
    return openai_error(401, "missing or wrong API key (Authorization: Bearer ...)",
                        "invalid_request_error", "invalid_api_key")
