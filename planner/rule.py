"""The planning rule: how many replicas one (model, role) should have. Pure: no IO, and
the clock is a parameter.

Every tick, per (model, role):

1. Each signal votes a replica count the way Kubernetes' HPA does: ratio = observed /
   target; inside the tolerance band (|ratio - 1| <= tolerance) the vote is the current
   count, otherwise ceil(current * ratio).
   - utilization  (running + waiting) / capacity against the target; up and down.
   - kv_usage     decodes: mean KV use against the target; up and down.
   - queue        only where no member declares a capacity: waiting per replica against
                  the target; up only (an empty queue says nothing about how few suffice).
   - queue_wait   the routers' admission queue wait quantile against its target: up
                  only, like a latency vote; the prefills' (admission budgets their
                  uncached tokens), the decodes' when their KV is at target: requests
                  wait in the router before any engine queue grows, so this comes first.
   - ttft, itl    the routers' TTFT quantile and mean ITL against the SLOs; up only, at
                  most doubling per vote, and only the role at fault. TTFT is the fault
                  of the role that queues; ITL the decodes', when their batches are not
                  small (at least half the target utilization or KV use: a small batch
                  runs no faster on more replicas). Not at fault: the vote only refuses
                  to scale down. After a change of replica count, latency votes wait one
                  latency window: the figures still describe the old fleet.
2. The recommendation is the highest vote, raised to the SLO floor (a count that missed
   the SLO within `slo_memory_s` at this request rate or a higher one is not chosen
   again: no scale-down into a known breach, so no flapping), clamped to [min, max].
3. Stabilization, HPA's behaviour, from the count last asked for (engines asked for
   are not up yet): scale up only to the lowest recommendation of the last up-window,
   down only to the highest of the last down-window. A spike shorter than the up-window
   scales nothing up; a lull shorter than the down-window scales nothing down.
4. When the caller says the inputs cannot justify a scale-down (no router readable:
   latency unknown), the count may rise but not fall below the one last asked for.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from wire.protocol import Role, role_name

__all__ = ["Bounds", "Decision", "Planner", "Reason", "RoleSignals", "RuleConfig"]

# ceil(3 * (2/3)) must be 2, not 3: float ratios land a hair above whole numbers.
CEIL_SLACK = 1e-9
MAX_LATENCY_STEP = 2.0  # a latency vote at most doubles the count (it lags, and overshoots)


class Reason(enum.StrEnum):
    """Why a decision is what it is (a metric label: a small fixed set)."""

    UTILIZATION = "utilization"
    KV_USAGE = "kv_usage"
    QUEUE = "queue"
    QUEUE_WAIT = "queue_wait"
    TTFT = "ttft"
    ITL = "itl"
    SLO_FLOOR = "slo_floor"
    STEADY = "steady"  # the highest vote is the current count (within tolerance, or ceil)
    NO_SIGNAL = "no_signal"  # nothing to go by (no capacity, no latency): keep the count
    EMPTY = "empty"  # no member of the role: start the minimum (at least one)
    MIN = "min"
    MAX = "max"
    STABILIZING = "stabilizing"  # a window holds the change back
    HOLD = "hold"  # bad input: the last decision stands


_LATENCY = frozenset({Reason.TTFT, Reason.ITL, Reason.QUEUE_WAIT})


@dataclass(frozen=True, slots=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replica bounds need 0 <= min ({self.min_replicas}) <= max "
                             f"({self.max_replicas})")


@dataclass(frozen=True, slots=True)
class RuleConfig:
    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.05
    target_utilization: float = 0.7  # (running + waiting) / capacity
    target_kv_usage: float = 0.7  # decodes' mean KV use, 0..1
    target_queue: float = 2.0  # waiting per replica, used when no capacity is declared
    target_queue_wait_s: float = 0.25  # the routers' admission queue wait quantile
    tolerance: float = 0.1  # HPA's default
    scale_up_window_s: float = 0.0  # HPA's default
    scale_down_window_s: float = 300.0  # HPA's default
    latency_window_s: float = 30.0  # how far back the latency quantile looks
    slo_memory_s: float = 600.0  # how long a count that missed the SLO is avoided
    prefill: Bounds = field(default_factory=Bounds)
    decode: Bounds = field(default_factory=Bounds)

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "itl_slo_s", "target_utilization", "target_kv_usage",
                     "target_queue", "target_queue_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("tolerance", "scale_up_window_s", "scale_down_window_s",
                     "latency_window_s", "slo_memory_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative")

    def bounds(self, role: Role) -> Bounds:
        return self.prefill if role is Role.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class RoleSignals:
    """What the planner knows about one (model, role) at one moment."""

    replicas: int  # members now: joining or ready, not draining
    running: float = 0.0  # summed over those members (averaged over the load window)
    waiting: float = 0.0
    capacity: int = 0  # summed declared capacity; 0 = nobody declared one
    kv_usage: float = 0.0  # mean over those members, 0..1
    ttft_s: float | None = None  # the model's TTFT quantile over the latency window
    itl_s: float | None = None  # the model's mean inter-token latency
    request_rate: float | None = None  # requests/s reaching the model's routers
    queue_wait_s: float | None = None  # the routers' admission queue wait quantile

    @property
    def utilization(self) -> float | None:
        return (self.running + self.waiting) / self.capacity if self.capacity else None

    @property
    def queueing(self) -> bool:
        """Requests wait for this role, or it is full."""
        utilization = self.utilization
        return self.waiting > 0 or (utilization is not None and utilization >= 1.0)


@dataclass(frozen=True, slots=True)
class Decision:
    model: str
    role: Role
    current: int
    desired: int
    recommended: int  # before stabilization
    reason: Reason
    why: str
    at: float  # the clock the rule was given
    holding: bool = False

    @property
    def role_name(self) -> str:
        return role_name(self.role)


@dataclass(frozen=True, slots=True)
class _Vote:
    count: int
    reason: Reason
    why: str
    slo_breach: bool = False  # a latency vote to scale up: remembered for the SLO floor


@dataclass
class _RoleState:
    """History for one (model, role): what stabilization and the SLO floor look back on."""

    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    breaches: deque[tuple[float, int, float]] = field(default_factory=deque)  # t, n, rate
    replicas: int = -1
    replicas_changed_at: float = -math.inf
    last: Decision | None = None


class Planner:
    """The rule plus the history it needs, per (model, role). Not thread-safe: one caller."""

    def __init__(self, config: RuleConfig) -> None:
        self.config = config
        self._states: dict[tuple[str, Role], _RoleState] = {}

    def last(self, model: str, role: Role) -> Decision | None:
        state = self._states.get((model, role))
        return state.last if state is not None else None

    def forget(self, model: str, role: Role) -> None:
        self._states.pop((model, role), None)

    def planned(self) -> list[tuple[str, Role]]:
        return list(self._states)

    def hold(self, model: str, role: Role, current: int, why: str, now: float) -> Decision:
        """Bad input: keep the last decision (or the current count if there is none)."""
        state = self._states.setdefault((model, role), _RoleState())
        last = state.last
        desired = last.desired if last is not None else current
        decision = Decision(model, role, current, desired, desired, Reason.HOLD,
                            f"holding {desired}: {why}", now, holding=True)
        state.last = decision
        return decision

    def decide(self, model: str, role: Role, signals: RoleSignals, now: float, *,
               no_scale_down: str = "") -> Decision:
        """The rule. `no_scale_down`: why the inputs cannot justify fewer replicas (the
        routers' latency is unknown); then the count may rise, never fall below the one
        last asked for, and the decision says it is holding."""
        cfg = self.config
        bounds = cfg.bounds(role)
        state = self._states.setdefault((model, role), _RoleState())
        current = signals.replicas
        if current != state.replicas:
            if state.replicas >= 0:
                state.replicas_changed_at = now
            state.replicas = current
        _forget_old(state, cfg, now)

        vote = self._recommend(role, signals, state, now)
        recommended, reason, why = vote.count, vote.reason, vote.why
        if vote.slo_breach and signals.request_rate is not None:
            state.breaches.append((now, current, signals.request_rate))
        floor = _slo_floor(state, signals.request_rate, cfg.tolerance)
        if floor > recommended:
            recommended, reason = floor, Reason.SLO_FLOOR
            why = f"{floor - 1} missed the SLO at this request rate lately ({why})"
        if recommended < bounds.min_replicas:
            recommended, reason = bounds.min_replicas, Reason.MIN
            why = f"minimum {bounds.min_replicas} ({why})"
        elif recommended > bounds.max_replicas:
            recommended, reason = bounds.max_replicas, Reason.MAX
            why = f"maximum {bounds.max_replicas} ({why})"

        state.recommendations.append((now, recommended))
        # What was asked last, not what is up: engines asked for take a while to
        # register, and a recommendation that dips meanwhile must not undo the request
        # (HPA stabilizes from the scale target's spec.replicas, not its ready pods).
        asked = state.last.desired if state.last is not None else current
        desired = _stabilize(state, cfg, asked, recommended, now)
        if desired != recommended:
            direction = "up" if recommended > asked else "down"
            window = cfg.scale_up_window_s if direction == "up" else cfg.scale_down_window_s
            why = (f"{why}; scale-{direction} window ({window:g} s) keeps {desired}")
            reason = Reason.STABILIZING
        holding = False
        if no_scale_down and desired < asked:
            why = (f"holding {asked}, no scale-down: {no_scale_down} (the rule says "
                   f"{desired}: {why})")
            desired, reason, holding = asked, Reason.HOLD, True
        decision = Decision(model, role, current, desired, recommended, reason, why, now,
                            holding=holding)
        state.last = decision
        return decision

    # --- votes ----------------------------------------------------------------------------

    def _recommend(self, role: Role, s: RoleSignals, state: _RoleState, now: float) -> _Vote:
        if s.replicas == 0:
            return _Vote(1, Reason.EMPTY, f"no {role_name(role)} running")
        votes = [v for v in self._votes(role, s, state, now) if v is not None]
        if not votes:
            return _Vote(s.replicas, Reason.NO_SIGNAL,
                         "no declared capacity and no latency yet: keep the count")
        # Ties go to a latency vote: its reason says more than "steady".
        best = max(votes, key=lambda v: (v.count, v.reason in _LATENCY))
        if best.count == s.replicas and best.reason not in _LATENCY:
            return _Vote(best.count, Reason.STEADY,
                         f"keep {best.count}: {best.why}")
        return best

    def _votes(self, role: Role, s: RoleSignals, state: _RoleState,
               now: float) -> list[_Vote | None]:
        cfg = self.config
        current = s.replicas
        votes: list[_Vote | None] = []
        utilization = s.utilization
        if utilization is not None:
            count = _hpa(current, utilization / cfg.target_utilization, cfg.tolerance)
            votes.append(_Vote(count, Reason.UTILIZATION,
                               f"utilization {utilization:.2f} (running {s.running:.3g} + "
                               f"waiting {s.waiting:.3g} of capacity {s.capacity}) vs target "
                               f"{cfg.target_utilization:.2f} -> {count}"))
        elif s.waiting:
            per_replica = s.waiting / current
            count = max(current, _hpa(current, per_replica / cfg.target_queue, cfg.tolerance))
            votes.append(_Vote(count, Reason.QUEUE,
                               f"{per_replica:.1f} waiting per replica vs target "
                               f"{cfg.target_queue:g} (no declared capacity) -> {count}"))
        if role is Role.DECODE:
            count = _hpa(current, s.kv_usage / cfg.target_kv_usage, cfg.tolerance)
            votes.append(_Vote(count, Reason.KV_USAGE,
                               f"KV {s.kv_usage:.0%} vs target {cfg.target_kv_usage:.0%} "
                               f"-> {count}"))
        settled = now - state.replicas_changed_at >= cfg.latency_window_s
        budget_bound = role is Role.PREFILL or s.kv_usage >= cfg.target_kv_usage
        votes.append(_latency_vote(Reason.QUEUE_WAIT, s.queue_wait_s, cfg.target_queue_wait_s,
                                   current, budget_bound, settled, role, cfg.tolerance))
        votes.append(_latency_vote(Reason.TTFT, s.ttft_s, cfg.ttft_slo_s, current,
                                   s.queueing, settled, role, cfg.tolerance))
        if role is Role.DECODE:
            batches_not_small = s.queueing or s.kv_usage >= cfg.target_kv_usage / 2 or (
                utilization is not None and utilization >= cfg.target_utilization / 2)
            votes.append(_latency_vote(Reason.ITL, s.itl_s, cfg.itl_slo_s, current,
                                       batches_not_small, settled, role, cfg.tolerance))
        return votes


def _hpa(current: int, ratio: float, tolerance: float) -> int:
    if abs(ratio - 1.0) <= tolerance:
        return current
    return max(0, math.ceil(current * ratio - CEIL_SLACK))


def _latency_vote(reason: Reason, observed: float | None, slo: float, current: int,
                  at_fault: bool, settled: bool, role: Role, tolerance: float
                  ) -> _Vote | None:
    if observed is None:
        return None
    ratio = observed / slo
    if ratio <= 1.0 + tolerance:
        return None
    name = reason.value.upper()
    what = f"{name} {observed * 1e3:.0f} ms over the {slo * 1e3:.0f} ms " + (
        "target" if reason is Reason.QUEUE_WAIT else "SLO")
    if not at_fault:
        why = {Reason.TTFT: "no {} queues", Reason.ITL: "{} batches are small",
               Reason.QUEUE_WAIT: "{} KV is below target"}[reason]
        return _Vote(current, reason, f"{what}, but {why.format(role_name(role))}: "
                                      "no scale-down")
    if not settled:
        return _Vote(current, reason, f"{what}; the count changed within the latency "
                                      "window: waiting for fresh figures")
    count = max(current + 1, math.ceil(current * min(ratio, MAX_LATENCY_STEP) - CEIL_SLACK))
    return _Vote(count, reason, f"{what} -> {count}", slo_breach=True)


def _slo_floor(state: _RoleState, rate: float | None, tolerance: float) -> int:
    """One more than the largest count that missed the SLO at this rate or a lower one."""
    if rate is None:
        return 0
    missed = [n for _, n, r in state.breaches if rate >= r * (1.0 - tolerance)]
    return max(missed) + 1 if missed else 0


def _forget_old(state: _RoleState, cfg: RuleConfig, now: float) -> None:
    keep_s = max(cfg.scale_up_window_s, cfg.scale_down_window_s)
    while state.recommendations and state.recommendations[0][0] < now - keep_s:
        state.recommendations.popleft()
    while state.breaches and state.breaches[0][0] < now - cfg.slo_memory_s:
        state.breaches.popleft()


def _stabilize(state: _RoleState, cfg: RuleConfig, asked: int, recommended: int,
               now: float) -> int:
    """HPA's stabilizeRecommendationWithBehaviors: from the count last asked for, up to
    the up-window's lowest recommendation, down to the down-window's highest;
    `recommended` is already in the history."""
    up = min((n for t, n in state.recommendations if t >= now - cfg.scale_up_window_s),
             default=recommended)
    down = max((n for t, n in state.recommendations if t >= now - cfg.scale_down_window_s),
               default=recommended)
    return min(max(asked, up), down)
