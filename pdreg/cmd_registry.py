"""`pdreg registry`: run a registry until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import threading

from registry.detector import HEARTBEAT_INTERVAL_S, LEASE_INTERVALS
from registry.server import RegistryConfig, RegistryServer, config_from_env


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("registry", help="run a registry (membership manager)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address for every port (default loopback only)")
    p.add_argument("--port", type=int, default=7600, help="control port (ZeroMQ ROUTER)")
    p.add_argument("--events-port", type=int, default=7601, help="event port (ZeroMQ PUB)")
    p.add_argument("--http-port", type=int, default=7680, help="HTTP port; -1 disables HTTP")
    p.add_argument("--token", default="",
                   help="registrations must carry this token (or $PDREG_TOKEN)")
    p.add_argument("--admin-token", default="",
                   help="drain/evict must carry this bearer token (or $PDREG_ADMIN_TOKEN)")
    p.add_argument("--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL_S,
                   metavar="S", help="heartbeat interval members are told to use")
    p.add_argument("--lease", type=float, default=None, metavar="S",
                   help=f"expire a silent member after S seconds "
                        f"(default and minimum {LEASE_INTERVALS:.0f} intervals)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    lease = args.lease if args.lease is not None else LEASE_INTERVALS * args.heartbeat_interval
    config = config_from_env(RegistryConfig(
        host=args.host, port=args.port, events_port=args.events_port, http_port=args.http_port,
        heartbeat_interval_s=args.heartbeat_interval, lease_s=lease, token=args.token,
        admin_token=args.admin_token))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = RegistryServer(config).start()
    print(f"pdreg registry: control {server.control_address}  events :{server.events_port}  "
          f"http {server.http_url or 'off'}", flush=True)
    try:
        stop.wait()
    finally:
        server.close()
    return 0
