"""The OpenAI-compatible HTTP front: admission, then a `Proxy` per request.

Admission reads and decodes the body once, strips the fields the router owns, and
refuses what it cannot serve: 401 (API key), 400 (not JSON, nested too deep, no model;
`context_length_exceeded`, a prompt surely over its model's context, before the body is
even decoded: router/kv/limits.py, `--policy kv`),
404 `model_not_found` (no member serves or has served the model), 503 `no_capacity` (a
known model, no routable pair now), 508 (a request from a router: a loop). The HTTP
server (serving/http_server.py) answers before admission for what never arrives whole:
408, 413, 431. Then overload admission (router/admission/, on unless --no-admission)
admits the request while an eligible pair has budget, or queues it, or refuses it: 429
`slo_shed`, 503 `queue_deadline` / `queue_full`, each with Retry-After; 400/403 for a
class the request may not name. `Proxy` (router/proxy.py) does the rest: pairing,
retries, relaying and migration.

`Router` is built from one `RouterConfig` (router/config.py). It wires what requests
share and hands each `Proxy` only the narrow ports it uses (router/ports.py): `Pairing`
(view, table, policy, quarantine, in-flight counts), `Outcomes` (latency, quarantine,
reports) and one `RequestRecorder` (metrics). /ready carries the warnings of
`Readiness` (router/readiness.py). It lives on one event loop; nothing here is shared
across threads except `view`, whose `members()` is a reference swap and whose
`report()` only queues (it never blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import time
from collections.abc import Collection, Mapping
from typing import Any, Final

import msgspec

from registry.client import LiveMember
from router.admission.classes import ClassBook, default_book, load_classes
from router.admission.gate import Admission, Ticket
from router.admission.metrics import AdmissionMetrics
from router.admission.requests import cost_of, key_of, who_of
from router.choice import Affinity
from router.config import RouterConfig
from router.continuation import why_not_migratable
from router.errors import INVALID_REQUEST, openai_error, unauthorized
from router.guard import HOP_HEADER, UpstreamPolicy, strip_internal_fields
from router.handshakes.catalog import Handshakes, default_handshakes
from router.handshakes.exchange import UpstreamRejected
from router.http.upstream import UpstreamPool
from router.inflight import InFlight
from router.kv.routing import KvRouting
from router.latency import LatencyTracker
from router.metrics import RequestRecorder, RouterMetrics
from router.outcomes import Outcomes
from router.pairing import MembershipSource, Pairing
from router.policies import Pairer, make_pairer
from router.ports import ProxyPorts
from router.proxy import Call, Proxy
from router.quarantine import Quarantine
from router.readiness import Readiness
from router.unroutable import Unroutable
from router.warmup import Warmer
from serving.http_messages import Request, Response, StreamResponse
from serving.http_server import HttpApp

__all__ = ["MembershipSource", "Router"]

logger = logging.getLogger(__name__)

SESSION_HEADER: Final = b"x-session-id"  # the `session` policy keeps a session on one pair
# How often membership is followed with no request asking (readiness warnings, the `kv`
# policy's publishers): a change shows in the log within this long.
FOLLOW_S: Final = 1.0

_HOP: Final = HOP_HEADER.lower().encode()
_decode = msgspec.json.decode
_encode = msgspec.json.encode


class Router:
    def __init__(self, view: MembershipSource, config: RouterConfig, *,
                 handshakes: Handshakes | None = None) -> None:
        """`handshakes`: the ones to speak (default: every one, unseeded)."""
        self.view = view
        self.config = config
        self.metrics = RouterMetrics()
        self.handshakes: Handshakes = handshakes if handshakes is not None \
            else default_handshakes()
        self.upstream_policy = UpstreamPolicy.build(config.allow_upstream)
        self.quarantine = Quarantine(config.pairing.quarantine_s)
        self.in_flight = InFlight(self.metrics.in_flight_of)
        latency = LatencyTracker(decay_s=config.pairing.latency_decay_s)
        # KV-aware pairing (`--policy kv`): its index, feed and tokenizers, fed with every
        # membership change the table sees, and told each request's first pair.
        self.kv: KvRouting | None = None
        if config.policy == "kv":
            self.kv = KvRouting(self.metrics, config.kv, allows=self.upstream_policy.allows,
                                stale_after_s=config.pairing.stale_load_s, latency=latency)
            pairer: Pairer = self.kv.pairer
        else:
            pairer = make_pairer(config.policy, stale_after_s=config.pairing.stale_load_s,
                                 latency=latency)
        # Overload admission (router/admission/): None when --no-admission.
        self.admission = self._admission_of(latency)
        self.unroutable = Unroutable(self.upstream_policy, config.allow_upstream)
        self.readiness = Readiness()
        self.readiness.add(self.unroutable.warnings)
        if self.kv is not None:
            self.readiness.add(self.kv.warnings)
        self.pairing = Pairing(view, pairer, locality_label=config.pairing.locality_label,
                               protocols=self.handshakes, quarantine=self.quarantine,
                               in_flight=self.in_flight, picks_of=self.metrics.picks_of,
                               latency=latency, clock=time.monotonic,
                               on_members=self._on_members,
                               on_first_pair=self.kv.picked if self.kv else None,
                               budgets=self.admission.shares if self.admission else None)
        # Only latency-aware policies read the samples; the others skip taking them.
        self.outcomes = Outcomes(view, self.quarantine, pairer.latency,
                                 self.metrics.quarantines_of, time.monotonic,
                                 on_cached=self.kv.observed if self.kv else None)
        self.record = RequestRecorder(self.metrics, self.pairing.serves)
        self.draining = False
        self._api_key = f"Bearer {config.api_key}".encode() if config.api_key else b""
        self._request_ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self._pool: UpstreamPool | None = None
        self._ports: ProxyPorts | None = None
        self._warmer: Warmer | None = None
        self._follower: asyncio.Task[None] | None = None

    def _admission_of(self, latency: LatencyTracker) -> Admission | None:
        options = self.config.admission
        if not options.enabled:
            return None
        book: ClassBook = load_classes(options.classes_file) if options.classes_file \
            else default_book(options.ttft_slo_ms)
        return Admission(options, book, lambda model: self.pairing.candidates(model),
                         latency, AdmissionMetrics(self.metrics.registry), time.monotonic)

    # --- wiring -------------------------------------------------------------------------

    def build_app(self, *, serve_metrics: bool = True) -> HttpApp:
        """The API app. `serve_metrics=False` leaves /metrics out: it is then served on a
        port of its own (build_metrics_app), which a NetworkPolicy opens to Prometheus
        only: the metrics name members and engine URLs."""
        app = HttpApp(limits=self.config.clients, count=self._count_refusal)
        app.add("POST", "/v1/completions", self.handle_generate)
        app.add("POST", "/v1/chat/completions", self.handle_generate)
        app.add("GET", "/v1/models", self.handle_models)
        app.add("GET", "/health", self.handle_health)
        app.add("GET", "/ready", self.handle_ready)
        if serve_metrics:
            app.add("GET", "/metrics", self.handle_metrics)
        app.add("GET", "/v1/kv", self.handle_kv)
        app.add("GET", "/v1/admission", self.handle_admission)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def build_metrics_app(self) -> HttpApp:
        """/metrics alone, for a separate metrics port."""
        app = HttpApp(limits=self.config.clients, count=self._count_refusal)
        app.add("GET", "/metrics", self.handle_metrics)
        return app

    def _count_refusal(self, reason: str) -> None:
        self.metrics.refused_of(reason).inc()

    async def _start(self) -> None:
        """On the serving loop, before the first connection: the upstream pool and the
        ports each `Proxy` gets, the warmer, the rehearsal, and following membership."""
        config = self.config
        pool = self._pool = UpstreamPool(timeouts=config.upstream, policy=self.upstream_policy)
        self._ports = ProxyPorts(
            pairing=self.pairing, outcomes=self.outcomes, record=self.record,
            handshakes=self.handshakes, pool=pool,
            max_attempts=max(1, config.retries.max_attempts),
            max_migrations=max(0, config.retries.max_migrations), clock=time.monotonic)
        if config.warm_connections > 0:
            self._warmer = Warmer(self.pairing, pool, connections=config.warm_connections)
            self._warmer.start()
        self._rehearse()
        self._follower = asyncio.get_running_loop().create_task(self._follow())

    def _on_members(self, members: Mapping[str, LiveMember],
                    moved: Collection[str] | None) -> None:
        """Membership changed (not only loads): what follows it besides the table;
        `moved`, the ids that joined, left or have a new record (None: all)."""
        if self.kv is not None:
            self.kv.on_members(members, moved)
        if self.admission is not None:
            self.admission.on_members(members, moved)
        self.unroutable.on_members(members, moved)
        self.metrics.unroutable.labels().set(len(self.unroutable.members))

    async def _follow(self) -> None:
        """Follow membership with no request asking, so a readiness warning is logged
        when it appears, not at the next request or probe."""
        while True:
            try:
                self.pairing.follow()
                self.readiness.warnings()
                if self.admission is not None:  # engines may have come back: admit
                    self.admission.pump()
            except Exception:  # a bad view must not end the following for good
                logger.exception("[router] following membership failed")
            await asyncio.sleep(FOLLOW_S)

    def _rehearse(self) -> None:
        """Run the first request's own code paths (admission's parsing and stripping,
        the policy, the table, the metrics page) before the router says it is ready, so
        the first client does not pay for them. Nothing is counted."""
        body = _decode(_encode({"model": "", "prompt": "", "stream": True,
                                "vllm_xargs": {"kv_transfer_params": None}}))
        strip_internal_fields(body)
        why_not_migratable("/v1/completions", body)
        self.pairing.pairer.affinity("", body)
        self.pairing.choose("", self.pairing.pairer.affinity("", body), ())
        self.pairing.models()
        self.metrics.render()

    async def _stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        if self._warmer is not None:
            await self._warmer.stop()
        if self._pool is not None:
            await self._pool.close()
        if self.kv is not None:
            self.kv.close()

    def upstream(self) -> UpstreamPool:
        assert self._pool is not None, "the app has not started"
        return self._pool

    # --- small handlers -----------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        """--api-key, or a key of the `--classes` file; anyone when neither is set."""
        keys = self.admission is not None and bool(self.admission.book.keys)
        if not self._api_key and not keys:
            return True
        if self._api_key and hmac.compare_digest(
                request.headers.get(b"authorization", b""), self._api_key):
            return True
        return keys and self.admission is not None \
            and key_of(self.admission.book, request) is not None

    async def handle_models(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._refuse("unauthorized", unauthorized())
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdreg"}
                for m in sorted(self.pairing.models())]
        return Response(200, _encode({"object": "list", "data": data}))

    async def handle_health(self, request: Request) -> Response:
        """Liveness: the process and its event loop answer."""
        return Response(200, b'{"status":"ok"}')

    async def handle_ready(self, request: Request) -> Response:
        """Readiness: 503 while draining or before the view has ever synced. A registry
        that goes away later does not make the router unready: it serves from its last
        view, which is the point of keeping one. The answer lists the warnings that hold
        (router/readiness.py), with their detail for an authorized client; they never
        make it unready."""
        self.pairing.follow()  # follow membership first
        full = self._authorized(request)
        warnings = [w.full() if full else w.text for w in self.readiness.warnings()]
        if self.draining:
            status, code = "draining", 503
        elif not self.view.synced:
            status, code = "no membership yet", 503
        else:
            status, code = "ready", 200
        return Response(code, _encode({"status": status, "warnings": warnings}))

    async def handle_kv(self, request: Request) -> Response:
        """Per member: KV index state, blocks indexed, event lag (`--policy kv`)."""
        if not self._authorized(request):
            return self._refuse("unauthorized", unauthorized())
        self.pairing.follow()  # follow membership first
        kv = self.kv.report(time.time()) if self.kv is not None else {"members": []}
        return Response(200, _encode({"policy": self.config.policy, **kv}))

    async def handle_admission(self, request: Request) -> Response:
        """Admission's state: classes, queues, answers, budgets per member."""
        if not self._authorized(request):
            return self._refuse("unauthorized", unauthorized())
        if self.admission is None:
            return Response(200, _encode({"enabled": False}))
        return Response(200, _encode({"enabled": True, **self.admission.report()}))

    async def _affinity(self, request: Request, body: dict[str, Any],
                        model: str) -> Affinity:
        """The request's input to pairing: the `kv` policy's exact prompt blocks
        (tokenized off the loop when long), else what the policy computes."""
        if self.kv is not None:
            self.pairing.follow()  # the model's tokenizer and block sizes follow membership
            return await self.kv.affinity(body, model, request.client)
        return self.pairing.pairer.affinity(request.header(SESSION_HEADER), body)

    async def handle_metrics(self, request: Request) -> Response:
        return Response(200, self.metrics.render(),
                        content_type="text/plain; version=0.0.4")

    # --- the request path ---------------------------------------------------------------

    async def handle_generate(self, request: Request) -> Response | StreamResponse:
        admitted = await self._admit(request)
        if isinstance(admitted, Response):
            return admitted
        assert self._ports is not None, "the app has not started"
        ticket = await self._ticket(request, admitted)
        if isinstance(ticket, Response):
            return ticket
        admitted.ticket = ticket
        proxy = Proxy(admitted, self._ports)
        try:
            response = await (proxy.stream(request) if admitted.stream else proxy.whole())
        except UpstreamRejected as rejected:
            self.record.outcome(admitted.model, "client_error")
            return Response(rejected.status, rejected.body,
                            content_type=rejected.content_type)
        except BaseException:  # the client left (cancel, reset) while we waited upstream
            self.record.outcome(admitted.model, "cancelled")
            raise
        finally:
            if ticket is not None:  # held on no pair: what it reserved goes back
                ticket.settle()
        if self.draining:
            # Answer, then close the connection: a keep-alive client reconnects through
            # its load balancer, to a router that is not draining.
            response.force_close()
        return response

    async def _admit(self, request: Request) -> Call | Response:
        """The request as a `Call`, or the answer refusing it. The server has read the
        body (within the body deadline, under the size cap) before this runs."""
        started = time.monotonic()
        if not self._authorized(request):
            return self._refuse("unauthorized", unauthorized())
        if _HOP in request.headers:
            # Sent by a router: some member's URL leads back to a router. Refuse, so the
            # request cannot circle; the sender quarantines that member.
            return self._refuse("loop", openai_error(
                508, "request loop: this router was reached through a router",
                INVALID_REQUEST, "loop_detected"))
        if self.kv is not None:  # surely over the context: refused before any decoding
            self.pairing.follow()  # the models' limits follow membership, not loads
            too_long = self.kv.limits.refusal(request.body,
                                              chat=request.path == "/v1/chat/completions")
            if too_long is not None:
                return self._refuse("context_length", too_long)
        try:
            body = _decode(request.body)
        except msgspec.DecodeError as exc:
            return self._refuse("not_json", openai_error(
                400, f"request body is not JSON: {exc}", INVALID_REQUEST))
        except RecursionError:  # msgspec's answer to [[[[... a thousand levels deep
            return self._refuse("too_deep", openai_error(
                400, "request body is nested too deeply", INVALID_REQUEST))
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            return self._refuse("no_model", openai_error(400, "'model' is required",
                                                         INVALID_REQUEST))
        stripped = strip_internal_fields(body)
        if stripped:
            logger.debug("[router] stripped client fields %s", stripped)
        stream = body.get("stream") is True
        stream_options = body.get("stream_options")
        return Call(
            path=request.path, body=body, model=model, stream=stream,
            affinity=await self._affinity(request, body, model),
            request_id=f"pdreg-{self._id_prefix}-{next(self._request_ids)}",
            started=started, wants_ids=body.get("return_token_ids") is True,
            include_usage=isinstance(stream_options, dict)
            and stream_options.get("include_usage") is True,
            migratable=why_not_migratable(request.path, body) if stream else "not streamed")

    async def _ticket(self, request: Request, call: Call) -> Ticket | Response | None:
        """Admission's ticket for the call, or its refusal (router/admission/gate.py).
        None when admission is off, or the model has no pool (pairing answers 404/503)."""
        admission = self.admission
        if admission is None or not self.pairing.serves(call.model):
            return None
        who = who_of(admission.book, request, key_of(admission.book, request))
        if isinstance(who, Response):
            return self._refuse("bad_class", who)
        return await admission.admit(call.model, who,
                                     cost_of(request, call.body, call.affinity),
                                     len(request.body))

    def _refuse(self, reason: str, response: Response) -> Response:
        self.metrics.refused_of(reason).inc()
        return response
