"""The outcomes port: what the legs of a request showed, fed back into pairing.

A leg's service time feeds the latency tracker (when the policy reads it); the prompt
tokens a prefill's engine reports it found cached go to the `kv` policy, which checks them
against the pair's prediction (router/kv/trust.py); a failed leg
is logged, and when its member is to blame, quarantined here and reported to the
registries (router/ports.py: `OutcomesPort`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

from router.handshakes.exchange import LegFailure
from router.latency import LatencyTracker
from router.metrics import SeriesOf
from router.pairing import MembershipSource
from router.policies import DECODE_ROLE, PREFILL_ROLE
from router.quarantine import Quarantine
from router.table import Candidate, Pair

__all__ = ["Outcomes"]

logger = logging.getLogger(__name__)

MAX_PROBLEM_CHARS: Final = 200  # a report's text, as the registry bounds it
# Failures kept local: a slow engine is not a dead one, and a hung one stops heartbeating,
# which the registry sees for itself. Reporting them would make a loaded fleet suspect.
_NOT_REPORTED: Final = frozenset({"idle_timeout", "first_byte_timeout"})


class Outcomes:
    def __init__(self, view: MembershipSource, quarantine: Quarantine,
                 latency: LatencyTracker | None, quarantines_of: SeriesOf,
                 clock: Callable[[], float], *,
                 on_cached: Callable[[Pair, int], None] | None = None) -> None:
        """`latency`: the tracker the policy reads, None if it reads none. `on_cached`:
        who checks engines' reported cached tokens (the `kv` policy), None if nobody."""
        self._on_cached = on_cached
        self._view = view
        self._quarantine = quarantine
        self._latency = latency
        self._quarantines_of = quarantines_of
        self._clock = clock

    def observe_prefill(self, member: Candidate, seconds: float) -> None:
        if self._latency is not None:
            self._latency.observe(PREFILL_ROLE, member.id, member.incarnation, seconds,
                                  self._clock())

    def observe_decode(self, member: Candidate, seconds_per_token: float) -> None:
        if self._latency is not None:
            self._latency.observe(DECODE_ROLE, member.id, member.incarnation,
                                  seconds_per_token, self._clock())

    def observe_cached(self, pair: Pair, reported_tokens: int) -> None:
        if self._on_cached is not None:
            self._on_cached(pair, reported_tokens)

    def on_failure(self, failure: LegFailure) -> None:
        member = failure.member
        logger.warning("[router] leg failed role=%s id=%s kind=%s: %s", failure.role,
                       member.id, failure.kind, failure.reason)
        if not failure.quarantine:
            return
        if not self._quarantine.add(member.id, member.incarnation, self._clock()):
            return
        self._quarantines_of(member.id).inc()
        if failure.kind in _NOT_REPORTED:
            return
        problem = f"{failure.role}: {failure.kind}"[:MAX_PROBLEM_CHARS]
        try:
            self._view.report(member.id, member.incarnation, problem)
        except Exception:  # a registry that is away must not break request handling
            logger.exception("[router] report to registry failed id=%s", member.id)
