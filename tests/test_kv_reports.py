"""The registry's store of routers' KV index reports (registry/kv_reports.py) and the
router's report plan (router/kv/reporter.py): pure, clock passed in.

The Hypothesis machine runs random routers (restarting), members (re-registering with new
incarnations, leaving) and reports (entries about real and unknown members, GONE), and
checks after every step that what readers see equals a model: per member of the current
incarnation, the worst state any current router reports, with that router's figures."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from registry.kv_reports import (
    KV_REPORT_BURST,
    SWEEP_PERIOD_S,
    VIEW_BATCH,
    VIEW_PERIOD_S,
    KvReports,
    kv_index_json,
    summary_json,
)
from router.kv.reporter import REFRESH_TICKS, KvReportPlan, blocks_bucket, entries_of, lag_bucket
from wire.protocol import (
    Endpoints,
    KvIndexEntry,
    KvIndexState,
    Load,
    MemberRecord,
    MemberSpec,
    MemberState,
    Role,
)

LIVE, UNKNOWN, GONE = KvIndexState.LIVE, KvIndexState.UNKNOWN, KvIndexState.GONE
INTERVAL_S = 1.0


def entry(member: str, incarnation: int = 1, state: KvIndexState = LIVE, blocks: int = 0,
          lag_ms: int = 0) -> KvIndexEntry:
    return KvIndexEntry(member, incarnation, state, blocks, lag_ms)


def test_a_report_is_shown_as_the_worst_state_with_routers_per_state() -> None:
    kv = KvReports()
    members = {"p1": 1, "p2": 7}.get
    assert kv.admit("r1", 1, 0.0, INTERVAL_S) == 0
    kv.apply("r1", [entry("p1", blocks=120, lag_ms=40), entry("p2", 7, blocks=3)], members, 0.0)
    assert kv.admit("r2", 1, 0.0, INTERVAL_S) == 0
    applied = kv.apply("r2", [entry("p1", state=UNKNOWN, blocks=10, lag_ms=2500)], members,
                       0.0)
    assert applied.stored == 1 and kv.held == 3
    assert summary_json(kv.view["p1"]) == {"state": "unknown", "blocks": 10, "lag_s": 2.5,
                                           "routers": {"live": 1, "unknown": 1}}
    assert summary_json(kv.view["p2"]) == {"state": "live", "blocks": 3, "lag_s": 0.0,
                                           "routers": {"live": 1}}
    # r2 catches up: the member is live again everywhere, the figures are the laggiest.
    kv.admit("r2", 1, 1.0, INTERVAL_S)
    kv.apply("r2", [entry("p1", blocks=121, lag_ms=90)], members, 1.0)
    assert summary_json(kv.view["p1"])["routers"] == {"live": 2}
    assert kv.view["p1"].blocks == 121 and kv.view["p1"].lag_ms == 90


def test_only_registered_members_at_their_incarnation_can_be_described() -> None:
    kv = KvReports()
    kv.admit("r1", 1, 0.0, INTERVAL_S)
    applied = kv.apply("r1", [entry("ghost"), entry("p1", incarnation=2), entry("p1")],
                       {"p1": 1}.get, 0.0)
    assert (applied.ignored, applied.stored) == (2, 1)
    assert list(kv.view) == ["p1"] and kv.held == 1


def test_one_report_per_interval_after_a_small_burst() -> None:
    kv = KvReports()
    accepted = [kv.admit("r1", 1, 0.0, INTERVAL_S) == 0 for _ in range(5)]
    assert accepted == [True] * int(KV_REPORT_BURST) + [False] * (5 - int(KV_REPORT_BURST))
    assert kv.admit("r1", 1, 0.5 * INTERVAL_S, INTERVAL_S) > 0
    assert kv.admit("r1", 1, 1.0 * INTERVAL_S, INTERVAL_S) == 0
    assert kv.admit("r2", 1, 1.0 * INTERVAL_S, INTERVAL_S) == 0  # per router


def test_gone_a_restart_and_departures_drop_what_was_said() -> None:
    kv = KvReports()
    members = {"p1": 1, "p2": 1}
    routers = {"r1": 1, "r2": 1}
    for router in routers:
        kv.admit(router, 1, 0.0, INTERVAL_S)
        kv.apply(router, [entry("p1", blocks=5), entry("p2", blocks=6)], members.get, 0.0)
    assert kv.held == 4
    kv.admit("r1", 1, 2.0, INTERVAL_S)
    kv.apply("r1", [entry("p1", state=GONE)], members.get, 2.0)
    assert kv.view["p1"].routers == (1, 0, 0, 0) and kv.held == 3
    # r2 restarts: its old process's figures go at its first report.
    kv.admit("r2", 2, 3.0, INTERVAL_S)
    kv.apply("r2", [], members.get, 3.0)
    assert "p1" not in kv.view and kv.held == 1
    # p2 re-registers (incarnation 2): figures about incarnation 1 go with it.
    members["p2"] = 2
    kv.apply("r2", [entry("p2", incarnation=2, state=KvIndexState.SYNCING)], members.get, 3.0)
    assert kv.view["p2"].incarnation == 2 and kv.view["p2"].state is KvIndexState.SYNCING
    assert kv.held == 1
    # r2 and p2 leave: the sweep forgets both.
    del members["p2"], routers["r2"]
    assert kv.sweep(SWEEP_PERIOD_S + 10, members.get, routers.get) >= 1
    assert not kv.view and kv.held == 0


def record(member_id: str, incarnation: int, role: Role = Role.PREFILL) -> MemberRecord:
    spec = MemberSpec(id=member_id, incarnation=incarnation, role=role,
                      model="" if role is Role.API_SERVER else "m", protocol="reference",
                      endpoints=Endpoints(http="http://127.0.0.1:9000"))
    return MemberRecord(spec=spec, state=MemberState.READY)


def test_readers_see_only_the_current_incarnation_and_only_while_a_router_is_there() -> None:
    kv = KvReports()
    kv.admit("r1", 1, 0.0, INTERVAL_S)
    kv.apply("r1", [entry("p1", blocks=5)], {"p1": 1}.get, 0.0)
    router = record("r1", 1, Role.API_SERVER)
    assert kv_index_json([record("p1", 1), router], kv.view)["p1"]["blocks"] == 5
    assert kv_index_json([record("p1", 2), router], kv.view) == {}  # restarted meanwhile
    assert kv_index_json([record("p1", 1)], kv.view) == {}  # no router left to update it


def test_a_bulk_change_reaches_readers_within_the_view_period() -> None:
    """Thousands of members restated at once are published together, not per message."""
    kv = KvReports()
    members = {f"p{i}": 1 for i in range(2 * VIEW_BATCH)}
    kv.admit("r1", 1, 0.0, INTERVAL_S)
    kv.apply("r1", [entry(m) for m in members], members.get, 0.0)
    assert len(kv.view) == 2 * VIEW_BATCH  # the first goes out at once
    kv.admit("r1", 1, 1.0, INTERVAL_S)
    kv.apply("r1", [entry(m, state=UNKNOWN) for m in members], members.get, 0.1)
    assert all(s.state is LIVE for s in kv.view.values())  # held back...
    kv.admit("r2", 1, 1.0, INTERVAL_S)
    kv.apply("r2", [], members.get, VIEW_PERIOD_S)  # ... until the next report after it
    assert all(s.state is UNKNOWN for s in kv.view.values())


# --- the model-based check ---------------------------------------------------------------

MEMBERS = ["p0", "p1", "p2", "p3"]
ROUTERS = ["r0", "r1", "r2"]
states = st.sampled_from(list(KvIndexState))
entries = st.lists(st.tuples(st.sampled_from([*MEMBERS, "ghost"]), st.booleans(), states,
                             st.integers(0, 5000), st.integers(0, 10_000)), max_size=8)


class KvReportsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KvReports()
        self.now = 0.0
        self.members = dict.fromkeys(MEMBERS, 1)  # id -> incarnation registered
        self.routers = dict.fromkeys(ROUTERS, 1)
        self.incarnations = 1
        # The model: (router, member) -> (router incarnation, member incarnation, entry)
        self.said: dict[tuple[str, str], tuple[int, int, KvIndexEntry]] = {}

    @rule(router=st.sampled_from(ROUTERS), batch=entries)
    def report(self, router: str, batch: list[tuple[str, bool, KvIndexState, int, int]]) -> None:
        incarnation = self.routers.get(router)
        if incarnation is None:
            return  # not registered: authentication refuses it before the store sees it
        self.now += INTERVAL_S  # within the rate
        assert self.kv.admit(router, incarnation, self.now, INTERVAL_S) == 0
        sent = []
        for member, stale, state, blocks, lag in batch:
            held = self.members.get(member, 1)
            sent.append(entry(member, held - 1 if stale else held, state, blocks, lag))
        self.kv.apply(router, sent, self.members.get, self.now)
        # Older (router, member) figures from another process of either are void.
        for key, (r_inc, _, _) in list(self.said.items()):
            if key[0] == router and r_inc != incarnation:
                del self.said[key]
        for e in sent:
            if self.members.get(e.member_id) != e.incarnation:
                continue
            if e.state is GONE:
                self.said.pop((router, e.member_id), None)
            else:
                self.said[(router, e.member_id)] = (incarnation, e.incarnation, e)

    def fresh(self) -> int:
        self.incarnations += 1
        return self.incarnations

    @rule(member=st.sampled_from(MEMBERS))
    def member_restarts(self, member: str) -> None:
        if member in self.members:
            self.members[member] = self.fresh()

    @rule(member=st.sampled_from(MEMBERS))
    def member_leaves_or_returns(self, member: str) -> None:
        if member in self.members:
            del self.members[member]
        else:
            self.members[member] = self.fresh()

    @rule(router=st.sampled_from(ROUTERS), leaves=st.booleans())
    def router_restarts_or_leaves(self, router: str, leaves: bool) -> None:
        if router in self.routers and leaves:
            del self.routers[router]
        else:
            self.routers[router] = self.fresh()
        self.sweep()  # (without a sweep, what it said stays until its next report)

    @rule()
    def sweep(self) -> None:
        self.now += SWEEP_PERIOD_S
        self.kv.sweep(self.now, self.members.get, self.routers.get)

    def expected(self) -> dict[str, tuple[KvIndexState, int, int, tuple[int, ...]]]:
        by_member: dict[str, list[KvIndexEntry]] = {}
        for (router, member), (r_inc, m_inc, e) in self.said.items():
            if self.routers.get(router) == r_inc and self.members.get(member) == m_inc:
                by_member.setdefault(member, []).append(e)
        out = {}
        for member, said in by_member.items():
            worst = max(said, key=lambda e: (e.state, e.lag_ms, e.blocks))
            counts = tuple(sum(1 for e in said if e.state is s) for s in KvIndexState if s)
            out[member] = (worst.state, worst.blocks, worst.lag_ms, counts)
        return out

    @invariant()
    def readers_see_the_model(self) -> None:
        records = [record(m, i) for m, i in self.members.items()]
        records += [record(r, i, Role.API_SERVER) for r, i in self.routers.items()]
        shown = {m: (s.state, s.blocks, s.lag_ms, s.routers) for m, s in self.kv.view.items()
                 if self.members.get(m) == s.incarnation}
        assert shown == self.expected()
        assert set(kv_index_json(records, self.kv.view)) <= set(self.members)

    @invariant()
    def held_counts_every_entry(self) -> None:
        assert self.kv.held == sum(sum(s.routers) for s in self.kv.view.values())


TestKvReportsMachine = KvReportsMachine.TestCase


# --- the router's side: what goes out per tick ---------------------------------------------


@pytest.mark.parametrize(("blocks", "bucket"), [(0, 0), (1, 1), (2, 5), (100, 27), (119, 28)])
def test_blocks_buckets_are_quarter_octaves(blocks: int, bucket: int) -> None:
    assert blocks_bucket(blocks) == bucket


@pytest.mark.parametrize(("lag_ms", "bucket"), [(0, 0), (99, 0), (100, 1), (315, 1),
                                                (317, 2), (1000, 3), (10_000, 5)])
def test_lag_buckets_are_half_decades_above_100ms(lag_ms: int, bucket: int) -> None:
    assert lag_bucket(lag_ms) == bucket


def test_the_plan_sends_changes_gone_and_a_rolling_refresh() -> None:
    plan = KvReportPlan(refresh_ticks=REFRESH_TICKS)
    index = [entry(f"p{i:03}", blocks=100) for i in range(60)]
    first = plan.next(index)
    assert {e.member_id for e in first} == {e.member_id for e in index}  # all new
    quiet = plan.next([entry(e.member_id, blocks=105) for e in index])  # within a bucket
    assert len(quiet) == 60 // REFRESH_TICKS  # only the refresh slice
    restated = set()
    for _ in range(REFRESH_TICKS):
        restated |= {e.member_id for e in plan.next(index)}
    assert restated == {e.member_id for e in index}  # everyone within REFRESH_TICKS ticks
    moved = [*index[:59], entry("p059", state=UNKNOWN, blocks=100)]
    report = plan.next(moved[1:])
    assert entry("p000", state=GONE) in report
    assert entry("p059", state=UNKNOWN, blocks=100) in report


def test_status_rows_become_entries() -> None:
    rows = [{"id": "p1", "incarnation": 3, "state": "replaying", "blocks": 12, "lag_s": 0.25},
            {"id": "p2", "incarnation": 1, "state": "syncing", "blocks": 0, "lag_s": None},
            {"id": "p3", "incarnation": 1, "state": "new-state", "blocks": 0, "lag_s": None}]
    assert entries_of(rows) == [entry("p1", 3, KvIndexState.REPLAYING, 12, 250),
                                entry("p2", 1, KvIndexState.SYNCING)]


def test_the_agent_link_cuts_reports_to_size_and_keeps_the_newest() -> None:
    """What waits for a registry: newest figures per member, sent in messages that fit."""
    from engine_agent.link import KV_REPORT_MAX_BYTES, Link, LinkPhase
    from registry import sessions
    from wire.protocol import KvIndexReport, make_encoder

    link = Link("127.0.0.1:1", "api_server-x")
    link.session, link.interval_s = sessions.new_session(), 1.0
    link.phase = LinkPhase.HEARTBEATING
    ids = [f"prefill-10.0.{i // 256}.{i % 256}-8000" for i in range(2000)]
    link.add_kv([entry(m, blocks=1) for m in ids])
    link.add_kv([entry(ids[0], state=UNKNOWN)])  # an update keeps its place
    spec = record("api_server-x", 1, Role.API_SERVER).spec
    encoder, sent = make_encoder(), []
    now = 0.0
    while link.kv_pending:
        assert link.kv_due(now)
        (frame,) = link.request(spec, "", MemberState.READY, Load(), encoder, now)
        assert len(frame) <= KV_REPORT_MAX_BYTES + 64 and not link.kv_due(now)
        sent += msgspec.msgpack.decode(frame, type=KvIndexReport).entries
        now += link.interval_s
    assert [e.member_id for e in sent] == ids and sent[0].state is UNKNOWN
