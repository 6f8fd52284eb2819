"""The OpenAI-compatible HTTP front: admission, then a `Proxy` per request.

Admission reads and decodes the body once, strips the fields the router owns, and
refuses what it cannot serve: 401 (API key), 400 (not JSON, no model), 404
`model_not_found` (no member serves or has served the model), 503 `no_capacity` (a known
model, no routable pair now), 508 (a request from a router: a loop). `Proxy`
(router/proxy.py) does the rest: pairing, retries, relaying and migration.

`Router` holds what requests share: the view and its pairing table, the policy, the
router's own in-flight counts, local quarantine, per-member latency and the metrics.
It lives on one event loop; nothing here is shared across threads except `view`, whose
`members()` is a reference swap and whose `report()` only queues (it never blocks).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol

import msgspec
from aiohttp import web

from registry.client import LiveMember
from registry.protocol import Role
from router.adapters import Adapters, LegFailure, UpstreamRejected, default_adapters
from router.continuation import why_not_migratable
from router.guard import HOP_HEADER, UpstreamPolicy, strip_internal_fields
from router.inflight import Hold, InFlight
from router.kv_policy import KvAffinity
from router.kv_routing import KvRouting
from router.latency import DECAY_S, LatencyTracker
from router.metrics import RouterMetrics
from router.policies import (
    DECODE_ROLE,
    DEFAULT_POLICY,
    DEFAULT_STALE_LOAD_S,
    PREFILL_ROLE,
    make_pairer,
)
from router.proxy import Call, Proxy
from router.quarantine import QUARANTINE_S, Quarantine
from router.table import Candidate, Pair, PairingTable
from router.upstream import UpstreamPool
from router.upstream_bounds import Timeouts

__all__ = ["MAX_ATTEMPTS", "MAX_MIGRATIONS", "MembershipSource", "Router"]

logger = logging.getLogger(__name__)

SESSION_HEADER: Final = "X-Session-Id"  # the `session` policy keeps a session on one pair
UNKNOWN_MODEL_LABEL: Final = "unknown"  # metrics label for models no member serves
MAX_ATTEMPTS: Final = 3  # pairs tried per request before giving up with 502
MAX_MIGRATIONS: Final = 3  # times one stream may continue on a new pair
MAX_KNOWN_MODELS: Final = 10_000  # models remembered for 404-vs-503 (registry-bounded)
MAX_BODY_BYTES: Final = 16 * 1024 * 1024  # a client's request body
# Failures kept local: a slow engine is not a dead one, and a hung one stops heartbeating,
# which the registry sees for itself. Reporting them would make a loaded fleet suspect.
_NOT_REPORTED: Final = frozenset({"idle_timeout", "first_byte_timeout"})

_decode = msgspec.json.decode
_encode = msgspec.json.encode


class MembershipSource(Protocol):
    """What the router needs of `registry.client.MembershipView`."""

    @property
    def synced(self) -> bool:
        """A registry has given a snapshot at least once (the view knows something)."""

    def members(self) -> Mapping[str, LiveMember]: ...
    def loads_confirmed_at(self, model: str) -> float:
        """When a registry last confirmed `model`'s loads unchanged (monotonic)."""

    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        """Queue a failure report for the registries; must not block (called on the loop)."""


