"""The demo's runner, shared by `pdreg demo` and the e2e test: plays `STEPS`
(pdreg/demo/steps.py) in order on one `Stage`, records a `StepResult` per step and a
summary. The test asserts on those records; the demo prints them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import httpx

from pdreg.cmd_status import fetch_members, render
from pdreg.demo.cluster import Cluster
from pdreg.demo.observer import routable_roles
from pdreg.demo.stage import Display, ScenarioConfig, Stage, Step, StepFailed, StepResult
from pdreg.demo.steps import LEASE_MARGIN_S, READY_TO_TRAFFIC_LIMIT_S, STEPS
from pdreg.demo.traffic import TrafficGenerator, figures

__all__ = ["LEASE_MARGIN_S", "READY_TO_TRAFFIC_LIMIT_S", "Scenario", "ScenarioConfig",
           "StepResult"]

logger = logging.getLogger(__name__)

# What ends a step early (it records why); anything else is a bug and propagates.
_STEP_ERRORS = (StepFailed, TimeoutError, RuntimeError, httpx.HTTPError)


class Scenario:
    def __init__(self, config: ScenarioConfig, display: Display,
                 cluster: Cluster | None = None, steps: Sequence[Step] = STEPS) -> None:
        self.config = config
        self.display = display
        self.steps = tuple(steps)
        self.stage = Stage(config, display, cluster or Cluster(config.cluster))
        self.results: list[StepResult] = []
        self._current: StepResult | None = None
        self._ticker_stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._interrupted = threading.Event()

    @property
    def cluster(self) -> Cluster:
        return self.stage.cluster

    @property
    def traffic(self) -> TrafficGenerator | None:
        return self.stage.traffic

    @property
    def kill_at(self) -> float | None:
        return self.stage.kill_at

    def endpoints(self) -> dict[str, str]:
        return self.stage.endpoints()

    # --- running -------------------------------------------------------------------------

    def play(self) -> bool:
        """Run every step in order; stop at the first that cannot go on. True if all held."""
        self._start_ticker()
        try:
            for index, step in enumerate(self.steps, 1):
                self._raise_if_interrupted()
                if not self._play(index, step):
                    break  # later steps build on this one
            self._raise_if_interrupted()
            self.results.append(self._summary())
            self.display.step_finished(self.results[-1])
        finally:
            self._stop_ticker()
        return self.ok

    def _play(self, index: int, step: Step) -> bool:
        """One step, recorded; False if it could not go on."""
        result = StepResult(step.name, step.title, started=time.monotonic())
        self._current = result
        self.results.append(result)
        self.display.step_started(index, len(self.steps), result)
        completed = True
        try:
            step.run(self.stage, result)
        except _STEP_ERRORS as exc:
            completed = result.check("step completed", False, str(exc)[:500])
        result.finished = time.monotonic()
        self._finish(result)
        return completed

    def interrupt(self) -> None:
        """From a signal handler: stop at the next step boundary at the latest.

        The handler also raises KeyboardInterrupt for a prompt stop, but Python drops an
        exception raised while a finaliser or weakref callback runs; this flag does not.
        """
        self._interrupted.set()

    def wait_for_interrupt(self) -> None:
        """Block until `interrupt()` (for --keep-running)."""
        while not self._interrupted.wait(1.0):
            pass
        raise KeyboardInterrupt

    def _raise_if_interrupted(self) -> None:
        if self._interrupted.is_set():
            raise KeyboardInterrupt

    @property
    def ok(self) -> bool:
        """Every step ran and every expectation held."""
        return len(self.results) == len(self.steps) + 1 and all(r.ok for r in self.results)

    def close(self) -> None:
        """Stop traffic, the observer and every process. Safe twice."""
        self._stop_ticker()
        stage = self.stage
        if stage.traffic is not None:
            stage.traffic.stop()
        if stage.observer is not None:
            stage.observer.stop()
        stage.cluster.stop_all()

    def _finish(self, step: StepResult) -> None:
        if self.stage.traffic is not None:
            step.traffic = figures(self.stage.traffic.records(), step.started, step.finished)
        cluster = self.stage.cluster
        try:
            step.table = render(fetch_members(cluster.registry_address,
                                              curve=cluster.client_curve))
        except (RuntimeError, TimeoutError, ValueError) as exc:
            step.table = f"(registry did not answer: {exc})"
        self.display.step_finished(step)

    def _summary(self) -> StepResult:
        began = self.stage.began
        step = StepResult("summary", "Summary", started=began, finished=time.monotonic())
        records = self.stage.records()
        failed = [r for r in records if not r.ok]
        step.check("no failed request, the kill -9 included", not failed,
                   "; ".join(r.error for r in failed[:3]))
        step.check("every step held", all(r.ok for r in self.results),
                   ", ".join(r.name for r in self.results if not r.ok))
        step.traffic = figures(records, began, time.monotonic() + 1)
        step.measures["duration_s"] = step.finished - step.started
        return step

    # --- live status line ----------------------------------------------------------------

    def _start_ticker(self) -> None:
        self._ticker = threading.Thread(target=self._tick, name="demo-status", daemon=True)
        self._ticker.start()

    def _stop_ticker(self) -> None:
        self._ticker_stop.set()
        if self._ticker is not None:
            self._ticker.join(5)

    def _tick(self) -> None:
        while not self._ticker_stop.wait(self.config.status_period_s):
            step = self._current
            records = self.stage.records()
            ok = sum(r.ok for r in records)
            observer = self.stage.observer
            roles = routable_roles(observer.members() if observer else None)
            elapsed = time.monotonic() - step.started if step else 0.0
            self.display.status(
                f"{step.name if step else '-'} {elapsed:5.1f}s | {roles} | "
                f"ok {ok} failed {len(records) - ok}")
