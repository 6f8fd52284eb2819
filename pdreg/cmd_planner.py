"""`pdreg planner`: decide how many prefills and decodes each model needs, until SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import signal
import sys
import threading

from engine_agent.agent import Agent, api_server_spec
from pdreg.args import (
    TOKEN,
    add_client_curve_arguments,
    add_registry_argument,
    add_secret_argument,
    client_curve_of,
    secret_of,
)
from planner.freshness import STALE_AFTER_S
from planner.inputs import PLANNER_PROTOCOL
from planner.rule import Bounds, RuleConfig
from planner.service import PlannerServer
from planner.tick import PlannerConfig
from registry.client import MembershipView, parse_models
from wire.protocol import MemberState

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8090


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "planner", help="compute how many prefills and decodes each model needs",
        description="Watches membership and the routers' /metrics; per model, decides the "
                    "number of prefills (queueing, TTFT) and decodes (KV use, running "
                    "requests, ITL) HPA-style. Publishes pdreg_planner_desired_replicas "
                    "on /metrics, the plan on /v1/plan, and calls --exec on a change.")
    add_registry_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (0 = OS picks)")
    p.add_argument("--advertise-host", default="",
                   help="host to register as the planner's address (default --host)")
    add_secret_argument(p, TOKEN, "the registry's fleet token (the planner registers)")
    add_client_curve_arguments(p)
    p.add_argument("--no-register", action="store_true",
                   help="do not register as an api_server member (pdreg plan then needs "
                        "--planner URL)")
    p.add_argument("--model", dest="models", action="append", default=[], metavar="NAME",
                   help="plan only this model (repeatable; default every model)")
    p.add_argument("--models", dest="model_list", default=(), type=_models,
                   metavar="NAME[,NAME]", help="plan only these models, and subscribe to "
                   "their events alone (with --model: both sets)")
    p.add_argument("--interval", type=_positive, default=2.0, metavar="S",
                   help="seconds between planning rounds")
    _add_target_arguments(p)
    h = p.add_argument_group("stability (Kubernetes HPA semantics)")
    h.add_argument("--tolerance", type=float, default=0.1,
                   help="no change while every signal is within this fraction of target")
    h.add_argument("--scale-up-window", type=float, default=0.0, metavar="S",
                   help="scale up only to the lowest recommendation of this window")
    h.add_argument("--scale-down-window", type=float, default=300.0, metavar="S",
                   help="scale down only to the highest recommendation of this window")
    h.add_argument("--slo-memory", type=float, default=600.0, metavar="S",
                   help="a count that missed an SLO is not chosen again at that request "
                        "rate for this long")
    b = p.add_argument_group("bounds")
    for role in ("prefill", "decode"):
        b.add_argument(f"--min-{role}", type=int, default=1, metavar="N",
                       help=f"fewest {role} replicas per model")
        b.add_argument(f"--max-{role}", type=int, default=16, metavar="N",
                       help=f"most {role} replicas per model")
    e = p.add_argument_group("hook")
    e.add_argument("--exec", dest="exec_command", default="", metavar="CMD",
                   help="run `CMD MODEL ROLE N` (no shell) when a decision changes; "
                        "CMD is split like a shell would")
    e.add_argument("--exec-timeout", type=_positive, default=60.0, metavar="S",
                   help="kill the hook after this long")
    _add_router_arguments(p)
    p.set_defaults(func=run)


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("targets")
    g.add_argument("--ttft-slo", type=_positive, default=1.0, metavar="S",
                   help="time-to-first-token objective (prefills scale on it)")
    g.add_argument("--itl-slo", type=_positive, default=0.05, metavar="S",
                   help="inter-token latency objective (decodes scale on it)")
    g.add_argument("--latency-quantile", type=_fraction, default=0.9, metavar="Q",
                   help="which quantile of the routers' latency meets the objectives")
    g.add_argument("--load-window", type=float, default=10.0, metavar="S",
                   help="running, waiting and KV use are averaged over this (0: latest)")
    g.add_argument("--latency-window", type=_positive, default=30.0, metavar="S",
                   help="how far back latency quantiles and request rates look")
    g.add_argument("--target-utilization", type=_positive, default=0.7, metavar="U",
                   help="(running + waiting) / declared capacity to aim for, per role")
    g.add_argument("--target-kv", type=_fraction, default=0.7, metavar="U",
                   help="decodes' mean KV cache use to aim for")
    g.add_argument("--target-queue", type=_positive, default=2.0, metavar="N",
                   help="waiting requests per replica to scale up at, where no member "
                        "declares a capacity")
    g.add_argument("--target-queue-wait", type=_positive, default=0.25, metavar="S",
                   help="the routers' admission queue wait (the --latency-quantile) to "
                        "scale prefills up at, before engine queues grow")
    g.add_argument("--default-capacity", type=int, default=0, metavar="N",
                   help="capacity of members that declare none (0: their role's mean)")


def _add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scrape-timeout", type=_positive, default=2.0, metavar="S",
                   help="per-router /metrics timeout")
    p.add_argument("--router-stale-after", type=float, default=STALE_AFTER_S, metavar="S",
                   help="a router that cannot be read keeps its last figures this long, "
                        "then is left out (the others decide); with none readable, "
                        "nothing scales down")


def config_from(args: argparse.Namespace) -> PlannerConfig:
    rule = RuleConfig(
        ttft_slo_s=args.ttft_slo, itl_slo_s=args.itl_slo,
        target_utilization=args.target_utilization, target_kv_usage=args.target_kv,
        target_queue=args.target_queue, target_queue_wait_s=args.target_queue_wait,
        tolerance=args.tolerance,
        scale_up_window_s=args.scale_up_window, scale_down_window_s=args.scale_down_window,
        latency_window_s=args.latency_window, slo_memory_s=args.slo_memory,
        prefill=Bounds(args.min_prefill, args.max_prefill),
        decode=Bounds(args.min_decode, args.max_decode))
    return PlannerConfig(
        rule=rule, interval_s=args.interval, load_window_s=args.load_window,
        latency_quantile=args.latency_quantile,
        default_capacity=args.default_capacity, scrape_timeout_s=args.scrape_timeout,
        router_stale_after_s=args.router_stale_after,
        models=frozenset(_planned_models(args)), exec_argv=tuple(shlex.split(args.exec_command)),
        exec_timeout_s=args.exec_timeout)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"pdreg planner: {exc}", file=sys.stderr)
        return 2
    token, curve = secret_of(args, TOKEN), client_curve_of(args)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    view = MembershipView(args.registry, models=_planned_models(args), curve=curve,
                          token=token).start()
    server: PlannerServer | None = None
    agent: Agent | None = None
    try:
        server = PlannerServer(config, view, host=args.host, port=args.port).start()
        spec = api_server_spec(args.advertise_host or args.host, server.port, PLANNER_PROTOCOL)
        member_id = spec.id
        if not args.no_register:
            agent = Agent(spec, registries=args.registry, token=token,
                          state=MemberState.READY, curve=curve).start()
        print(json.dumps({"event": "ready", "url": server.url, "id": member_id}), flush=True)
        stop.wait()
    finally:
        if agent is not None:
            agent.stop()
        if server is not None:
            server.close()
        view.close()
    return 0


def _planned_models(args: argparse.Namespace) -> tuple[str, ...]:
    """--model and --models together; empty: every model."""
    return tuple(dict.fromkeys((*args.models, *args.model_list)))


def _models(text: str) -> tuple[str, ...]:
    try:
        return parse_models(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 1")
    return value
