"""`pdreg router`: the OpenAI-compatible P/D router, fed by the registry, until SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from engine_agent.agent import Agent, default_member_id, new_incarnation
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
from registry.client import MembershipView
from registry.protocol import Endpoints, MemberSpec, MemberState, Role
from router.app import MAX_ATTEMPTS
from router.policies import DEFAULT_POLICY, DEFAULT_STALE_LOAD_S, POLICY_NAMES
from router.quarantine import QUARANTINE_S
from router.service import RouterConfig, RouterServer

logger = logging.getLogger(__name__)

ROUTER_PROTOCOL = "openai"  # what an api_server member speaks to its clients


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("router", help="run the OpenAI-compatible P/D router")
    add_registry_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 = OS picks)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICY_NAMES,
                   help="pairing policy per role (prefix: prefix affinity for prefills, "
                        "power_of_two for decodes; session: the X-Session-Id header, else "
                        "the request's `user`, keeps a conversation on one pair)")
    add_secret_argument(p, API_KEY, "require Authorization: Bearer KEY from clients")
    p.add_argument("--locality-label", default="", metavar="KEY",
                   help="prefer P->D pairs with the same value of this member label (e.g. zone)")
    p.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS,
                   help="pairs tried per request before answering 502")
    p.add_argument("--quarantine", type=float, default=QUARANTINE_S, metavar="S",
                   help="how long a member that failed a request is skipped")
    p.add_argument("--stale-load", type=float, default=DEFAULT_STALE_LOAD_S, metavar="S",
                   help="a load report older than this counts as saturated")
    p.add_argument("--advertise-host", default="",
                   help="host to register as the router's address (default --host)")
    add_secret_argument(p, TOKEN, "the registry's fleet token (the router registers)")
    add_client_curve_arguments(p)
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback with no API key, token or CURVE")
    p.add_argument("--no-register", action="store_true",
                   help="do not register the router itself as an api_server member")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    api_key, token, curve = secret_of(args, API_KEY), secret_of(args, TOKEN), client_curve_of(args)
    refusal = insecure_refusal("router", args.host, secured=bool(api_key or token or curve),
                               insecure=args.insecure)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    view = MembershipView(args.registry, curve=curve).start()
    server: RouterServer | None = None
    agent: Agent | None = None
    try:
        server = RouterServer(RouterConfig(
            host=args.host, port=args.port, policy=args.policy, api_key=api_key,
            locality_label=args.locality_label, max_attempts=args.max_attempts,
            quarantine_s=args.quarantine, stale_load_s=args.stale_load), view).start()
        advertise = args.advertise_host or args.host
        member_id = default_member_id(Role.API_SERVER, advertise, server.port)
        if not args.no_register:
            spec = MemberSpec(
                id=member_id, incarnation=new_incarnation(), role=Role.API_SERVER, model="",
                protocol=ROUTER_PROTOCOL,
                endpoints=Endpoints(http=f"http://{advertise}:{server.port}"),
                started_at=time.time())
            agent = Agent(spec, registries=args.registry, token=token,
                          state=MemberState.READY, curve=curve).start()
            # Failure reports need a member session: they go out through this agent.
            view.reporter = agent.report
        print(json.dumps({"event": "ready", "url": server.url, "id": member_id}), flush=True)
        stop.wait()
    finally:
        if agent is not None:
            agent.stop()  # bye first: no one should send us work while we close
        if server is not None:
            server.close()
        view.close()
    return 0
