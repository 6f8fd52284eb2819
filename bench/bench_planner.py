"""Static XpYd against `pdreg planner` under a load that rises, spikes and falls.

    .venv/bin/python bench/bench_planner.py [--configs 1P1D,2P2D,1P3D,3P1D,planner]
                                            [--time-scale 1.0] [--out DIR] [--report]

One load profile (open loop, Poisson arrivals, seeded): quiet 1 req/s, ramp up to 5,
plateau, a spike at 9, ramp down, quiet. Sim engines with a GPU's orders of magnitude:
a prefill computes one 1,000-token prompt at a time at 0.25 ms per token; a decode
streams up to 8 requests at 30 ms per token, 48 tokens each. Every configuration runs a
registry and a router on loopback; the static ones keep their engines, the planner-driven
one starts at 1P1D and its `--exec` hook starts and drains engines.

Per configuration: TTFT and ITL SLO attainment (share of requests whose TTFT, and whose
mean time per output token, met the objective; failures miss both) and engine-seconds
(each engine process from start to exit, within the profile). Each configuration writes a
JSON file to --out; --report prints the Markdown table of every file there, with the
load average each ran under (before each configuration the bench waits, bounded, for
the machine to be quiet). Run the configurations one at a time:

    for c in 1P1D 2P2D 1P3D 3P1D planner; do
        .venv/bin/python bench/bench_planner.py --configs $c
    done
    .venv/bin/python bench/bench_planner.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `bench` and pdreg

from bench.procs import wait_for_quiet  # noqa: E402
from pdreg.demo.cluster import ClusterConfig  # noqa: E402
from pdreg.demo.open_loop import OpenLoopLoad, Phase, Workload, attainment  # noqa: E402
from pdreg.demo.scaler import RoleArgsCluster, Scaler, start_planner  # noqa: E402

TTFT_SLO_S = 1.0
ITL_SLO_S = 0.05
SAMPLE_PERIOD_S = 0.5
PROFILE = (
    Phase("quiet", 20.0, 1.0, 1.0),
    Phase("ramp up", 30.0, 1.0, 5.0),
    Phase("plateau", 30.0, 5.0, 5.0),
    Phase("spike", 10.0, 9.0, 9.0),
    Phase("ramp down", 30.0, 5.0, 1.0),
    Phase("quiet again", 20.0, 1.0, 1.0),
)
WORKLOAD = Workload(prompt_tokens=1000, max_tokens=48)
SIM_ARGS = ("--sim-prefill-delay", "0.00025", "--sim-decode-delay", "0.03")
ROLE_ARGS = {"prefill": ("--max-running", "1"), "decode": ("--max-running", "8")}
PLANNER_ARGS = (
    "--interval", "1", "--load-window", "5", "--latency-window", "10",
    "--scale-down-window", "15", "--slo-memory", "60", "--ttft-slo", str(TTFT_SLO_S),
    "--itl-slo", str(ITL_SLO_S), "--max-prefill", "6", "--max-decode", "6")
STATIC = {"1P1D": (1, 1), "2P2D": (2, 2), "1P3D": (1, 3), "3P1D": (3, 1), "3P2D": (3, 2)}
DEFAULT_OUT = REPO / "bench" / "out" / "planner"  # one JSON file per configuration


def run_config(name: str, time_scale: float, seed: int) -> dict[str, Any]:
    profile = tuple(Phase(p.name, p.duration_s * time_scale, p.start_rate, p.end_rate)
                    for p in PROFILE)
    prefills, decodes = STATIC.get(name, (1, 1))
    cluster = RoleArgsCluster(ClusterConfig(backend="sim", engine_args=SIM_ARGS,
                                            heartbeat_interval_s=0.5, lease_s=2.0,
                                            log_level="WARNING"), ROLE_ARGS)
    requests = cluster.log_dir / "scale-requests"
    scaler = Scaler(cluster, requests if name == "planner" else None)
    planner = None
    load = None
    try:
        cluster.start_registry()
        cluster.start_router()
        ids = cluster.start_engines(["prefill"] * prefills + ["decode"] * decodes)
        for member_id in ids:
            scaler.track(cluster.engines[member_id])
        scaler.set("prefill", prefills)
        scaler.set("decode", decodes)
        if name == "planner":
            planner = start_planner(cluster, PLANNER_ARGS, requests)
        scaler.start()
        time.sleep(2.0)  # every engine routable, loads reported
        load = OpenLoopLoad(cluster.router_url, profile, WORKLOAD, seed=seed).start()
        samples = _sample_while(load, scaler)
        began, ended = load.started_at, time.monotonic()
        load_average = os.getloadavg()[1]  # 5-minute: mostly this run
        outcomes = load.outcomes()
        result = attainment(outcomes, TTFT_SLO_S, ITL_SLO_S)
        phases = {}
        for phase in profile:
            part = attainment(load.outcomes(phase.name), TTFT_SLO_S, ITL_SLO_S)
            window = [s for s in samples if s[3] == phase.name]
            phases[phase.name] = {
                "requests": part.requests, "ttft": part.ttft, "itl": part.itl,
                "mean_prefills": _mean([s[1] for s in window]),
                "mean_decodes": _mean([s[2] for s in window])}
        return {
            "config": name, "time_scale": time_scale, "seed": seed,
            "ttft_slo_s": TTFT_SLO_S, "itl_slo_s": ITL_SLO_S, **asdict(result),
            "engine_seconds": scaler.engine_seconds(began, ended),
            "duration_s": ended - began, "load_average_5m": load_average,
            "mean_prefills": _mean([s[1] for s in samples]),
            "mean_decodes": _mean([s[2] for s in samples]),
            "peak_prefills": max((s[1] for s in samples), default=0),
            "peak_decodes": max((s[2] for s in samples), default=0),
            "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
            "phases": phases,
        }
    finally:
        if load is not None:
            load.stop()
        if planner is not None:
            planner.stop()
        scaler.close()
        cluster.stop_all()
        cluster.remove_logs()


def _sample_while(load: OpenLoopLoad, scaler: Scaler) -> list[tuple[float, int, int, str]]:
    """(t, ready prefills, ready decodes, phase) every SAMPLE_PERIOD_S until the load ends."""
    samples = []
    done = threading.Event()
    while not done.wait(SAMPLE_PERIOD_S):
        now = time.monotonic()
        phase = max((p for p, t in load.phase_started.items() if t <= now),
                    key=lambda p: load.phase_started[p], default="")
        p, d = scaler.serving()
        samples.append((now, p, d, phase))
        if load.wait(0):
            done.set()
    return samples


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def report(out: Path) -> str:
    results = {}
    for path in sorted(out.glob("*.json")):
        data = json.loads(path.read_text())
        results[data["config"]] = data
    order = [c for c in (*STATIC, "planner") if c in results]
    if not order:
        return f"no results in {out}"
    first = results[order[0]]
    lines = [
        f"TTFT SLO {first['ttft_slo_s'] * 1e3:.0f} ms, ITL SLO {first['itl_slo_s'] * 1e3:.0f} "
        f"ms; profile {sum(p.duration_s for p in PROFILE) * first['time_scale']:.0f} s.", "",
        "| config | requests (failed) | TTFT attained | ITL attained | both | TTFT p50 / p90 | "
        "engine-seconds | mean P / D | peak P / D | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        r = results[name]
        lines.append(
            f"| {name} | {r['requests']} ({r['failed']}) | {r['ttft']:.1%} | {r['itl']:.1%} | "
            f"{r['both']:.1%} | {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} | "
            f"{r['engine_seconds']:.0f} | {r['mean_prefills']:.1f} / {r['mean_decodes']:.1f} | "
            f"{r['peak_prefills']} / {r['peak_decodes']} | "
            f"{r.get('load_average_5m', 0):.1f} |")
    lines += ["", "TTFT attained per phase:", "",
              "| config | " + " | ".join(p.name for p in PROFILE) + " |",
              "|---|" + "---|" * len(PROFILE)]
    for name in order:
        phases = results[name]["phases"]
        lines.append(f"| {name} | " + " | ".join(
            f"{phases[p.name]['ttft']:.0%} ({phases[p.name]['mean_prefills']:.1f}P "
            f"{phases[p.name]['mean_decodes']:.1f}D)" if p.name in phases else "-"
            for p in PROFILE) + " |")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join((*STATIC, "planner")),
                        help="comma-separated: 1P1D, 2P2D, 1P3D, 3P1D, planner")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="stretch (or shrink) every phase by this factor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report", action="store_true", help="only print the table")
    parser.add_argument("--quiet-load", type=float, default=4.0, metavar="L",
                        help="before each configuration, wait (up to --quiet-wait) for the "
                             "1-minute load average to fall below L")
    parser.add_argument("--quiet-wait", type=float, default=120.0, metavar="S")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for name in args.configs.split(","):
            if name not in STATIC and name != "planner":
                parser.error(f"unknown configuration {name!r}")
            before = wait_for_quiet(args.quiet_load, args.quiet_wait)
            print(f"[bench_planner] {name} (load average {before:.1f}) ...", file=sys.stderr,
                  flush=True)
            result = run_config(name, args.time_scale, args.seed)
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
            print(f"[bench_planner] {name}: TTFT {result['ttft']:.1%}, ITL "
                  f"{result['itl']:.1%}, {result['engine_seconds']:.0f} engine-seconds",
                  file=sys.stderr, flush=True)
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
