"""One planning round: read membership, scrape the routers, decide, publish, call the hook.

    1) Membership -> per (model, role) fleets; the routers to scrape
    2) Scrape every router at once (bounded time), at the /metrics URL it advertises;
       feed the latency and rate windows; each router is read, stale or left out
    3) Per (model, role): hold on bad input, else decide with the pure rule
    4) Publish metrics and the plan; log and count changes; reconcile the --exec hook

Bad input never raises out of a round. A router that cannot be read keeps its last
figures for --router-stale-after, then is left out (planner/freshness.py): the planner
decides from the others. With routers registered and none readable, latency is unknown:
roles may scale up on load, never down. A suspect member holds its role's decision, a
registry that went away holds everything. Each is counted by kind, and the plan and
`pdreg_planner_holding` say so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from planner.freshness import STALE_AFTER_S, Change, RouterFreshness, Standing, can_scale_down
from planner.histogram import Cumulative, Window, quantile
from planner.hook import ExecHook, HookStatus
from planner.inputs import RoleFleet, fleet_of, routers_of
from planner.metrics import PlannerMetrics
from planner.rule import Decision, Planner, RoleSignals, RuleConfig
from planner.scrape import ScrapeError, fetch_metrics, metrics_url, parse_router_metrics
from planner.smoothing import LoadMeans, MeanLoad
from registry.client import LinkState, LinkStatus, LiveMember
from wire.protocol import Role, role_name

__all__ = ["MembershipSource", "Plan", "PlanEntry", "PlannerConfig", "PlanningLoop"]

logger = logging.getLogger(__name__)

MAX_ROUTERS = 256  # scraped per round; more are left out (and counted)


class MembershipSource(Protocol):
    """What the planner needs of `registry.client.MembershipView`."""

    def members(self) -> Mapping[str, LiveMember]: ...
    def links(self) -> list[LinkStatus]: ...


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    rule: RuleConfig = field(default_factory=RuleConfig)
    interval_s: float = 2.0
    load_window_s: float = 10.0  # running/waiting/KV are averaged over this
    latency_quantile: float = 0.9
    default_capacity: int = 0
    scrape_timeout_s: float = 2.0
    router_stale_after_s: float = STALE_AFTER_S  # an unread router's figures count this long
    models: frozenset[str] = frozenset()  # empty: every model
    exec_argv: tuple[str, ...] = ()
    exec_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.latency_quantile < 1:
            raise ValueError("the latency quantile must be between 0 and 1")
        if self.interval_s <= 0 or self.scrape_timeout_s <= 0:
            raise ValueError("the interval and the scrape timeout must be positive")
        if self.router_stale_after_s < 0:
            raise ValueError("the router staleness bound must not be negative")


@dataclass(frozen=True, slots=True)
class PlanEntry:
    decision: Decision
    signals: RoleSignals | None  # None when held before any good input
    hook: HookStatus | None


@dataclass(frozen=True, slots=True)
class Plan:
    entries: tuple[PlanEntry, ...] = ()
    problems: tuple[str, ...] = ()
    updated_at: float = 0.0  # unix time


class PlanningLoop:
    """The round's state (the rule's history, windows, hook). Lives on one event loop."""

    def __init__(self, config: PlannerConfig, view: MembershipSource,
                 metrics: PlannerMetrics | None = None) -> None:
        self.config = config
        self.view = view
        self.planner = Planner(config.rule)
        self.metrics = metrics or PlannerMetrics(config.rule, config.latency_quantile)
        span = config.rule.latency_window_s or config.interval_s
        self.latency = Window(max(span, config.interval_s))
        self.load = LoadMeans(config.load_window_s)
        self.freshness = RouterFreshness(config.router_stale_after_s)
        self.hook = ExecHook(config.exec_argv, config.exec_timeout_s,
                             lambda r: self.metrics.exec_runs.labels(r).inc()) \
            if config.exec_argv else None
        self.plan = Plan()
        self._signals: dict[tuple[str, Role], RoleSignals] = {}
        self._problems: set[str] = set()

    async def tick(self, client: httpx.AsyncClient, now: float,
                   wall_now: float | None = None) -> Plan:
        # 1) Membership
        members = self.view.members()
        fleet = fleet_of(members, default_capacity=self.config.default_capacity,
                         models=self.config.models)
        problems: list[str] = []
        global_hold = ""
        for model, why in sorted(fleet.refused.items()):
            self._error("refused_model", problems, f"model {model!r} not planned: {why}")
        links = self.view.links()
        # SYNCING is a resync in progress (the last view stands); AWAY is silence.
        if links and all(link.state is LinkState.AWAY for link in links):
            global_hold = "every registry is away: the membership may be out of date"
            self._error("registry_away", problems, global_hold)
        else:
            problems.extend(f"registry {link.address}: {link.state.value}, no snapshot yet"
                            for link in links if link.state is LinkState.SYNCING
                            and not link.epoch)

        # 2) Routers
        no_scale_down = await self._read_routers(client, routers_of(members), now, problems)

        # 3) Decide, 4) publish
        entries = []
        for model, roles in sorted(fleet.models.items()):
            for role, role_fleet in roles.items():
                entries.append(self._plan_role(model, role, role_fleet, global_hold, now,
                                               problems, no_scale_down))
        self._forget_gone(set(fleet.models),
                          {(e.decision.model, e.decision.role) for e in entries})
        self.metrics.ticks.inc()
        self._log_problem_changes(problems)
        self.plan = Plan(tuple(entries), tuple(problems),
                         time.time() if wall_now is None else wall_now)
        return self.plan

    async def _read_routers(self, client: httpx.AsyncClient, routers: list[LiveMember],
                            now: float, problems: list[str]) -> str:
        """Scrape every router; classify each (read, stale, left out). Returns why the
        round must not scale down ("" when it may)."""
        if len(routers) > MAX_ROUTERS:
            self._error("too_many_routers", problems,
                        f"{len(routers)} routers; scraping the first {MAX_ROUTERS}")
            routers = routers[:MAX_ROUTERS]
        standings = []
        for router, failure in zip(routers, await self._scrape(client, routers, now),
                                   strict=True):
            key = (router.id, router.record.spec.incarnation)
            standing, change = self.freshness.observe(key, failure is None, now)
            standings.append(standing)
            if failure:
                kind, why = failure
                self._error(kind, problems, f"router {router.id}: {why}")
            if standing is Standing.LEFT_OUT:
                self.latency.forget_source(key)  # decide from the others
            if change is not None:
                self._log_router_change(router.id, change, failure[1] if failure else "")
        self.freshness.forget_except((r.id, r.record.spec.incarnation) for r in routers)
        self.metrics.set_routers(self.freshness.counts())
        self.latency.forget(now)
        if can_scale_down(standings):
            return ""
        why = (f"no router read within {self.freshness.stale_after_s:g} s: the latency "
               "users get is unknown")
        self._error("no_router_readable", problems, why)
        return why

    def _log_router_change(self, router_id: str, change: Change, why: str) -> None:
        unread = "never read" if change.unread_s is None else f"unread for {change.unread_s:.0f}s"
        if change.after is Standing.LEFT_OUT:
            logger.warning("[planner] router left out id=%s (%s, bound %.0fs): deciding from "
                           "the other routers: %s", router_id, unread,
                           self.freshness.stale_after_s, why)
        elif change.after is Standing.STALE:
            logger.info("[planner] router stale id=%s: its last figures count for up to "
                        "%.0fs: %s", router_id, self.freshness.stale_after_s, why)
        else:
            logger.info("[planner] router read again id=%s", router_id)

    def _plan_role(self, model: str, role: Role, fleet: RoleFleet, global_hold: str,
                   now: float, problems: list[str], no_scale_down: str = "") -> PlanEntry:
        key = (model, role)
        hold = global_hold
        if fleet.unsure:
            self._error("suspect_member", problems,
                        f"{', '.join(fleet.unsure)}: heartbeats late, load unknown")
            hold = hold or f"{fleet.unsure[0]} is suspect: its load is unknown"
        previous = self.planner.last(model, role)
        signals: RoleSignals | None
        if hold:
            decision = self.planner.hold(model, role, fleet.replicas, hold, now)
            signals = self._signals.get(key)
        else:
            signals = self._signals_for(model, role, fleet, now)
            self._signals[key] = signals
            decision = self.planner.decide(model, role, signals, now,
                                           no_scale_down=no_scale_down)
        self.metrics.publish(decision, None if hold else signals)
        if previous is None or previous.desired != decision.desired:
            direction = ("up" if previous is None or decision.desired > previous.desired
                         else "down")
            if previous is not None:
                self.metrics.decisions.labels(model, role_name(role), direction,
                                              decision.reason.value).inc()
            logger.info("[planner] decide model=%s role=%s now=%d desired=%d reason=%s: %s",
                        model, role_name(role), decision.current, decision.desired,
                        decision.reason.value, decision.why)
        hook_status = None
        if self.hook is not None:
            self.hook.reconcile(model, role_name(role), decision.desired, fleet.replicas)
            hook_status = self.hook.status(model, role_name(role))
        return PlanEntry(decision, signals, hook_status)

    def _signals_for(self, model: str, role: Role, fleet: RoleFleet, now: float
                     ) -> RoleSignals:
        q = self.config.latency_quantile
        load = self.load.add((model, role), MeanLoad(fleet.running, fleet.waiting,
                                                     fleet.kv_usage), now)
        ttft = self.latency.delta(("ttft", model), now)
        itl = self.latency.delta(("itl", model), now)
        itl_sum = self.latency.delta(("itl_sum", model), now)
        requests = self.latency.delta(("requests", model), now)
        queue_wait = self.latency.delta(("queue_wait", model), now)
        return RoleSignals(
            replicas=fleet.replicas, running=load.running, waiting=load.waiting,
            capacity=fleet.capacity, kv_usage=load.kv_usage,
            ttft_s=quantile(ttft[0], q) if ttft else None,
            # ITL: the mean gap, i.e. the time per output token (as Dynamo's planner and
            # DistServe's TPOT): single gaps jitter, a stream's pace is what users see.
            itl_s=(itl_sum[0].total / itl[0].total
                   if itl and itl_sum and itl[0].total > 0 else None),
            request_rate=requests[0].total / requests[1] if requests else None,
            queue_wait_s=quantile(queue_wait[0], q) if queue_wait else None)

    async def _scrape(self, client: httpx.AsyncClient, routers: list[LiveMember],
                      now: float) -> list[tuple[str, str] | None]:
        async def one(router: LiveMember) -> tuple[str, str] | None:
            source = (router.id, router.record.spec.incarnation)
            try:
                url = metrics_url(router.record.spec.endpoints)
                text = await asyncio.wait_for(fetch_metrics(client, url),
                                              self.config.scrape_timeout_s)
            except (ScrapeError, TimeoutError) as exc:
                return "router_unreachable", str(exc) or "timed out"
            try:
                figures = parse_router_metrics(text)
            except ScrapeError as exc:
                return "router_bad_metrics", str(exc)
            for model, histogram in figures.ttft.items():
                self.latency.add(source, ("ttft", model), histogram, now)
            for model, histogram in figures.itl.items():
                self.latency.add(source, ("itl", model), histogram, now)
            for model, seconds in figures.itl_sum.items():
                self.latency.add(source, ("itl_sum", model), Cumulative.counter(seconds), now)
            for model, histogram in figures.queue_wait.items():
                self.latency.add(source, ("queue_wait", model), histogram, now)
            for model, count in figures.requests.items():
                self.latency.add(source, ("requests", model), Cumulative.counter(count), now)
            return None

        return list(await asyncio.gather(*(one(r) for r in routers)))

    def _log_problem_changes(self, problems: list[str]) -> None:
        """A problem is logged when it starts and when it ends, not every round."""
        now_seen = set(problems)
        for text in sorted(now_seen - self._problems):
            logger.warning("[planner] bad input (holding where it matters): %s", text)
        for text in sorted(self._problems - now_seen):
            logger.info("[planner] resolved: %s", text)
        self._problems = now_seen

    def _error(self, kind: str, problems: list[str], text: str) -> None:
        self.metrics.input_errors.labels(kind).inc()
        problems.append(text)
        logger.debug("[planner] input problem kind=%s: %s", kind, text)

    def _forget_gone(self, models: set[str], keys: set[tuple[str, Role]]) -> None:
        for model, role in self.planner.planned():
            if (model, role) not in keys:
                self.planner.forget(model, role)
                self._signals.pop((model, role), None)
                self.load.forget((model, role))
                if self.hook is not None:
                    self.hook.forget(model, role_name(role))
        self.metrics.forget_models(models)
