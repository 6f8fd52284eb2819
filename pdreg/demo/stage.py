"""What the demo's steps share: the cluster and the instruments on it, the step records,
and the waits with deadlines every step uses.

A step is data, `Step(name, title, run)`; `run(stage, result)` acts on the `Stage` and
records its checks and measures in its `StepResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

from pdreg.demo.cluster import Cluster, ClusterConfig
from pdreg.demo.observer import Members, Observer, member
from pdreg.demo.traffic import RequestRecord, TrafficFigures, TrafficGenerator

__all__ = ["Check", "Display", "ScenarioConfig", "Stage", "Step", "StepFailed", "StepResult"]

WAIT_TIMEOUT_S: Final = 60.0  # generous: two loaded cores, torch imports
SETTLE_OK_REQUESTS: Final = 10  # requests that must succeed after each step's action
POLL_S: Final = 0.05


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


class StepFailed(Exception):
    """A step could not go on (a wait timed out); its checks say why."""


class Display(Protocol):
    def step_started(self, index: int, total: int, step: StepResult) -> None: ...
    def step_finished(self, step: StepResult) -> None: ...
    def status(self, text: str) -> None: ...
    def endpoints(self, where: dict[str, str]) -> None: ...


@dataclass(frozen=True, slots=True)
class ScenarioConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    clients: int = 3
    max_tokens: int = 8
    status_period_s: float = 0.5


class Stage:
    """The cluster under test, its traffic and its observer, and the steps' waits."""

    def __init__(self, config: ScenarioConfig, display: Display, cluster: Cluster) -> None:
        self.config = config
        self.display = display
        self.cluster = cluster
        self.traffic: TrafficGenerator | None = None
        self.observer: Observer | None = None
        self.kill_at: float | None = None
        self.began = time.monotonic()

    def watch(self) -> Observer:
        if self.observer is None:
            raise StepFailed("the cluster is not running")
        return self.observer

    def records(self) -> list[RequestRecord]:
        return self.traffic.records() if self.traffic is not None else []

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

    def wait(self, what: str, predicate: Callable[[Members], bool]) -> None:
        """Until the registry's members satisfy `predicate` (StepFailed after the limit)."""
        if not self.watch().wait_for(predicate, WAIT_TIMEOUT_S):
            raise StepFailed(f"timed out after {WAIT_TIMEOUT_S:.0f} s waiting for {what}")

    def wait_until(self, what: str, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise StepFailed(f"timed out after {WAIT_TIMEOUT_S:.0f} s waiting for {what}")
            time.sleep(POLL_S)

    def settle(self) -> None:
        """Keep the traffic going until a few more requests succeed after the action."""
        if self.traffic is not None and not self.traffic.wait_ok(SETTLE_OK_REQUESTS,
                                                                 WAIT_TIMEOUT_S):
            raise StepFailed(f"fewer than {SETTLE_OK_REQUESTS} requests succeeded in "
                             f"{WAIT_TIMEOUT_S:.0f} s")

    def check_no_failures(self, step: StepResult) -> None:
        failed = [r for r in self.records()
                  if not r.ok and step.started <= r.finished < time.monotonic()]
        step.check("no failed client request", not failed,
                   f"{len(failed)} failed: " + "; ".join(r.error for r in failed[:3])
                   if failed else "")


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    title: str
    run: Callable[[Stage, StepResult], None]


def routable(members: Members, ids: list[str]) -> bool:
    return all((m := member(members, i)) is not None and m.routable for i in ids)


def state_of(members: Members, member_id: str) -> str | None:
    seen = member(members, member_id)
    return seen.state if seen is not None else None


def absent(members: Members, member_id: str) -> bool:
    return member(members, member_id) is None