def openai_error(status: int, message: str, kind: str, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.Response(status=status, body=_encode(body), content_type="application/json",
                        headers=headers)


class Router:
    def __init__(self, view: MembershipSource, *, policy: str = DEFAULT_POLICY,
                 locality_label: str = "", api_key: str = "",
                 max_attempts: int = MAX_ATTEMPTS, max_migrations: int = MAX_MIGRATIONS,
                 quarantine_s: float = QUARANTINE_S,
                 stale_load_s: float = DEFAULT_STALE_LOAD_S, member_id: str = "router",
                 timeouts: Timeouts | None = None,
                 upstream_policy: UpstreamPolicy | None = None,
                 adapters: Adapters | None = None, rng: random.Random | None = None,
                 latency_decay_s: float = DECAY_S,
                 clock: Callable[[], float] = time.monotonic,
                 tokenizers: Mapping[str, str] | None = None,
                 disagg_min_uncached_tokens: int = 0) -> None:
        self.view = view
        self.policy = policy
        self.latency = LatencyTracker(decay_s=latency_decay_s)
        self.pairer = make_pairer(policy, rng=rng, stale_after_s=stale_load_s,
                                  latency=self.latency)
        self.locality_label = locality_label
        self.max_attempts = max(1, max_attempts)
        self.max_migrations = max(0, max_migrations)
        self.quarantine = Quarantine(quarantine_s)
        self.metrics = RouterMetrics()
        self.in_flight = InFlight(self.metrics.in_flight_of)
        self.adapters: Adapters = adapters if adapters is not None else default_adapters()
        self.member_id = member_id
        self.timeouts = timeouts or Timeouts()
        self.upstream_policy = upstream_policy or UpstreamPolicy.build()
        self.draining = False
        self._api_key = f"Bearer {api_key}".encode() if api_key else b""
        self._clock = clock
        self._seen: Mapping[str, LiveMember] | None = None
        self._table = PairingTable({})
        self._known_models: set[str] = set()
        self._request_ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self._pool: UpstreamPool | None = None
        # KV-aware pairing (`--policy kv`): its index, feed and tokenizers (kv_routing).
        self.kv: KvRouting | None = None
        if policy == "kv":
            self.kv = KvRouting(self.metrics, allows=self.upstream_policy.allows,
                                tokenizers=tokenizers, stale_after_s=stale_load_s,
                                disagg_min_uncached_tokens=disagg_min_uncached_tokens)
            self.pairer = self.kv.pairer

    # --- wiring -------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/v1/kv", self.handle_kv)
        app.on_startup.append(self._open_pool)
        app.on_cleanup.append(self._close_pool)
        return app

    async def _open_pool(self, app: web.Application) -> None:
        self._pool = UpstreamPool(timeouts=self.timeouts, policy=self.upstream_policy)

    async def _close_pool(self, app: web.Application) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self.kv is not None:
            self.kv.close()

    def upstream(self) -> UpstreamPool:
        assert self._pool is not None, "the app has not started"
        return self._pool

    @property
    def session(self) -> UpstreamPool | None:  # tests look at the pool
        return self._pool

    def table(self) -> PairingTable:
        """The pairing table for the current membership; rebuilt only when it changed."""
        members = self.view.members()
        if members is not self._seen:
            self._table = PairingTable.build(members, self.locality_label, self.adapters)
            self._seen = members
            if len(self._known_models) < MAX_KNOWN_MODELS:
                self._known_models.update(m.record.spec.model for m in members.values()
                                          if m.record.spec.role is not Role.API_SERVER)
            self.latency.retain(members.keys())
            if self.kv is not None:
                self.kv.on_members(members)
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
        """Liveness: the process and its event loop answer."""
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def handle_ready(self, request: web.Request) -> web.Response:
        """Readiness: 503 while draining or before the view has ever synced. A registry
        that goes away later does not make the router unready: it serves from its last
        view, which is the point of keeping one."""
        if self.draining:
            return web.Response(status=503, body=b'{"status":"draining"}',
                                content_type="application/json")
        if not self.view.synced:
            return web.Response(status=503, body=b'{"status":"no membership yet"}',
                                content_type="application/json")
        return web.Response(body=b'{"status":"ready"}', content_type="application/json")

    async def handle_kv(self, request: web.Request) -> web.Response:
        """Per member: KV index state, blocks indexed, event lag (`--policy kv`)."""
        if not self._authorized(request):
            return _unauthorized()
        self.table()
        members = self.kv.status(time.time()) if self.kv is not None else []
        return web.Response(body=_encode({"policy": self.policy, "members": members}),
                            content_type="application/json")

    async def affinity(self, request: web.Request, body: Mapping[str, object],
                       model: str) -> int | KvAffinity:
        """The request's affinity input for the policy: the `kv` policy's exact prompt
        blocks (tokenized off the loop when long), else the policy's int key."""
        if self.kv is not None:
            self.table()  # the model's tokenizer and block sizes follow membership
            return await self.kv.affinity(body, model)
        return self.pairer.affinity_key(request.headers.get(SESSION_HEADER, ""), body)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    # --- the request path ---------------------------------------------------------------

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        if not self._authorized(request):
            return _unauthorized()
        if HOP_HEADER in request.headers:
            # Sent by a router: some member's URL leads back to a router. Refuse, so the
            # request cannot circle; the sender quarantines that member.
            return openai_error(508, "request loop: this router was reached through a "
                                "router", "invalid_request_error", "loop_detected")
        try:
            body = _decode(await request.read())
        except msgspec.DecodeError as exc:
            return openai_error(400, f"request body is not JSON: {exc}", "invalid_request_error")
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            return openai_error(400, "'model' is required", "invalid_request_error")
        stripped = strip_internal_fields(body)
        if stripped:
            logger.debug("[router] stripped client fields %s", stripped)
        stream_options = body.get("stream_options")
        call = Call(
            path=request.path, body=body, model=model, stream=body.get("stream") is True,
            key=await self.affinity(request, body, model),
            request_id=f"pdreg-{self._id_prefix}-{next(self._request_ids)}",
            started=started, wants_ids=body.get("return_token_ids") is True,
            include_usage=isinstance(stream_options, dict)
            and stream_options.get("include_usage") is True,
            migratable=why_not_migratable(request.path, body) if body.get("stream") is True
            else "not streamed")
        proxy = Proxy(self, call)
        try:
            response = await (proxy.stream(request) if call.stream else proxy.whole())
        except UpstreamRejected as rejected:
            self.count(model, "client_error")
            return web.Response(status=rejected.status, body=rejected.body,
                                headers={"Content-Type": rejected.content_type})
        except BaseException:  # the client left (cancel, reset) while we waited upstream
            self.count(model, "cancelled")
            raise
        if self.draining:
            # Answer, then close the connection: a keep-alive client reconnects through
            # its load balancer, to a router that is not draining.
            response.force_close()
        return response

    # --- what a Proxy uses --------------------------------------------------------------

    def choose(self, model: str, key: int | KvAffinity, tried: list[str], *,
               despite_quarantine: bool = False) -> Pair | None:
        """A pair for the request; `despite_quarantine`: a stream already under way is
        better continued on a member that failed a moment ago than ended."""
        now = self._clock()
        quarantined = None if despite_quarantine else self.quarantine.active(now)
        pair = self.pairer.choose(self.table(), model, now=now,
                                  in_flight=self.in_flight.counts, quarantined=quarantined,
                                  key=key, exclude=tried,  # type: ignore[arg-type]
                                  loads_confirmed_at=self.view.loads_confirmed_at(model))
        if self.kv is not None and pair is not None and not tried:
            self.kv.picked(model, key, pair)
        return pair

    def hold(self, pair: Pair) -> tuple[Hold, Hold | None]:
        """Count the pick; an in-flight slot on D, and on P unless it is D itself."""
        picks = self.metrics.picks_of
        picks(pair.decode.id, "decode").inc()
        decode = self.in_flight.hold(pair.decode.id)
        if pair.direct:
            return decode, None
        picks(pair.prefill.id, "prefill").inc()
        return decode, self.in_flight.hold(pair.prefill.id)

    def observe_prefill(self, member: Candidate, seconds: float) -> None:
        if self.pairer.latency is not None:  # only latency-aware policies read them
            self.latency.observe(PREFILL_ROLE, member.id, member.incarnation, seconds,
                                 self._clock())

    def observe_decode(self, member: Candidate, seconds_per_token: float) -> None:
        if self.pairer.latency is not None:
            self.latency.observe(DECODE_ROLE, member.id, member.incarnation,
                                 seconds_per_token, self._clock())

    def no_capacity(self, model: str) -> web.Response:
        """404 for a model no member serves or has served; 503 for one that has none
        routable right now (clients retry a 503, not a 404)."""
        self.table()
        if model not in self._known_models:
            self.count(model, "model_not_found")
            return openai_error(404, f"the model {model!r} does not exist",
                                "invalid_request_error", "model_not_found")
        self.count(model, "no_capacity")
        return openai_error(503, f"no routable prefill and decode for model {model!r}",
                            "service_unavailable", "no_capacity", {"Retry-After": "1"})

    @staticmethod
    def error(status: int, message: str, kind: str, code: str) -> web.Response:
        return openai_error(status, message, kind, code)

    def count(self, model: str, outcome: str) -> None:
        # Clients name the model: only models the fleet serves get a series of their own,
        # so a typo or a scan cannot grow the metrics without bound.
        label = model if model in self._table.pools else UNKNOWN_MODEL_LABEL
        self.metrics.requests_of(label, outcome).inc()

    def on_failure(self, failure: LegFailure) -> None:
        member = failure.member
        logger.warning("[router] leg failed role=%s id=%s kind=%s: %s", failure.role,
                       member.id, failure.kind, failure.reason)
        if not failure.quarantine:
            return
        if self.quarantine.add(member.id, member.incarnation, self._clock()):
            self.metrics.quarantines.labels(member.id).inc()
            if failure.kind in _NOT_REPORTED:
                return
            problem = f"{failure.role}: {failure.kind}"[:200]
            try:
                self.view.report(member.id, member.incarnation, problem)
            except Exception:  # a registry that is away must not break request handling
                logger.exception("[router] report to registry failed id=%s", member.id)


def _unauthorized() -> web.Response:
    return openai_error(401, "missing or wrong API key (Authorization: Bearer ...)",
                        "invalid_request_error", "invalid_api_key")
