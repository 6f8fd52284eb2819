"""The registry at fleet scale: a big fleet heartbeating, routers subscribed, churn.

    .venv/bin/python bench/bench_scale.py [--members 10000,100000] [--subscribers 100]
        [--churn 10] [--measure 10] [--baseline COMMIT] [--repeat N]
        [--registry-args "VARIANT;VARIANT"] [--per-model] [--sub-procs K]
    .venv/bin/python bench/bench_scale.py --members 100000 --sync-storm 1000
        [--storm-models K] [--baseline COMMIT]
    .venv/bin/python bench/bench_scale.py --deadband 20000:5 --measure 30

Per registry (this tree, and with --baseline a commit of this repository extracted with
`git archive` into a temporary directory) and per fleet size, in one run, side by side:

- the registry runs as `pdreg registry` in its own process (HTTP off), as deployed;
- a load generator process registers the members and heartbeats each one at the interval
  the registry dictates, from its own phase, with a load that changes (a random walk of
  running requests and KV use), signed as agents sign, over 64 connections on which it
  speaks ZMTP as a libzmq DEALER does (its own CPU is taken from the registry's machine:
  it stands in for hosts); with --churn R, R times a second a
  `churn-*` member says bye or comes back as a new incarnation; a probe member flips its
  state every PROBE_EVERY_S (a membership event);
- a subscriber process holds --subscribers raw SUB sockets (what a router's view holds):
  bytes received, and when each probe event arrived (propagation);
- a view process runs one real `MembershipView` (its CPU while the fleet runs).

Reported over the measured window (after every member has registered and heartbeat at
least once): heartbeats offered and answered OK, registry CPU (% of a core, and per
heartbeat and per delivered PUB message), propagation p50/p99 of the probe's events to
every subscriber, PUB bytes per router per second, view CPU, members wrongly suspected
(a `MemberUpdated` with suspect set for a member that never stopped), and afterwards a
Sync's round trip time and size. Where a probe's delay is: its propagation to the
first subscriber (no fan-out queueing), its own heartbeat's reply (the control queue),
the subscriber processes' own delay, and CPU per registry thread (the loop, libzmq's I/O).
The bench's own part: the generator's CPU per heartbeat and how late it sent heartbeats
after they fell due (a generator without a CPU sends late, then catches up), and the
garbage collections of the generator, the subscribers and the view.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` and pdreg

from bench.procs import ROOT, remove_tree, source_tree
from bench.scale.deadband import deadband_entries
from bench.scale.run import Result, Settings, run_one
from bench.scale.storm import sync_storm
from bench.tables import print_table

TABLE_COLUMNS = (
    "tree", "members", "churn_per_s", "interval_s", "offered_per_s", "sent_total",
    "handled_total", "answered_per_s", "registry_core_pct", "registry_us_per_heartbeat",
    "registry_us_per_delivered_msg", "propagation_p50_ms", "propagation_p99_ms",
    "first_p50_ms", "first_p99_ms", "sub_own_p99_ms", "sub_procs", "probe_reply_p50_ms",
    "probe_reply_p99_ms", "probes_lost", "generator_core_pct", "generator_us_per_heartbeat",
    "generator_late_p99_ms", "generator_late_max_ms", "generator_late_over_10ms",
    "generator_gap_max_ms", "generator_gc", "subscribers_gc_max_ms", "view_gc",
    "subscribers_core_pct", "pub_bytes_per_router_per_s", "view_core_pct", "wrongly_suspect",
    "registry_runq_wait_pct", "subscribers_runq_wait_pct", "turns_per_s", "turns_over_25ms",
    "turns_over_100ms", "snapshot_builds", "snapshot_build_ms_mean", "scrape_kb",
    "scrape_ms_max", "snapshot_ms", "snapshot_mb", "register_s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", default="10000,100000")
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--churn", type=float, default=0.0, help="changes per second")
    parser.add_argument("--measure", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=0.0,
                        help="seconds between the last registration and the window")
    parser.add_argument("--baseline", default="", help="a commit to run beside this tree")
    parser.add_argument("--only-baseline", action="store_true")
    parser.add_argument("--registry-args", default="",
                        help="extra args for this tree's registry; VARIANT;VARIANT runs "
                             "each (an empty one: the defaults)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--per-model", action="store_true",
                        help="subscribers serve one model each (router --models)")
    parser.add_argument("--sync-storm", type=int, default=0, metavar="VIEWS",
                        help="instead: VIEWS views asking for a snapshot at once")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="py-spy the registry over the window (DIR/TREE-N.txt, raw "
                             "stacks) and log its GC pauses over 1 ms (DIR/TREE-N-gc.log)")
    parser.add_argument("--scrape-every", type=float, default=0.0, metavar="S",
                        help="scrape the registry's /metrics every S seconds in the window")
    parser.add_argument("--nice-generator", type=int, default=0, metavar="N",
                        help="run the load generator at this nice level")
    parser.add_argument("--storm-models", type=int, default=0, metavar="K",
                        help="with --sync-storm: each view asks for K of the models")
    parser.add_argument("--storm-mem-gb", type=float, default=6.0, metavar="GB",
                        help="with --sync-storm: cap this process's address space meanwhile")
    parser.add_argument("--deadband", default="", metavar="MEMBERS:INTERVAL",
                        help="instead: digest entries/s per deadband setting (simulated)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the trees in turn N times (A B A B: the machine's load "
                             "drifts)")
    parser.add_argument("--no-baseline-figures", action="store_true",
                        help="do not scrape the baseline's loop histograms")
    parser.add_argument("--sub-procs", type=int, default=1, metavar="K",
                        help="spread the subscribers over K processes")
    return parser


def _trees(args: argparse.Namespace) -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, source tree, extra registry flags) per registry to run. Several variants
    of this tree side by side: --registry-args "A;B" runs "this A" and "this B" (an empty
    variant is the default flags); --baseline COMMIT runs first."""
    trees = [] if args.only_baseline else [
        ("this" + (f" {v.strip()}" if v.strip() else ""), str(ROOT), tuple(v.split()))
        for v in args.registry_args.split(";")]
    if args.baseline:
        trees.insert(0, (args.baseline, source_tree(args.baseline), ()))
    return trees


def _settings(args: argparse.Namespace, members: int) -> Settings:
    return Settings(members=members, subscribers=args.subscribers, churn_per_s=args.churn,
                    measure_s=args.measure, per_model=args.per_model, warmup_s=args.warmup,
                    profile=args.profile, scrape_every_s=args.scrape_every,
                    nice_generator=args.nice_generator, sub_procs=args.sub_procs,
                    baseline_figures=not args.no_baseline_figures)


def main() -> int:
    args = _parser().parse_args()
    if args.deadband:
        count, _, interval = args.deadband.partition(":")
        for row in deadband_entries(int(count), float(interval), args.measure):
            print(json.dumps(row), flush=True)
        return 0
    trees = _trees(args)
    results: list[Result] = []
    try:
        for members in (int(m) for m in args.members.split(",")):
            if args.sync_storm:
                for name, src, _ in trees:
                    print(json.dumps(sync_storm(name, src, members, args.sync_storm,
                                                args.storm_models, args.storm_mem_gb)),
                          flush=True)
                continue
            for name, src, extra in trees * args.repeat:
                result = run_one(name, src, extra, _settings(args, members))
                results.append(result)
                print(json.dumps(asdict(result)), flush=True)
    finally:
        if args.baseline:
            remove_tree(trees[0][1])
    if results and not args.json:
        rows = [asdict(r) for r in results]
        print_table(TABLE_COLUMNS, ([row[c] for c in TABLE_COLUMNS] for row in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
