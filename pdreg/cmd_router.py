"""`pdreg router`: the OpenAI-compatible P/D router, fed by the registry, until SIGTERM.

On SIGTERM (or SIGINT) it drains: the registry shows it `draining` and /ready answers
503 at once, it keeps serving for --drain-delay so load balancers take it out, then it
stops accepting and gives in-flight requests (streams included) up to --drain-timeout,
then it says bye and exits. A second signal skips the rest of the delay.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

import msgspec

from engine_agent.agent import Agent, api_server_spec
from pdreg.args import (
    API_KEY,
    TOKEN,
    add_client_curve_arguments,
    add_registry_argument,
    add_secret_argument,
    client_curve_of,
    insecure_refusal,
    secret_of,
)
from registry.client import MembershipView, parse_models
from router.admission.classes import DEFAULT_TTFT_SLO_MS, load_classes
from router.admission.options import (
    BUDGET_SLO_SHARE,
    DECODE_BUDGET_TOKENS,
    MAX_QUEUE_BYTES,
    MAX_QUEUE_REQUESTS,
    PREFILL_BUDGET_TOKENS,
    STARVATION_S,
)
from router.config import (
    DRAIN_DELAY_S,
    MAX_ATTEMPTS,
    MAX_MIGRATIONS,
    AdmissionOptions,
    KvOptions,
    Limits,
    PairingOptions,
    Retries,
    RouterConfig,
    Timeouts,
)
from router.guard import LOOPBACK_ALLOW, UpstreamPolicy, parse_networks
from router.http.bounds import (
    CONNECT_TIMEOUT_S,
    FIRST_BYTE_TIMEOUT_S,
    IDLE_READ_TIMEOUT_S,
)
from router.kv.index import DEFAULT_MAX_PENDING_BYTES
from router.kv.long_prompts import MAX_IN_FLIGHT, PER_CLIENT
from router.kv.policy import DEFAULT_DISAGG_MIN_UNCACHED_TOKENS
from router.kv.reporter import KvReporter
from router.kv.routing import DEFAULT_MAX_PROMPT_TOKENS, MAX_BLOCK_SIZES
from router.kv.tokenizer import parse_tokenizer_flags
from router.latency import DECAY_S
from router.policies import DEFAULT_POLICY, DEFAULT_STALE_LOAD_S, POLICY_NAMES
from router.quarantine import QUARANTINE_S
from router.service import RouterServer, settle_heap
from router.warmup import WARM_CONNECTIONS
from serving.http_limits import BODY_TIMEOUT_S, DRAIN_TIMEOUT_S, HEADER_TIMEOUT_S
from wire.protocol import ROUTER_PROTOCOL, MemberSpec, MemberState
from wire.validation import url_host

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("router", help="run the OpenAI-compatible P/D router")
    add_registry_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 = OS picks)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve /metrics on this port only, not on --port (the metrics name "
                        "members and engine URLs: open this port to Prometheus alone)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICY_NAMES,
                   help="pairing policy per role (kv, the default: the prefill that "
                        "computes least, from the engines' own KV events; for a model whose "
                        "engines publish none, or a prompt it cannot tokenize, and for "
                        "decodes, as peak_ewma. peak_ewma: power of two over load x the "
                        "member's observed latency; prefix: prefix affinity for prefills, "
                        "power_of_two for decodes; session: the X-Session-Id header, else "
                        "the request's `user`, keeps a conversation on one pair)")
    _add_kv_arguments(p)
    add_secret_argument(p, API_KEY, "require Authorization: Bearer KEY from clients")
    p.add_argument("--models", default="", type=_models, metavar="NAME[,NAME]",
                   help="serve only these models: the view subscribes to their events "
                        "alone (default: every model the registry has)")
    p.add_argument("--locality-label", default="", metavar="KEY",
                   help="prefer P->D pairs with the same value of this member label (e.g. zone)")
    p.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS,
                   help="pairs tried per request before answering 502")
    p.add_argument("--max-migrations", type=int, default=MAX_MIGRATIONS, metavar="N",
                   help="times one stream may continue on a new pair after its decode "
                        "fails mid-answer (0: end it with an SSE error event instead)")
    p.add_argument("--allow-upstream", default="", type=_networks, metavar="CIDR[,CIDR]",
                   help="the only networks the router sends traffic to, HTTP and the KV "
                        "addresses it hands to engines (checked on the resolved address of "
                        "every engine connection). Default: public addresses only; "
                        "loopback, private (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7)"
                        ", link-local and cloud metadata are denied unless named here: a "
                        "cluster passes its pod network (e.g. 10.0.0.0/8), engines on this "
                        f"host {LOOPBACK_ALLOW}. Of the entries that hold an address, the "
                        "most specific decides")
    _add_timeout_arguments(p)
    p.add_argument("--warm-connections", type=int, default=WARM_CONNECTIONS, metavar="N",
                   help="connections opened to each engine when it becomes routable, so "
                        "its first requests do not wait for a connect (0: none)")
    p.add_argument("--drain-delay", type=float, default=DRAIN_DELAY_S, metavar="S",
                   help="after SIGTERM, keep serving this long while /ready fails")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="then, how long in-flight requests may take to finish")
    p.add_argument("--quarantine", type=float, default=QUARANTINE_S, metavar="S",
                   help="how long a member that failed a request is skipped")
    p.add_argument("--stale-load", type=float, default=DEFAULT_STALE_LOAD_S, metavar="S",
                   help="a load report older than this counts as saturated")
    p.add_argument("--latency-decay", type=float, default=DECAY_S, metavar="S",
                   help="peak_ewma and kv: how fast a member's latency estimate forgets (the old "
                        "estimate's weight after t seconds is exp(-t/S))")
    _add_admission_arguments(p)
    _add_registration_arguments(p)
    p.set_defaults(func=run)


def _add_timeout_arguments(p: argparse.ArgumentParser) -> None:
    """How long engines and clients may take."""
    p.add_argument("--stream-idle-timeout", type=float, default=IDLE_READ_TIMEOUT_S,
                   metavar="S", help="an engine answer with no data for this long has "
                                     "failed (a stream then migrates)")
    p.add_argument("--upstream-connect-timeout", type=float, default=CONNECT_TIMEOUT_S,
                   metavar="S", help="connecting to an engine")
    p.add_argument("--upstream-first-byte-timeout", type=float, default=FIRST_BYTE_TIMEOUT_S,
                   metavar="S", help="request sent to status line; a non-streaming answer "
                                     "comes whole, so this bounds a non-streaming generation")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                   help="a client connection must send a request's headers within this "
                        "long (of connecting, or of its previous answer)")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help="and its body within this long (else 408)")


def _add_registration_arguments(p: argparse.ArgumentParser) -> None:
    """How the router joins the fleet (it is a member, role api_server)."""
    p.add_argument("--advertise-host", default="",
                   help="host to register as the router's address (default --host)")
    add_secret_argument(p, TOKEN, "the registry's fleet token (the router registers)")
    add_client_curve_arguments(p)
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback with no API key, token or CURVE")
    p.add_argument("--no-register", action="store_true",
                   help="do not register the router itself as an api_server member")


def _add_admission_arguments(p: argparse.ArgumentParser) -> None:
    """Overload admission (router/admission/; docs/operations.md "Overload")."""
    p.add_argument("--no-admission", action="store_true",
                   help="forward every request at once, with no budgets and no queue")
    p.add_argument("--classes", default="", type=_classes_file, metavar="FILE",
                   help="traffic classes and API keys (TOML): priority, TTFT SLO, sheddable, "
                        "weight per class; tenant and class per key. Default: one class")
    p.add_argument("--ttft-slo-ms", type=_positive, default=DEFAULT_TTFT_SLO_MS, metavar="MS",
                   help="without --classes: the one class's TTFT SLO; a request that cannot "
                        "start within it gets 503 with Retry-After")
    p.add_argument("--prefill-budget-tokens", type=int, default=PREFILL_BUDGET_TOKENS,
                   metavar="N", help="uncached prompt tokens a prefill may have in flight "
                                     "(split among the routers registered; 0: no limit)")
    p.add_argument("--budget-slo-share", type=float, default=BUDGET_SLO_SHARE, metavar="F",
                   help="each prefill's budget follows its legs: lowered when a leg takes "
                        "longer than this share of the top class's TTFT SLO, raised while "
                        "they take less, never above --prefill-budget-tokens (0: the "
                        "flag's budget alone)")
    p.add_argument("--decode-budget-tokens", type=int, default=DECODE_BUDGET_TOKENS,
                   metavar="N",
                   help="KV tokens (prompt + answer) a decode may hold (split among the "
                        "routers; 0: bounded by its capacity and reported KV use only)")
    p.add_argument("--max-queue-requests", type=int, default=MAX_QUEUE_REQUESTS, metavar="N",
                   help="requests waiting for budget, per model (then 503)")
    p.add_argument("--max-queue-bytes", type=int, default=MAX_QUEUE_BYTES, metavar="N",
                   help="bytes of request bodies waiting for budget, per model (then 503)")
    p.add_argument("--starvation-guard", type=_positive, default=STARVATION_S, metavar="S",
                   help="a class whose oldest request has waited this long goes before "
                        "higher priorities")


def _classes_file(path: str) -> str:
    if not path:
        return path  # argparse passes the default through the type too
    try:
        load_classes(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"a positive number is required, not {text!r}")
    return value


def _models(text: str) -> tuple[str, ...]:
    try:
        return parse_models(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _networks(text: str) -> str:
    try:
        parse_networks(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def run(args: argparse.Namespace) -> int:
    api_key, token, curve = secret_of(args, API_KEY), secret_of(args, TOKEN), client_curve_of(args)
    refusal = insecure_refusal("router", args.host, secured=bool(api_key or token or curve),
                               insecure=args.insecure)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    stop = threading.Event()
    hurry = threading.Event()  # a second signal: skip the rest of the drain delay

    def on_signal(*_: object) -> None:
        (hurry if stop.is_set() else stop).set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    # Loads on demand: a router of every model applies the loads of the models it gets
    # requests for (registry/client.py), not the whole fleet's.
    view = MembershipView(args.registry, models=args.models, curve=curve, token=token,
                          loads_on_demand=True).start()
    server: RouterServer | None = None
    agent: Agent | None = None
    try:
        config = config_of(args, api_key)
        server = RouterServer(config, view).start()
        logger.info("[router] upstream %s", UpstreamPolicy.build(args.allow_upstream)
                    .describe())
        spec = _router_spec(args.advertise_host or args.host, server)
        member_id = spec.id
        if not args.no_register:
            agent = Agent(spec, registries=args.registry, token=token,
                          state=MemberState.READY, curve=curve).start()
            # Failure reports need a member session: they go out through this agent.
            view.reporter = agent.report
            # Its KV index per member, to the registries' dashboard (router/kv/reporter.py).
            KvReporter.start_for(server.router.kv, agent)
        settle_heap()  # start-up's objects out of the collector's way (router/service.py)
        print(json.dumps({"event": "ready", "url": server.url, "id": member_id}), flush=True)
        stop.wait()
        logger.info("[shutdown] router: draining for %.1fs, then up to %.1fs for in-flight "
                    "requests", config.drain_delay_s, config.clients.drain_timeout_s)
        server.drain()
        if agent is not None:
            agent.set_state(MemberState.DRAINING)
        hurry.wait(config.drain_delay_s)
    finally:
        if agent is not None:
            agent.stop()  # bye first: no one should send us work while we close
        if server is not None:
            server.close()
        view.close()
    return 0


def config_of(args: argparse.Namespace, api_key: str) -> RouterConfig:
    """The router's config, straight from its flags (each group as router/config.py
    lays it out)."""
    return RouterConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port, policy=args.policy,
        api_key=api_key, allow_upstream=args.allow_upstream,
        warm_connections=args.warm_connections, drain_delay_s=args.drain_delay,
        clients=Limits(header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout,
                       drain_timeout_s=args.drain_timeout),
        upstream=Timeouts(connect_s=args.upstream_connect_timeout,
                          first_byte_s=args.upstream_first_byte_timeout,
                          idle_read_s=args.stream_idle_timeout),
        retries=Retries(max_attempts=args.max_attempts, max_migrations=args.max_migrations),
        pairing=PairingOptions(locality_label=args.locality_label,
                               stale_load_s=args.stale_load, quarantine_s=args.quarantine,
                               latency_decay_s=args.latency_decay),
        kv=KvOptions(tokenizers=tuple(args.tokenizer),
                     disagg_min_uncached_tokens=args.disagg_min_uncached_tokens,
                     gap_bytes=args.kv_gap_bytes, max_block_sizes=args.kv_max_block_sizes,
                     max_prompt_tokens=args.kv_max_prompt_tokens,
                     long_prompt_threads=args.kv_long_prompt_threads,
                     long_prompts_per_client=args.kv_long_prompts_per_client),
        admission=AdmissionOptions(
            enabled=not args.no_admission, classes_file=args.classes,
            ttft_slo_ms=args.ttft_slo_ms,
            prefill_budget_tokens=max(0, args.prefill_budget_tokens),
            budget_slo_share=max(0.0, args.budget_slo_share),
            decode_budget_tokens=max(0, args.decode_budget_tokens),
            max_queue_requests=max(0, args.max_queue_requests),
            max_queue_bytes=max(0, args.max_queue_bytes),
            starvation_s=args.starvation_guard))


def _router_spec(host: str, server: RouterServer) -> MemberSpec:
    """The router's registration. With --metrics-port, /metrics is on that port only:
    the spec says where, so the planner scrapes what the router serves."""
    spec = api_server_spec(host, server.port, ROUTER_PROTOCOL)
    if not server.metrics_port:
        return spec
    url = f"http://{url_host(host)}:{server.metrics_port}/metrics"
    return msgspec.structs.replace(
        spec, endpoints=msgspec.structs.replace(spec.endpoints, metrics=url))


def _tokenizer_flag(value: str) -> tuple[str, str]:
    try:
        ((model, source),) = parse_tokenizer_flags([value]).items()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return model, source


def _at_least_one(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """The `kv` policy's flags."""
    p.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=PATH",
                   type=_tokenizer_flag,
                   help="kv policy: the tokenizer (a directory with tokenizer.json, or a hub "
                        "name in the local cache) for MODEL; repeatable. Default: what the "
                        "model's members register")
    p.add_argument("--disagg-min-uncached-tokens", type=int, metavar="N",
                   default=DEFAULT_DISAGG_MIN_UNCACHED_TOKENS,
                   help="kv policy: a prompt the chosen decode holds part of and would "
                        "compute fewer than N tokens of skips the prefill leg; 0 = off")
    p.add_argument("--kv-max-prompt-tokens", type=_at_least_one, default=DEFAULT_MAX_PROMPT_TOKENS,
                   metavar="N",
                   help="kv policy: prompts over N tokens (or over 8 characters per token "
                        "of N, or chats of over 4,096 messages) are not tokenized, and are "
                        "paired as peak_ewma: set it to the model's context length")
    p.add_argument("--kv-long-prompt-threads", type=_at_least_one, default=MAX_IN_FLIGHT,
                   metavar="N", help="kv policy: prompts over 8,192 characters are tokenized "
                   "on N threads of their own; one that finds them busy is paired as peak_ewma")
    p.add_argument("--kv-long-prompts-per-client", type=_at_least_one,
                   default=PER_CLIENT, metavar="N",
                   help="kv policy: of those, at most N at once per client address (behind a "
                        "proxy, every client shares the proxy's)")
    p.add_argument("--kv-gap-bytes", type=_at_least_one, default=DEFAULT_MAX_PENDING_BYTES,
                   metavar="BYTES",
                   help="kv policy: KV event batches held behind a sequence gap, per member, "
                        "while its replay is awaited; past this the member's index is "
                        "declared unknown at once (default: %(default)s)")
    p.add_argument("--kv-max-block-sizes", type=_at_least_one, default=MAX_BLOCK_SIZES,
                   metavar="N",
                   help="kv policy: distinct KV block sizes per model a prompt is keyed "
                        "for (those of the most ready members; default: %(default)s)")

