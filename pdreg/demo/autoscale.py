"""`pdreg demo --autoscale`: a cluster that sizes itself while the load rises and falls.

    start      registry, router, 1 prefill + 1 decode (sim engines with real delays),
               and `pdreg planner --exec HOOK`; the hook asks the demo's `Scaler` for
               N engines of a role, which starts or drains them
    phases     an open-loop load: quiet, ramp up, plateau, ramp down, quiet
    settle     the load is gone; the planner scales back down after its window

The output shows every decision with its reason as it happens, the engines that start
and drain, and per phase the prefills and decodes serving and the SLO attainment.
Expectations: both roles scale up under load and back down after it, no request fails.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from pdreg.demo.cluster import ClusterConfig, ManagedProcess
from pdreg.demo.display import TerminalDisplay
from pdreg.demo.open_loop import OpenLoopLoad, Phase, Workload, attainment
from pdreg.demo.scaler import RoleArgsCluster, ScaleEvent, Scaler, hook_command, start_planner
from pdreg.signals import interrupt_on_signals

__all__ = ["AutoscaleConfig", "AutoscaleDemo", "PhaseReport"]

SAMPLE_PERIOD_S = 0.25
PLAN_POLL_S = 0.5
SETTLE_TIMEOUT_S = 60.0
DEMO_PHASES = (
    Phase("quiet", 10.0, 1.0, 1.0),
    Phase("ramp up", 15.0, 1.0, 6.0),
    Phase("plateau", 15.0, 6.0, 6.0),
    Phase("ramp down", 15.0, 6.0, 1.0),
    Phase("quiet again", 15.0, 1.0, 1.0),
)
# A prefill computes one prompt at a time (0.5 ms per token); a decode batches four
# streams at 25 ms per token. At 6 requests/s that takes 3 prefills and 2 decodes.
SIM_ARGS = ("--sim-prefill-delay", "0.0005", "--sim-decode-delay", "0.025")
ROLE_ARGS = {"prefill": ("--max-running", "1"), "decode": ("--max-running", "4")}


class Display(Protocol):
    def message(self, text: str) -> None: ...
    def status(self, text: str) -> None: ...


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    phases: tuple[Phase, ...] = DEMO_PHASES
    workload: Workload = field(default_factory=lambda: Workload(prompt_tokens=600,
                                                                max_tokens=24))
    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.05
    planner_args: tuple[str, ...] = (
        "--interval", "1", "--scale-down-window", "10", "--latency-window", "10",
        "--load-window", "5", "--slo-memory", "60", "--max-prefill", "4", "--max-decode", "4")
    cluster: ClusterConfig = field(default_factory=lambda: ClusterConfig(
        backend="sim", engine_args=SIM_ARGS, log_level="WARNING"))
    role_args: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(ROLE_ARGS))
    seed: int = 0


@dataclass
class PhaseReport:
    phase: Phase
    started: float
    finished: float
    serving: list[tuple[int, int]] = field(default_factory=list)  # samples (P, D)
    line: str = ""

    def span(self, index: int) -> str:
        """How a count moved over the phase: "1", "1->3", "2->1 (peak 3)"."""
        values = [sample[index] for sample in self.serving] or [0]
        first, last, peak = values[0], values[-1], max(values)
        text = str(first) if first == last else f"{first}->{last}"
        return text if peak == max(first, last) else f"{text} (peak {peak})"


class AutoscaleDemo:
    def __init__(self, config: AutoscaleConfig, display: Display) -> None:
        self.config = config
        self.display = display
        self.cluster = RoleArgsCluster(config.cluster, config.role_args)
        self.scaler = Scaler(self.cluster, self.cluster.log_dir / "scale-requests",
                             on_event=self._on_scale_event)
        self.planner: ManagedProcess | None = None
        self.load: OpenLoopLoad | None = None
        self.reports: list[PhaseReport] = []
        self.checks: list[tuple[str, bool, str]] = []
        self.began = time.monotonic()
        self._interrupted = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stop_watch = threading.Event()

    # --- running ------------------------------------------------------------------------

    def play(self) -> bool:
        cfg = self.config
        self._start_cluster()
        self.load = OpenLoopLoad(self.cluster.router_url, cfg.phases, cfg.workload,
                                 seed=cfg.seed).start()
        for phase in cfg.phases:
            self._play_phase(phase)
        self.display.message("\n==> The load is gone: waiting for the planner to scale down")
        self.load.wait(SETTLE_TIMEOUT_S)
        settled = self._wait_until(lambda: self.scaler.serving() == (1, 1), SETTLE_TIMEOUT_S)
        self._summarise(settled)
        return all(ok for _, ok, _ in self.checks)

    def interrupt(self) -> None:
        self._interrupted.set()

    def close(self) -> None:
        """Stop the load, the planner, the scaler and every process. Safe twice."""
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(5)
        if self.load is not None:
            self.load.stop()
        if self.planner is not None:
            self.planner.stop()  # first: no decision may start engines while we stop
        self.scaler.close()
        self.cluster.stop_all()

    def _start_cluster(self) -> None:
        cluster, cfg = self.cluster, self.config
        self.display.message("==> Start a registry, a router, 1 prefill + 1 decode (sim) "
                             "and a planner")
        cluster.start_registry()
        cluster.start_router()
        for member_id in cluster.start_engines(["prefill", "decode"]):
            self.scaler.track(cluster.engines[member_id])
        self.scaler.set("prefill", 1)
        self.scaler.set("decode", 1)
        requests = self.scaler.requests_file
        assert requests is not None
        self.planner = start_planner(cluster, (
            "--ttft-slo", str(cfg.ttft_slo_s), "--itl-slo", str(cfg.itl_slo_s),
            *cfg.planner_args), requests)
        planner_url = str(self.planner.ready["url"])
        self.scaler.start()
        self._watcher = threading.Thread(target=self._watch_plan, args=(planner_url,),
                                         name="demo-plan-watch", daemon=True)
        self._watcher.start()
        self.display.message(
            f"  router {cluster.router_url}/v1, planner {planner_url}/v1/plan "
            f"(`pdreg plan --planner {planner_url} --watch`), logs {cluster.log_dir}\n"
            f"  security: {cluster.security_summary()}\n"
            f"  SLOs: TTFT {cfg.ttft_slo_s * 1e3:.0f} ms, ITL {cfg.itl_slo_s * 1e3:.0f} ms. "
            f"Hook: --exec {hook_command(requests)}")

    def _play_phase(self, phase: Phase) -> None:
        self.display.message(f"\n==> {phase.name}: {phase.rate_text} for "
                             f"{phase.duration_s:g} s")
        report = PhaseReport(phase, time.monotonic(), 0.0)
        self.reports.append(report)
        deadline = report.started + phase.duration_s
        while time.monotonic() < deadline:
            if self._interrupted.is_set():
                raise KeyboardInterrupt
            report.serving.append(self.scaler.serving())
            p, d = report.serving[-1]
            load = self.load
            self.display.status(f"{phase.name} {time.monotonic() - report.started:4.1f}s | "
                                f"serving {p}P+{d}D | in flight "
                                f"{load.in_flight if load else 0}")
            time.sleep(SAMPLE_PERIOD_S)
        report.finished = time.monotonic()
        p, d = self.scaler.serving()
        self.display.message(f"  end of {phase.name}: serving {p} prefill + {d} decode")

    # --- what the demo prints as it happens -----------------------------------------------

    def _on_scale_event(self, event: ScaleEvent) -> None:
        if event.what == "asked":
            return  # the planner's decision line already said it
        p, d = event.serving
        self.display.message(f"  {event.at - self.began:6.1f}s  {event.role} {event.what}: "
                             f"{event.detail}  (serving {p}P+{d}D)")

    def _watch_plan(self, url: str) -> None:
        shown: dict[tuple[str, str], int] = {}
        with httpx.Client(timeout=2.0) as client:
            while not self._stop_watch.wait(PLAN_POLL_S):
                try:
                    plan: dict[str, Any] = client.get(f"{url}/v1/plan").json()
                except (httpx.HTTPError, ValueError):
                    continue
                for d in plan["decisions"]:
                    key = (d["model"], d["role"])
                    if shown.get(key) != d["desired"]:
                        if key in shown:
                            self.display.message(
                                f"  {time.monotonic() - self.began:6.1f}s  planner: "
                                f"{d['role']} {shown[key]} -> {d['desired']}  ({d['why']})")
                        shown[key] = d["desired"]

    # --- the end ----------------------------------------------------------------------------

    def _summarise(self, settled: bool) -> None:
        cfg = self.config
        assert self.load is not None
        rows = [("PHASE", "RATE", "PREFILLS", "DECODES", "REQUESTS", "TTFT OK", "ITL OK")]
        for report in self.reports:
            result = attainment(self.load.outcomes(report.phase.name), cfg.ttft_slo_s,
                                cfg.itl_slo_s)
            report.line = result.line(cfg.ttft_slo_s, cfg.itl_slo_s)
            rows.append((report.phase.name, report.phase.rate_text, report.span(0),
                         report.span(1), f"{result.requests} ({result.failed} failed)",
                         f"{result.ttft:.0%}", f"{result.itl:.0%}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                          for r in rows)
        outcomes = self.load.outcomes()
        failed = [o for o in outcomes if not o.ok]
        peak_p = max((s[0] for r in self.reports for s in r.serving), default=0)
        peak_d = max((s[1] for r in self.reports for s in r.serving), default=0)
        self.checks = [
            ("prefills scaled up under load", peak_p >= 2, f"at most {peak_p}"),
            ("decodes scaled up under load", peak_d >= 2, f"at most {peak_d}"),
            ("back to 1 prefill + 1 decode once the load was gone", settled,
             "serving {}P+{}D".format(*self.scaler.serving())),
            ("no request failed", not failed,
             "; ".join(sorted({o.error for o in failed})[:3])),
        ]
        whole = attainment(outcomes, cfg.ttft_slo_s, cfg.itl_slo_s)
        slos = f"TTFT SLO {cfg.ttft_slo_s * 1e3:.0f} ms, ITL SLO {cfg.itl_slo_s * 1e3:.0f} ms"
        lines = [f"\n==> Summary ({slos})", table,
                 f"  all: {whole.line(cfg.ttft_slo_s, cfg.itl_slo_s)}",
                 f"  engine-seconds: {self.scaler.engine_seconds(self.began):.0f} over "
                 f"{time.monotonic() - self.began:.0f} s"]
        lines += [f"  {'ok  ' if ok else 'FAIL'} {name} ({detail})" if detail else
                  f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok, detail in self.checks]
        self.display.message("\n".join(lines))

    def _wait_until(self, predicate: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self._interrupted.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                return False
            time.sleep(SAMPLE_PERIOD_S)
        return True


def run(args: argparse.Namespace) -> int:
    """`pdreg demo --autoscale`; Ctrl-C or SIGTERM stop it and every process it started."""
    config = AutoscaleConfig(cluster=ClusterConfig(
        backend="sim", heartbeat_interval_s=args.heartbeat_interval, lease_s=args.lease,
        engine_args=SIM_ARGS, log_level="WARNING"))
    display = TerminalDisplay()
    demo = AutoscaleDemo(config, display)

    ok = False
    try:
        with interrupt_on_signals(demo.interrupt):
            try:
                ok = demo.play()
                display.message(f"\npdreg demo --autoscale: "
                                f"{'every expectation held' if ok else 'FAILED'}")
            except KeyboardInterrupt:
                display.message("\npdreg demo --autoscale: interrupted; stopping every "
                                "process")
    finally:
        demo.close()
        if ok and not args.keep_logs:
            demo.cluster.remove_logs()
        else:
            display.message(f"logs: {demo.cluster.log_dir}")
    return 0 if ok else 1
