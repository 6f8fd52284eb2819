"""`pdreg agent`: the sidecar that makes an external vLLM / SGLang server a member."""

from __future__ import annotations

import argparse
import logging

from engine_agent.probes import EngineKind
from engine_agent.sidecar import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_KILL_GRACE_S,
    Sidecar,
    SidecarConfig,
)
from pdreg.args import (
    TOKEN,
    add_client_curve_arguments,
    add_label_argument,
    add_registry_argument,
    add_secret_argument,
    client_curve_of,
    labels_of,
    secret_of,
)
from wire.protocol import parse_role

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "agent", help="sidecar: register an external engine, gate on /health, drain on SIGTERM",
        description="Register an external vLLM/SGLang engine with the registry. With "
                    "'-- COMMAND ...' the engine is launched as a child process in a session "
                    "of its own, and its whole process group ends with the sidecar, however "
                    "the sidecar ends (a lifeline process sees to it after a kill -9); "
                    "without it the sidecar attaches to an engine already running at "
                    "--engine-url.")
    parser.add_argument("--engine", choices=[kind.value for kind in EngineKind], required=True)
    parser.add_argument("--engine-url", required=True, help="e.g. http://127.0.0.1:8100")
    parser.add_argument("--role", required=True, help="prefill | decode | mixed")
    add_registry_argument(parser)
    parser.add_argument("--model", default="", help="default: what the engine reports")
    parser.add_argument("--protocol", default="",
                        help="P/D handshake (default vllm -> vllm-nixl, sglang -> sglang)")
    parser.add_argument("--advertise-host", default="",
                        help="host peers use to reach the engine (default: the URL's host)")
    parser.add_argument("--id", dest="member_id", default="",
                        help="member id (default ROLE-ADVERTISE_HOST-ENGINE_PORT)")
    parser.add_argument("--kv-host", default="")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--bootstrap-port", type=int, default=0)
    add_label_argument(parser)
    parser.add_argument("--capacity", type=int, default=0)
    add_secret_argument(parser, TOKEN, "the registry's fleet token")
    add_client_curve_arguments(parser)
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        metavar="S")
    parser.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL_S,
                        metavar="S")
    parser.add_argument("--kill-grace", type=float, default=DEFAULT_KILL_GRACE_S, metavar="S",
                        help="seconds between SIGTERM and SIGKILL for the child's process "
                             "group")
    parser.add_argument("command", nargs="*", metavar="-- COMMAND",
                        help="engine command line to launch as a child")
    parser.set_defaults(func=run)



def run(args: argparse.Namespace) -> int:
    try:
        config = SidecarConfig(
            engine=EngineKind(args.engine), engine_url=args.engine_url,
            role=parse_role(args.role), registries=args.registry, model=args.model,
            protocol=args.protocol, advertise_host=args.advertise_host,
            member_id=args.member_id, kv_host=args.kv_host, kv_port=args.kv_port,
            bootstrap_port=args.bootstrap_port, labels=labels_of(args),
            capacity=args.capacity, token=secret_of(args, TOKEN),
            curve=client_curve_of(args), drain_timeout_s=args.drain_timeout,
            health_interval_s=args.health_interval, kill_grace_s=args.kill_grace,
            command=tuple(args.command))
        sidecar = Sidecar(config)
    except ValueError as exc:
        logger.error("pdreg agent: %s", exc)
        return 2
    return sidecar.run()
