"""The narrow interfaces a `Proxy` (one request) is handed: what it may ask of the rest.

    PairingPort   choose a pair, hold in-flight slots on it, tell a model it never saw
    OutcomesPort  what a leg showed: its service time, or that its member failed
    RequestRecorder (router/metrics.py)  the request's metrics, through one object

A Proxy sees nothing else of the router: not the membership, the quarantine or the
metrics registry, so neither file imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from router.choice import Affinity
from router.handshakes.catalog import Handshakes
from router.handshakes.exchange import LegFailure
from router.http.upstream import UpstreamPool
from router.inflight import Hold
from router.metrics import RequestRecorder
from router.table import Candidate, Pair

__all__ = ["OutcomesPort", "PairingPort", "ProxyPorts"]


class PairingPort(Protocol):
    def choose(self, model: str, affinity: Affinity, tried: Collection[str], *,
               despite_quarantine: bool = False) -> Pair | None:
        """A pair for the request, none of `tried` if there is another; None if none.
        `despite_quarantine`: a stream under way is better continued on a member that
        failed a moment ago than ended."""

    def hold(self, pair: Pair, ticket: Any = None) -> tuple[Hold, Hold | None]:
        """An in-flight slot on D, and on P unless P is D; with admission's `ticket`,
        they carry the request's budget on the pair."""

    def knows(self, model: str) -> bool:
        """Some member serves or has served `model` (a 503, not a 404, when none can)."""


class OutcomesPort(Protocol):
    def observe_prefill(self, member: Candidate, seconds: float) -> None: ...
    def observe_decode(self, member: Candidate, seconds_per_token: float) -> None: ...
    def observe_cached(self, pair: Pair, reported_tokens: int) -> None:
        """The pair's prefill engine found `reported_tokens` of the prompt cached."""
    def on_failure(self, failure: LegFailure) -> None:
        """Log; quarantine and report the member if it is to blame."""


@dataclass(frozen=True, slots=True)
class ProxyPorts:
    """Everything a Proxy uses, built once when the router's app starts."""

    pairing: PairingPort
    outcomes: OutcomesPort
    record: RequestRecorder
    handshakes: Handshakes
    pool: UpstreamPool
    max_attempts: int
    max_migrations: int
    clock: Callable[[], float]  # time.monotonic: request timings
