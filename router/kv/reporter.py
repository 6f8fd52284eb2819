"""Tell the registries what this router's KV index holds per member, so that `pdreg
status` and the dashboard show it (registry/kv_reports.py keeps and shows it).

Reads what `/v1/kv` serves (`KvRouting.status`, from the snapshot the index's writer
publishes) once per heartbeat interval and hands a
`KvIndexReport`'s entries to the router's agent, which sends them over its authenticated
control link (one report per registry and interval; `Agent.report_kv`). Never through the
registry's PUB stream, and nothing here changes membership.

What goes out per tick (`KvReportPlan`, pure):
- changes: a member whose state changed, whose blocks moved to another quarter-octave
  bucket (~19%), or whose event lag moved to another half-decade bucket (100 ms, 316 ms,
  1 s, ...), and a member no longer followed (GONE). A busy engine's blocks move every
  batch; only a bucket change is news for an operator.
- a rolling refresh: 1/REFRESH_TICKS of the members each tick, at most
  REFRESH_MAX_PER_TICK, so every member is restated every REFRESH_TICKS ticks (30 s at
  the default 1 s interval; members/100 ticks beyond 3,000 members, so that what 100
  routers cost the registry stays bounded) with the load spread evenly. It heals whatever
  a registry lost: a refused or lost report, a registry restart, figures that moved
  within a bucket.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Protocol

from wire.protocol import MAX_KV_BLOCKS, MAX_KV_LAG_MS, KvIndexEntry, KvIndexState

__all__ = ["REFRESH_MAX_PER_TICK", "REFRESH_TICKS", "KvReportPlan", "KvReporter", "ReportSink",
           "entries_of"]

logger = logging.getLogger(__name__)

REFRESH_TICKS: Final = 30  # every member restated once per this many ticks...
REFRESH_MAX_PER_TICK: Final = 100  # ... or slower: at most this many restated per tick
BLOCK_BUCKETS_PER_OCTAVE: Final = 4  # blocks: a change of ~19% is news
LAG_FLOOR_MS: Final = 100  # lags below this are all "live enough"
LAG_BUCKETS_PER_DECADE: Final = 2  # above it: 100 ms, 316 ms, 1 s, 3.2 s, ...
MIN_PERIOD_S: Final = 0.05  # a registry cannot make this thread spin

_Key = tuple[int, KvIndexState, int, int]  # (incarnation, state, blocks bucket, lag bucket)


def blocks_bucket(blocks: int) -> int:
    return 0 if blocks <= 0 else 1 + int(BLOCK_BUCKETS_PER_OCTAVE * math.log2(blocks))


def lag_bucket(lag_ms: int) -> int:
    if lag_ms < LAG_FLOOR_MS:
        return 0
    return 1 + int(LAG_BUCKETS_PER_DECADE * math.log10(lag_ms / LAG_FLOOR_MS))


def _key(entry: KvIndexEntry) -> _Key:
    return (entry.incarnation, entry.state, blocks_bucket(entry.blocks),
            lag_bucket(entry.lag_ms))


def entries_of(status: Iterable[Mapping[str, Any]]) -> list[KvIndexEntry]:
    """`KvRouting.status()` rows (what /v1/kv serves) as report entries."""
    entries = []
    for row in status:
        try:
            state = KvIndexState[str(row["state"]).upper()]
        except KeyError:
            continue  # a state this registry protocol has no name for: not reported
        lag_s = row.get("lag_s")
        lag_ms = 0 if lag_s is None else min(MAX_KV_LAG_MS, max(0, round(lag_s * 1000)))
        entries.append(KvIndexEntry(member_id=row["id"], incarnation=row["incarnation"],
                                    state=state,
                                    blocks=min(MAX_KV_BLOCKS, max(0, int(row["blocks"]))),
                                    lag_ms=lag_ms))
    return entries


class KvReportPlan:
    """What to send each tick: changes (by bucket), GONE, and a refresh slice. Pure."""

    def __init__(self, refresh_ticks: int = REFRESH_TICKS) -> None:
        self.refresh_ticks = max(1, refresh_ticks)
        self._sent: dict[str, _Key] = {}  # member id -> what the registries were told
        self._cursor = 0  # where the rolling refresh goes on, in member id order

    def next(self, current: list[KvIndexEntry]) -> list[KvIndexEntry]:
        by_id = {entry.member_id: entry for entry in current}
        report = [entry for entry in current if self._sent.get(entry.member_id) != _key(entry)]
        changed = {entry.member_id for entry in report}
        for member_id in [m for m in self._sent if m not in by_id]:
            incarnation = self._sent.pop(member_id)[0]
            report.append(KvIndexEntry(member_id, incarnation, KvIndexState.GONE))
        ids = sorted(by_id)
        if ids:
            share = min(REFRESH_MAX_PER_TICK, math.ceil(len(ids) / self.refresh_ticks))
            start = self._cursor % len(ids)
            for member_id in (ids[(start + i) % len(ids)] for i in range(share)):
                if member_id not in changed:
                    report.append(by_id[member_id])
            self._cursor = start + share
        for member_id in changed:
            self._sent[member_id] = _key(by_id[member_id])
        return report


class ReportSink(Protocol):
    """What the reporter needs of the router's agent (`engine_agent.agent.Agent`)."""

    @property
    def heartbeat_interval_s(self) -> float: ...
    def report_kv(self, entries: list[KvIndexEntry]) -> bool: ...


class KvReporter:
    """A daemon thread: each tick, the index's rows -> `KvReportPlan` -> `send`.

    `send` is `Agent.report_kv`: it never blocks, and answers False once the agent is
    stopping, which ends this thread too. `period_s` is read each tick (the registries'
    heartbeat interval, which they may change). `close()` is safe twice.
    """

    def __init__(self, status: Callable[[float], list[dict[str, Any]]],
                 send: Callable[[list[KvIndexEntry]], bool], period_s: Callable[[], float],
                 *, refresh_ticks: int = REFRESH_TICKS) -> None:
        self._status = status
        self._send = send
        self._period_s = period_s
        self._plan = KvReportPlan(refresh_ticks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdreg-kv-reporter",
                                        daemon=True)

    @classmethod
    def start_for(cls, kv: Any, agent: ReportSink) -> KvReporter | None:
        """Started for a router with a KV index (`Router.kv`, `--policy kv`: anything with
        `status(now_wall)`), reporting through its agent; None without an index."""
        if kv is None:
            return None
        return cls(kv.status, agent.report_kv, lambda: agent.heartbeat_interval_s).start()

    def start(self) -> KvReporter:
        self._thread.start()
        return self

    def tick(self) -> bool:
        """One report; False once `send` says the agent stopped. `status` reads the
        index's published snapshot (router/kv/index.py), never the feed's live table."""
        return self._send(self._plan.next(entries_of(self._status(time.time()))))

    def _run(self) -> None:
        while not self._stop.wait(max(MIN_PERIOD_S, self._period_s())):
            try:
                if not self.tick():
                    return
            except Exception:  # one bad tick must not end the reports
                logger.exception("[kv] reporting the index to the registry failed; "
                                 "continuing")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
