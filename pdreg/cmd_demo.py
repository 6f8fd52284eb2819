"""`pdreg demo`: an elastic P/D cluster on loopback, steady traffic and a scripted scenario.

Starts a registry, a router and 2 prefill + 2 decode reference engines as processes, then
scales up, drains, kills, restarts the registry and scales down while clients stream
completions through the router. Exit code 0 when every expectation held, 1 otherwise.
"""

from __future__ import annotations

import argparse

from pdreg.demo.cluster import ClusterConfig
from pdreg.demo.display import TerminalDisplay
from pdreg.demo.scenario import Scenario, ScenarioConfig
from pdreg.signals import interrupt_on_signals


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="run a local elastic cluster through a scripted scenario",
        description="Registry + router + 2P2D reference engines on loopback; scale up, "
                    "drain, kill -9, registry restart, scale down, under steady traffic.")
    p.add_argument("--keep-running", action="store_true",
                   help="leave the cluster up after the scenario, until Ctrl-C")
    p.add_argument("--backend", choices=("torch", "sim"), default="torch",
                   help="reference engine backend (sim: no model, timed delays)")
    p.add_argument("--clients", type=int, default=3, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per completion")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, metavar="S",
                   help="registry heartbeat interval")
    p.add_argument("--lease", type=float, default=2.0, metavar="S",
                   help="registry lease: a silent member expires after S seconds")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the processes' log directory even when everything held")
    p.add_argument("--autoscale", action="store_true",
                   help="instead: load that rises and falls, and `pdreg planner --exec` "
                        "starting and draining sim engines to follow it (about 2 minutes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.autoscale:
        from pdreg.demo import autoscale

        return autoscale.run(args)
    engine_args = ("--sim-prefill-delay", "0.002", "--sim-decode-delay", "0.01") \
        if args.backend == "sim" else ()
    config = ScenarioConfig(
        cluster=ClusterConfig(backend=args.backend, heartbeat_interval_s=args.heartbeat_interval,
                              lease_s=args.lease, engine_args=engine_args),
        clients=args.clients, max_tokens=args.max_tokens)
    display = TerminalDisplay()
    scenario = Scenario(config, display)
    ok = False
    try:
        with interrupt_on_signals(scenario.interrupt):
            try:
                ok = scenario.play()
                display.message(f"\npdreg demo: {'every expectation held' if ok else 'FAILED'}")
                if args.keep_running:
                    if scenario.traffic is not None:
                        scenario.traffic.stop()  # the cluster is yours now
                    where = "\n".join(f"  {k}: {v}" for k, v in scenario.endpoints().items())
                    display.message(f"Cluster left running (Ctrl-C stops it):\n{where}")
                    scenario.wait_for_interrupt()
            except KeyboardInterrupt:
                display.message("\npdreg demo: interrupted; stopping every process")
    finally:
        scenario.close()
        if ok and not args.keep_logs:
            scenario.cluster.remove_logs()
        else:
            display.message(f"logs: {scenario.cluster.log_dir}")
    return 0 if ok else 1
