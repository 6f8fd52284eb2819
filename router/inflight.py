"""The router's own count of requests it has open on each member.

Pairing reads the counts (a member's reported load lags by a heartbeat; this does not).
A `Hold` is one slot on one member: a context manager whose `release()` may also come
early (a prefill's part is done once its decode has answered) and is safe twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.metrics import SeriesOf

__all__ = ["Hold", "InFlight"]


class InFlight:
    """member id -> open requests, mirrored in the `pdreg_router_in_flight` gauge.

    One event-loop thread uses it; no locks.
    """

    def __init__(self, gauge_of: SeriesOf) -> None:
        self._counts: dict[str, int] = {}
        self._gauge_of = gauge_of

    @property
    def counts(self) -> Mapping[str, int]:
        return self._counts

    def total(self) -> int:
        return sum(self._counts.values())

    def hold(self, member_id: str, also: Callable[[], None] | None = None) -> Hold:
        """`also`: called once when the hold is released (admission's budget grant)."""
        self._counts[member_id] = self._counts.get(member_id, 0) + 1
        gauge = self._gauge_of(member_id)
        gauge.inc()
        return Hold(self, member_id, gauge, also)

    def _release(self, member_id: str, gauge: Any) -> None:
        count = self._counts.get(member_id, 0) - 1
        if count > 0:
            self._counts[member_id] = count
        else:
            self._counts.pop(member_id, None)
        gauge.dec()


class Hold:
    __slots__ = ("_also", "_gauge", "_in_flight", "_member_id")

    def __init__(self, in_flight: InFlight, member_id: str, gauge: Any,
                 also: Callable[[], None] | None = None) -> None:
        self._in_flight: InFlight | None = in_flight
        self._member_id = member_id
        self._gauge = gauge
        self._also = also

    def release(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight._release(self._member_id, self._gauge)
            if self._also is not None:
                self._also()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
