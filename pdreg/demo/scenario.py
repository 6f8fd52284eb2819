"""The demo's story as steps with expectations, shared by `pdreg demo` and the e2e test.

    start             registry, router, 2 prefill + 2 decode engines, steady traffic
    scale_up          +1 prefill +1 decode; each gets traffic within 1 s of being ready
    drain_prefill     admin drain; the router stops picking it; SIGTERM once idle
    kill_decode       kill -9; no request fails (the router migrates the streams it held
                      to another decode); gone within the lease
    restart_registry  the registry restarts on its ports; membership is whole again
    scale_down        SIGTERM the newest prefill and decode; they drain, say bye, exit 0

Each step records a `StepResult`: its checks, named measures and the traffic figures of
its window. The test asserts on those records; the demo prints them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from pdreg.cmd_status import fetch_members, render
from pdreg.demo.cluster import Cluster, ClusterConfig
from pdreg.demo.observer import Members, Observer, routable_roles
from pdreg.demo.traffic import RequestRecord, TrafficFigures, TrafficGenerator, figures

logger = logging.getLogger(__name__)

READY_TO_TRAFFIC_LIMIT_S = 1.0  # a new member must be picked this soon after it is ready
DRAIN_PROPAGATION_S = 1.0  # after the registry says draining, the router stops picking
LEASE_MARGIN_S = 0.5  # detector tick + sampling period, on top of the lease
REJOIN_LIMIT_S = 5.0  # after a registry restart, every member is back within this
QUIET_S = 1.0  # "drained" = no pick for this long and no load reported
WAIT_TIMEOUT_S = 60.0  # generous: two loaded cores, torch imports
STREAM_ON_VICTIM_WAIT_S = 10.0  # the kill waits this long at most for a stream to hit
SETTLE_OK_REQUESTS = 10  # requests that must succeed after each step's action


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class StepResult:
    name: str
    title: str
    started: float = 0.0  # time.monotonic()
    finished: float = 0.0
    checks: list[Check] = field(default_factory=list)
    measures: dict[str, float] = field(default_factory=dict)  # seconds unless named _count
    traffic: TrafficFigures | None = None
    table: str = ""

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)


class Display(Protocol):
    def step_started(self, index: int, total: int, step: StepResult) -> None: ...
    def step_finished(self, step: StepResult) -> None: ...
    def status(self, text: str) -> None: ...
    def endpoints(self, where: dict[str, str]) -> None: ...


class StepFailed(Exception):
    """A step could not go on (a wait timed out); its checks say why."""


@dataclass(frozen=True, slots=True)
class ScenarioConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    clients: int = 3
    max_tokens: int = 8
    status_period_s: float = 0.5


class Scenario:
    STEPS: tuple[tuple[str, str], ...] = (
        ("start", "Start a registry, a router and 2 prefill + 2 decode engines"),
        ("scale_up", "Scale up to 3 prefill + 3 decode"),
        ("drain_prefill", "Drain one prefill (admin API), stop it once idle"),
        ("kill_decode", "kill -9 one decode (its streams migrate)"),
        ("restart_registry", "Restart the registry"),
        ("scale_down", "Scale down: SIGTERM the newest prefill and decode"),
    )

    def __init__(self, config: ScenarioConfig, display: Display,
                 cluster: Cluster | None = None) -> None:
        self.config = config
        self.display = display
        self.cluster = cluster or Cluster(config.cluster)
        self.results: list[StepResult] = []
        self.traffic: TrafficGenerator | None = None
        self.observer: Observer | None = None
        self.kill_at: float | None = None
        self.began = time.monotonic()
        self._current: StepResult | None = None
        self._ticker_stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._interrupted = threading.Event()

    # --- running -------------------------------------------------------------------------

    def play(self) -> bool:
        """Run every step in order; stop at the first that cannot go on. True if all held."""
        self._start_ticker()
        try:
            for index, (name, title) in enumerate(self.STEPS, 1):
                self._raise_if_interrupted()
                step = StepResult(name, title, started=time.monotonic())
                self._current = step
                self.results.append(step)
                self.display.step_started(index, len(self.STEPS), step)
                aborted = False
                try:
                    getattr(self, f"_step_{name}")(step)
                except (StepFailed, TimeoutError, RuntimeError, httpx.HTTPError) as exc:
                    aborted = not step.check("step completed", False, str(exc)[:500])
                step.finished = time.monotonic()
                self._finish(step)
                if aborted:
                    break  # later steps build on this one
            self._raise_if_interrupted()
            self.results.append(self._summary())
            self.display.step_finished(self.results[-1])
        finally:
            self._stop_ticker()
        return self.ok

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
        return len(self.results) == len(self.STEPS) + 1 and all(r.ok for r in self.results)

    def close(self) -> None:
        """Stop traffic, the observer and every process. Safe twice."""
        self._stop_ticker()
        if self.traffic is not None:
            self.traffic.stop()
        if self.observer is not None:
            self.observer.stop()
        self.cluster.stop_all()

    def _finish(self, step: StepResult) -> None:
        if self.traffic is not None:
            step.traffic = figures(self.traffic.records(), step.started, step.finished)
        try:
            step.table = render(fetch_members(self.cluster.registry_address,
                                              curve=self.cluster.client_curve))
        except (RuntimeError, TimeoutError, ValueError) as exc:
            step.table = f"(registry did not answer: {exc})"
        self.display.step_finished(step)

    # --- the steps -----------------------------------------------------------------------

    def _step_start(self, step: StepResult) -> None:
        cluster = self.cluster
        cluster.start_registry()
        cluster.start_router()
        self.observer = Observer(cluster.registry_url, cluster.router_url).start()
        ids = cluster.start_engines(["prefill", "prefill", "decode", "decode"])
        self._wait("every engine routable", lambda m: _routable(m, ids))
        self.traffic = TrafficGenerator(cluster.router_url, model=cluster.config.model,
                                        clients=self.config.clients,
                                        max_tokens=self.config.max_tokens).start()
        self._settle(step)
        step.measures["startup_s"] = time.monotonic() - step.started
        self.display.endpoints(self.endpoints())

    def endpoints(self) -> dict[str, str]:
        cluster = self.cluster
        return {
            "router (OpenAI API)": f"{cluster.router_url}/v1",
            "registry": cluster.registry_address,
            "registry HTTP": f"{cluster.registry_url}/v1/members",
            "dashboard": f"{cluster.registry_url}/",
            "security": cluster.security_summary(),
            "logs": str(cluster.log_dir),
        }

    def _step_scale_up(self, step: StepResult) -> None:
        new_ids = self.cluster.start_engines(["prefill", "decode"])
        self._wait("new engines routable", lambda m: _routable(m, new_ids))
        observer = self._observer()
        for member_id in new_ids:
            self._wait_until(f"{member_id} picked by the router",
                             lambda i=member_id: observer.timeline(i).first_pick_at is not None)
            timeline = observer.timeline(member_id)
            assert timeline.first_pick_at is not None and timeline.routable_at is not None
            delay = max(0.0, timeline.first_pick_at - timeline.routable_at)
            role = member_id.split("-", 1)[0]
            step.measures[f"ready_to_first_request_{role}_s"] = delay
            step.check(f"{member_id} got traffic within {READY_TO_TRAFFIC_LIMIT_S:.0f} s of "
                       "being ready", delay <= READY_TO_TRAFFIC_LIMIT_S, f"{delay:.2f} s")
        self._settle(step)
        self._check_no_failures(step)

    def _step_drain_prefill(self, step: StepResult) -> None:
        victim = self.cluster.engine_ids("prefill")[0]
        observer = self._observer()
        response = httpx.post(f"{self.cluster.registry_url}/v1/members/{victim}/drain",
                              headers=self.cluster.admin_headers, timeout=10.0)
        step.check(f"registry accepted drain of {victim}", response.is_success,
                   f"HTTP {response.status_code}")
        self._wait(f"{victim} draining", lambda m: _state(m, victim) == "draining")
        draining_at = time.monotonic()

        def idle() -> bool:
            timeline = observer.timeline(victim)
            quiet = time.monotonic() - max(timeline.last_pick_at or 0.0, draining_at)
            members = observer.members() or []
            load = next((m["load"] for m in members if m["id"] == victim), None)
            return quiet >= QUIET_S and load is not None and not (load["running"]
                                                                  or load["waiting"])
        self._wait_until(f"{victim} idle", idle)
        last_pick = observer.timeline(victim).last_pick_at or 0.0
        late = max(0.0, last_pick - draining_at)
        step.measures["drain_to_last_request_s"] = late
        step.check(f"router stopped picking {victim} within {DRAIN_PROPAGATION_S:.0f} s",
                   late <= DRAIN_PROPAGATION_S, f"last pick {late:.2f} s after draining")
        managed = self.cluster.retire(victim)
        managed.terminate()
        code = managed.wait(self.cluster.config.drain_timeout_s + 10)
        step.check(f"{victim} exited cleanly", code == 0, f"exit code {code}")
        self._wait(f"{victim} left the registry", lambda m: _absent(m, victim))
        self._settle(step)
        self._check_no_failures(step)

    def _step_kill_decode(self, step: StepResult) -> None:
        victim = self.cluster.engine_ids("decode")[0]
        managed = self.cluster.retire(victim)
        observer = self._observer()
        observer.sample_now()
        migrations_before = observer.migrations()
        # Kill it while it streams to someone: that is what the router must save. It holds
        # a request from the handshake on; one typical TTFT later that request streams.
        observer.wait_in_flight(victim, STREAM_ON_VICTIM_WAIT_S)
        typical = figures(self._records(), self.began, time.monotonic()).ttft_p50_s
        time.sleep(min(typical or 0.0, 1.0))
        kill_at = self.kill_at = time.monotonic()
        managed.kill()
        lease = self.cluster.config.lease_s
        self._wait(f"{victim} expired", lambda m: _absent(m, victim))
        gone_at = observer.timeline(victim).gone_at or time.monotonic()
        step.measures["kill_to_gone_s"] = gone_at - kill_at
        step.check(f"{victim} out of the registry within the lease ({lease:.1f} s)",
                   gone_at - kill_at <= lease + LEASE_MARGIN_S,
                   f"{gone_at - kill_at:.2f} s")
        self._settle(step)
        last_pick = observer.timeline(victim).last_pick_at
        step.measures["kill_to_last_request_s"] = max(0.0, (last_pick or kill_at) - kill_at)
        observer.sample_now()
        migrated = int(observer.migrations() - migrations_before)
        records = self._records()
        in_flight = [r for r in records if r.in_flight_at(kill_at)]
        failed = [r for r in records if not r.ok and r.finished >= kill_at]
        step.measures["in_flight_at_kill_count"] = len(in_flight)
        step.measures["migrated_count"] = migrated
        step.measures["failed_count"] = len(failed)
        step.check("no client request failed", not failed,
                   f"{len(failed)} failed of {len(in_flight)} in flight, {migrated} migrated: "
                   + "; ".join(r.error for r in failed[:3]) if failed else
                   f"{len(in_flight)} in flight at the kill, {migrated} migrated")

    def _step_restart_registry(self, step: StepResult) -> None:
        cluster = self.cluster
        expected = [*cluster.engines]  # member ids that must come back
        stopped_at = time.monotonic()
        cluster.restart_registry()
        restarted_at = time.monotonic()
        step.measures["registry_downtime_s"] = restarted_at - stopped_at
        self._wait("every engine back and routable", lambda m: _routable(m, expected))
        rejoin = time.monotonic() - restarted_at
        step.measures["rejoin_s"] = rejoin
        step.check(f"membership whole again within {REJOIN_LIMIT_S:.0f} s", rejoin <=
                   REJOIN_LIMIT_S, f"{rejoin:.2f} s after the restart")
        self._settle(step)
        self._check_no_failures(step)

    def _step_scale_down(self, step: StepResult) -> None:
        cluster = self.cluster
        victims = [cluster.engine_ids("prefill")[-1], cluster.engine_ids("decode")[-1]]
        observer = self._observer()
        stopping = [(victim, cluster.retire(victim)) for victim in victims]
        term_at = time.monotonic()
        for _, managed in stopping:
            managed.terminate()
        for victim, managed in stopping:
            code = managed.wait(cluster.config.drain_timeout_s + 10)
            step.check(f"{victim} drained and exited cleanly", code == 0, f"exit code {code}")
        self._wait("stopped engines left the registry",
                   lambda m: all(_absent(m, v) for v in victims))
        for victim in victims:
            gone = (observer.timeline(victim).gone_at or time.monotonic()) - term_at
            step.measures[f"sigterm_to_gone_{victim.split('-', 1)[0]}_s"] = gone
        self._settle(step)
        self._check_no_failures(step)

    def _summary(self) -> StepResult:
        step = StepResult("summary", "Summary", started=self.began, finished=time.monotonic())
        records = self._records()
        failed = [r for r in records if not r.ok]
        step.check("no failed request, the kill -9 included", not failed,
                   "; ".join(r.error for r in failed[:3]))
        step.check("every step held", all(r.ok for r in self.results),
                   ", ".join(r.name for r in self.results if not r.ok))
        step.traffic = figures(records, self.began, time.monotonic() + 1)
        step.measures["duration_s"] = step.finished - step.started
        return step

    # --- helpers -------------------------------------------------------------------------

    def _observer(self) -> Observer:
        if self.observer is None:
            raise StepFailed("the cluster is not running")
        return self.observer

    def _records(self) -> list[RequestRecord]:
        return self.traffic.records() if self.traffic is not None else []

    def _wait(self, what: str, predicate: Callable[[Members], bool]) -> None:
        if not self._observer().wait_for(predicate, WAIT_TIMEOUT_S):
            raise StepFailed(f"timed out after {WAIT_TIMEOUT_S:.0f} s waiting for {what}")

    def _wait_until(self, what: str, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise StepFailed(f"timed out after {WAIT_TIMEOUT_S:.0f} s waiting for {what}")
            time.sleep(0.05)

    def _settle(self, step: StepResult) -> None:
        """Keep the traffic going until a few more requests succeed after the action."""
        if self.traffic is not None and not self.traffic.wait_ok(SETTLE_OK_REQUESTS,
                                                                 WAIT_TIMEOUT_S):
            raise StepFailed(f"fewer than {SETTLE_OK_REQUESTS} requests succeeded in "
                             f"{WAIT_TIMEOUT_S:.0f} s")

    def _check_no_failures(self, step: StepResult) -> None:
        failed = [r for r in self._records()
                  if not r.ok and step.started <= r.finished < time.monotonic()]
        step.check("no failed client request", not failed,
                   f"{len(failed)} failed: " + "; ".join(r.error for r in failed[:3])
                   if failed else "")

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
            records = self._records()
            ok = sum(r.ok for r in records)
            roles = routable_roles(self.observer.members() if self.observer else None)
            elapsed = time.monotonic() - step.started if step else 0.0
            self.display.status(
                f"{step.name if step else '-'} {elapsed:5.1f}s | {roles} | "
                f"ok {ok} failed {len(records) - ok}")


def _member(members: Members, member_id: str) -> dict | None:
    return next((m for m in members if m["id"] == member_id), None)


def _routable(members: Members, ids: list[str]) -> bool:
    return all((m := _member(members, i)) is not None and m["routable"] for i in ids)


def _state(members: Members, member_id: str) -> str | None:
    member = _member(members, member_id)
    return member["state"] if member is not None else None


def _absent(members: Members, member_id: str) -> bool:
    return _member(members, member_id) is None
