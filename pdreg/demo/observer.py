"""Timelines of each member, sampled from the registry's HTTP and the router's /metrics.

Every `period_s` the observer reads `GET /v1/members` (what the registry holds) and the
router's /metrics: `pdreg_router_picks_total` (how often the router chose each member) and
`pdreg_router_migrations_total` (streams continued on a new pair). It keeps, per member
id: when it was first routable, when the router first and last picked it, and when it
left the registry. The scenario asks it questions; nothing here judges.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx
import msgspec

logger = logging.getLogger(__name__)

SAMPLE_PERIOD_S = 0.1
HTTP_TIMEOUT_S = 2.0
_PICKS = re.compile(r'^pdreg_router_picks_total\{member="([^"]+)",role="[^"]*"\} (\S+)$')
_MIGRATIONS = re.compile(r'^pdreg_router_migrations_total\{reason="[^"]*"\} (\S+)$')
_IN_FLIGHT = re.compile(r'^pdreg_router_in_flight\{member="([^"]+)"\} (\S+)$')



class SeenLoad(msgspec.Struct, frozen=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


class SeenMember(msgspec.Struct, frozen=True):
    """A member as `GET /v1/members` shows it: the fields the demo reads (others ignored)."""

    id: str
    role: str
    state: str
    routable: bool = False
    load: SeenLoad = SeenLoad()


Members = list[SeenMember]
_members_json = msgspec.json.Decoder(Members)


def member(members: Members, member_id: str) -> SeenMember | None:
    return next((m for m in members if m.id == member_id), None)


@dataclass(frozen=True, slots=True)
class MemberTimeline:
    id: str
    routable_at: float | None = None  # time.monotonic() of the first routable sample
    gone_at: float | None = None  # first sample without it (cleared if it comes back)
    picks: float = 0.0
    first_pick_at: float | None = None
    last_pick_at: float | None = None  # the sample where the count last grew


def parse_picks(metrics_text: str) -> dict[str, float]:
    picks: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _PICKS.match(line)
        if match:
            picks[match.group(1)] = picks.get(match.group(1), 0.0) + float(match.group(2))
    return picks


def routable_roles(members: Members | None) -> str:
    """'routable 2P+2D' for a status line ('registry away' without a sample)."""
    if members is None:
        return "registry away"
    count = {role: sum(1 for m in members if m.routable and m.role == role)
             for role in ("prefill", "decode")}
    return f"routable {count['prefill']}P+{count['decode']}D"


def parse_migrations(metrics_text: str) -> float:
    """Streams the router continued on a new pair, all reasons together."""
    return sum(float(m.group(1)) for line in metrics_text.splitlines()
               if (m := _MIGRATIONS.match(line)))


class Observer:
    def __init__(self, registry_url: str, router_url: str,
                 period_s: float = SAMPLE_PERIOD_S) -> None:
        self.registry_url = registry_url
        self.router_url = router_url
        self.period_s = period_s
        self._timelines: dict[str, MemberTimeline] = {}
        self._members: Members | None = None  # None while the registry does not answer
        self._migrations = 0.0
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Observer:
        self._thread = threading.Thread(target=self._run, name="demo-observer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)

    # --- questions (any thread) --------------------------------------------------------

    def timeline(self, member_id: str) -> MemberTimeline:
        with self._changed:
            return self._timelines.get(member_id) or MemberTimeline(member_id)

    def members(self) -> Members | None:
        return self._members

    def migrations(self) -> float:
        """pdreg_router_migrations_total at the last sample (all reasons)."""
        return self._migrations

    def in_flight(self) -> dict[str, float]:
        """The router's open requests per member, now (empty if it does not answer)."""
        try:
            text = httpx.get(f"{self.router_url}/metrics", timeout=HTTP_TIMEOUT_S).text
        except httpx.HTTPError:
            return {}
        return {m.group(1): float(m.group(2)) for line in text.splitlines()
                if (m := _IN_FLIGHT.match(line))}

    def sample_now(self) -> None:
        """Take a sample at once (e.g. right before an action, to count from it)."""
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as http:
            self._sample(http, time.monotonic())

    def wait_for(self, predicate: Callable[[Members], bool], timeout_s: float) -> bool:
        """Block until predicate(registry members) holds on a fresh sample, or timeout."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                members = self._members
                if members is not None and predicate(members):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)

    # --- sampling (observer thread) ----------------------------------------------------

    def _run(self) -> None:
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as http:
            while not self._stopping.is_set():
                started = time.monotonic()
                self._sample(http, started)
                self._stopping.wait(max(0.0, self.period_s - (time.monotonic() - started)))

    def _sample(self, http: httpx.Client, now: float) -> None:
        members = self._get_members(http, f"{self.registry_url}/v1/members")
        metrics = self._get_router_metrics(http)
        with self._changed:
            if members is not None:
                self._apply_members(members, now)
            if metrics is not None:
                self._apply_picks(parse_picks(metrics), now)
                self._migrations = max(self._migrations, parse_migrations(metrics))
            self._members = members
            self._changed.notify_all()

    def _apply_members(self, members: Members, now: float) -> None:
        present = {m.id for m in members}
        for seen in members:
            held = self._timelines.get(seen.id) or MemberTimeline(seen.id)
            if held.routable_at is None and seen.routable:
                held = replace(held, routable_at=now)
            self._timelines[seen.id] = replace(held, gone_at=None)
        for member_id, held in self._timelines.items():
            if member_id not in present and held.gone_at is None:
                self._timelines[member_id] = replace(held, gone_at=now)

    def _apply_picks(self, picks: dict[str, float], now: float) -> None:
        for member_id, count in picks.items():
            held = self._timelines.get(member_id) or MemberTimeline(member_id)
            if count > held.picks:
                held = replace(held, picks=count, last_pick_at=now,
                               first_pick_at=held.first_pick_at or now)
            self._timelines[member_id] = held

    @staticmethod
    def _get_members(http: httpx.Client, url: str) -> Members | None:
        try:
            response = http.get(url)
            response.raise_for_status()
            return _members_json.decode(response.content)
        except (httpx.HTTPError, msgspec.DecodeError):
            return None  # the registry is away (e.g. restarting): keep the last timelines

    def _get_router_metrics(self, http: httpx.Client) -> str | None:
        try:
            response = http.get(f"{self.router_url}/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        return response.text
