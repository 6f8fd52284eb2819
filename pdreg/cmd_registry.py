"""`pdreg registry`: run a registry until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import threading

from pdreg.args import (
    ADMIN_TOKEN,
    TOKEN,
    add_secret_argument,
    add_server_curve_arguments,
    insecure_refusal,
    secrets_of,
    server_curve_of,
)
from pdreg.store_args import add_store_arguments, store_options_of
from registry.coalesce import PAUSE_S as COALESCE_PAUSE_S
from registry.deadband import MAX_AGE_INTERVALS as LOAD_MAX_AGE_INTERVALS
from registry.deadband import MAX_AGE_S as LOAD_MAX_AGE_S
from registry.detector import HEARTBEAT_INTERVAL_S, LEASE_INTERVALS
from registry.server import DEFAULT_MAX_MEMBERS, RegistryConfig, RegistryServer

MAX_IO_THREADS = 64


MAX_COALESCE_MS = 50.0  # beyond this the pause, not the work, would set the latency


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("registry", help="run a registry (membership manager)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address for every port (default loopback only)")
    p.add_argument("--port", type=int, default=7600, help="control port (ZeroMQ ROUTER)")
    p.add_argument("--events-port", type=int, default=7601, help="event port (ZeroMQ PUB)")
    p.add_argument("--http-port", type=int, default=7680, help="HTTP port; -1 disables HTTP")
    add_secret_argument(p, TOKEN)
    add_secret_argument(p, ADMIN_TOKEN)
    add_server_curve_arguments(p)
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback without every credential: no CURVE "
                        "allowlist nor token, or no --admin-token for the HTTP side")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="serve the HTTP side over HTTPS with this certificate (PEM; with "
                        "--tls-key), so admin tokens do not cross the network in clear")
    p.add_argument("--tls-key", default=None, metavar="FILE",
                   help="the private key of --tls-cert (PEM)")
    p.add_argument("--max-members", type=int, default=DEFAULT_MAX_MEMBERS, metavar="N",
                   help="refuse registrations beyond N members (default: what one "
                        "registry was measured to hold; see docs/operations.md)")
    p.add_argument("--max-members-per-model", type=int, default=0, metavar="N",
                   help="refuse registrations beyond N members of one model (0: no such cap)")
    p.add_argument("--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL_S,
                   metavar="S", help="heartbeat interval members are told to use")
    p.add_argument("--lease", type=float, default=None, metavar="S",
                   help=f"expire a silent member after S seconds "
                        f"(default and minimum {LEASE_INTERVALS:.0f} intervals)")
    p.add_argument("--io-threads", type=_io_threads, default=1, metavar="N",
                   help="libzmq I/O threads for the sockets (the event fan-out to many "
                        "routers is their work; about one per 200 routers, up to the cores)")
    p.add_argument("--coalesce-ms", type=_coalesce_ms, default=1e3 * COALESCE_PAUSE_S, metavar="MS",
                   help="above 2,000 messages/s, pause MS between the loop's turns so that "
                        "each handles a batch: less CPU per heartbeat, up to MS more latency "
                        "(0: never pause)")
    p.add_argument("--load-max-age", type=float, default=LOAD_MAX_AGE_S, metavar="S",
                   help="a load change too small to route on (a tenth of the value, two "
                        "points of KV) reaches routers at most S late (or "
                        "--load-max-age-intervals heartbeat intervals, if longer); 0 sends "
                        "every change at once")
    p.add_argument("--load-max-age-intervals", type=float, default=LOAD_MAX_AGE_INTERVALS,
                   metavar="N", help="see --load-max-age (0: S alone)")
    add_store_arguments(p)
    p.set_defaults(func=run)


def _coalesce_ms(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= MAX_COALESCE_MS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"--coalesce-ms must be 0..{MAX_COALESCE_MS:g}")
    return value


def _io_threads(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_IO_THREADS:
        raise argparse.ArgumentTypeError(f"--io-threads must be 1..{MAX_IO_THREADS}")
    return value


def run(args: argparse.Namespace) -> int:
    lease = args.lease if args.lease is not None else LEASE_INTERVALS * args.heartbeat_interval
    # Every line of a token file is a token accepted (rotation: old and new together).
    token = secrets_of(args, TOKEN)
    curve = server_curve_of(args)
    admin_token = secrets_of(args, ADMIN_TOKEN)
    refusal = (
        insecure_refusal("registry", args.host, secured=bool(token or curve),
                         insecure=args.insecure)
        # CURVE that lets in any key authenticates nobody: not enough on its own.
        or insecure_refusal("registry-curve", args.host,
                            secured=bool(token or curve is None or curve.allowed_clients),
                            insecure=args.insecure,
                            what="with CURVE open to any client key and no token")
        or insecure_refusal("registry-admin", args.host,
                            secured=bool(admin_token) or args.http_port < 0,
                            insecure=args.insecure, what="with HTTP but no admin token"))
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        print("pdreg registry: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    try:
        config = RegistryConfig(
            host=args.host, port=args.port, events_port=args.events_port,
            http_port=args.http_port, heartbeat_interval_s=args.heartbeat_interval,
            lease_s=lease, token=token, admin_token=admin_token,
            max_members=args.max_members, max_members_per_model=args.max_members_per_model,
            curve=curve, tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
            load_max_age_s=args.load_max_age,
            load_max_age_intervals=args.load_max_age_intervals, io_threads=args.io_threads,
            coalesce_s=args.coalesce_ms / 1e3, store=args.store,
            store_options=store_options_of(args), registry_id=args.registry_id or "",
            advertise_host=args.advertise_host or "")
        server = RegistryServer(config)
    except ValueError as exc:
        print(f"pdreg registry: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    # What start-up made (imports, FastAPI, the app) lives as long as the process: keep
    # it out of the full collections that would otherwise walk it, on the loop's time.
    gc.freeze()
    security = ", ".join(part for part, on in (("CURVE", curve), ("token", token),
                                               ("admin token", config.admin_token)) if on)
    print(f"pdreg registry: control {server.control_address}  events :{server.events_port}  "
          f"http {server.http_url or 'off'}  security: {security or 'none'}  "
          f"store: {server.store_url}", flush=True)
    try:
        stop.wait()
    finally:
        server.close()
    return 0
