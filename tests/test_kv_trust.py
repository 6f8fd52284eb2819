"""Distrust of members whose KV events lie: the tracker's rules as tables and properties
(the clock passed in), the `kv` policy scoring a distrusted member as holding nothing,
ties broken at random, and an insider machine: a prefill whose events claim a prefix it
does not hold never gets more than its fair share once its own reports contradict it."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_kv_policy import BLOCK, affinity, indexed
from test_policies import member, view

from router.handshakes.legs import reported_cached_tokens, reported_cached_tokens_in
from router.kv.policy import make_kv_pairer
from router.kv.trust import (
    DISTRUST_S,
    MAX_DISTRUST_S,
    STRIKES,
    CacheTrust,
    Verdict,
)
from router.table import Pair, PairingTable
from wire.protocol import Role

CLAIM = 9 * BLOCK  # what a member holding 9 blocks of PROMPT is predicted to hold


def strike_out(trust: CacheTrust, member_id: str, now: float) -> list[Verdict]:
    return [trust.observe(member_id, CLAIM, 0, now) for _ in range(STRIKES)]


def test_a_member_that_keeps_falling_short_is_distrusted_for_a_doubling_period() -> None:
    trust = CacheTrust()
    assert strike_out(trust, "liar", 0.0) == [Verdict.SHORT] * (STRIKES - 1) + [
        Verdict.DISTRUSTED]
    assert trust.distrusts("liar", DISTRUST_S - 0.1)
    assert not trust.distrusts("liar", DISTRUST_S) and not trust.distrusts("honest", 0.0)
    # Trusted again with no strikes; the next offence costs twice as long.
    again = DISTRUST_S
    assert strike_out(trust, "liar", again)[-1] is Verdict.DISTRUSTED
    assert trust.distrusts("liar", again + 2 * DISTRUST_S - 0.1)
    assert not trust.distrusts("liar", again + 2 * DISTRUST_S)
    assert trust.distrusted(again) == {"liar": 2 * DISTRUST_S}


def test_nothing_predicted_nothing_checked_and_a_little_short_is_no_lie() -> None:
    trust = CacheTrust()
    for _ in range(2 * STRIKES):
        assert trust.observe("m", 0, 0, 1.0) is Verdict.IGNORED
        assert trust.observe("m", CLAIM, CLAIM // 2, 1.0) is Verdict.KEPT  # evicted a bit
    assert not trust.distrusts("m", 1.0)


def test_kept_predictions_take_strikes_away_and_time_alone_does_not() -> None:
    trust = CacheTrust()
    for _ in range(4 * STRIKES):  # one short, one kept: never STRIKES net
        trust.observe("m", CLAIM, 0, 0.0)
        trust.observe("m", CLAIM, CLAIM, 0.0)
    assert not trust.distrusts("m", 0.0)
    trust = CacheTrust()
    verdicts = [trust.observe("m", CLAIM, 0, i * 3600.0) for i in range(STRIKES)]
    assert verdicts[-1] is Verdict.DISTRUSTED  # one lie an hour still adds up


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 64), st.integers(0, 64),
                          st.floats(0.0, 100.0)), max_size=200))
def test_distrust_follows_only_shortfalls_and_is_bounded(
        steps: list[tuple[str, int, int, float]]) -> None:
    """Against a recount: a member is distrusted only after STRIKES shortfalls since its
    last distrust, and never past MAX_DISTRUST_S from its last shortfall."""
    trust, now = CacheTrust(), 0.0
    shortfalls: dict[str, list[float]] = {}
    for member_id, predicted, reported, dt in steps:
        now += dt
        verdict = trust.observe(member_id, predicted, reported, now)
        short = predicted > 0 and reported < 0.5 * predicted
        assert (verdict in (Verdict.SHORT, Verdict.DISTRUSTED)) == short
        if short:
            shortfalls.setdefault(member_id, []).append(now)
        if verdict is Verdict.DISTRUSTED:
            assert len(shortfalls[member_id]) >= STRIKES
        for m, left in trust.distrusted(now).items():
            assert 0 < left <= MAX_DISTRUST_S and now - shortfalls[m][-1] < MAX_DISTRUST_S


def test_a_bounded_number_of_members_is_tracked() -> None:
    trust = CacheTrust(max_tracked=2)
    strike_out(trust, "liar", 0.0)
    for other in ("a", "b"):
        trust.observe(other, CLAIM, CLAIM, 0.0)
    assert trust.distrusted(0.0) == {}  # the one seen longest ago went first


def test_the_reported_count_is_read_as_vllm_writes_it() -> None:
    def reply(details: object) -> dict[str, object]:
        return {"usage": {"prompt_tokens": 9, "prompt_tokens_details": details}}
    assert reported_cached_tokens(reply({"cached_tokens": 32})) == 32
    assert reported_cached_tokens(reply({"cached_tokens": 0})) == 0
    for bad in (None, {}, {"cached_tokens": -1}, {"cached_tokens": True},
                {"cached_tokens": "32"}, {"cached_tokens": 1.5}):
        assert reported_cached_tokens(reply(bad)) is None
    assert reported_cached_tokens({}) is None and reported_cached_tokens([1]) is None
    # SGLang's prefill answer, drained: only a whole JSON answer is looked into.
    answer = b'{"usage": {"prompt_tokens_details": {"cached_tokens": 48}}}'
    assert reported_cached_tokens_in(answer) == 48
    for other in (b"data: " + answer + b"\n\n", b"{not json", b""):
        assert reported_cached_tokens_in(other) is None


# --- the policy ---------------------------------------------------------------------------

def pick(trust: CacheTrust, rng: random.Random, now: float, holdings: dict[str, int]
         ) -> Pair:
    pairer = make_kv_pairer(indexed(holdings), rng=rng, trust=trust)
    members = [member(i, load_at=now) for i in holdings] + [
        member("d", Role.DECODE, load_at=now)]
    pair = pairer.choose(PairingTable.build(view(*members)), "m", now=now, in_flight={},
                         affinity=affinity())
    assert pair is not None
    return pair


def test_equal_claims_split_at_random_and_a_distrusted_claim_counts_for_nothing() -> None:
    trust, rng = CacheTrust(), random.Random(7)
    holdings = {"honest": 9, "liar": 9, "empty": 0}
    picks = [pick(trust, rng, 0.0, holdings).prefill.id for _ in range(200)]
    assert {"honest", "liar"} == set(picks)  # not always the lower id
    assert 60 <= picks.count("liar") <= 140
    strike_out(trust, "liar", 0.0)
    pairs = [pick(trust, rng, 1.0, holdings) for _ in range(50)]
    assert {p.prefill.id for p in pairs} == {"honest"}
    assert all(p.cached_tokens == CLAIM for p in pairs)


class InsiderWhoseEventsLie(RuleBasedStateMachine):
    """Three prefills: an honest one that holds PROMPT's prefix, an empty one, and an
    insider whose KV events claim the same prefix while its cache is off (its engine
    reports 0 cached tokens). Requests come one at a time (no load) and time passes.
    Once the insider's reports have contradicted its events, it gets no more than its
    fair share (1/3) of the prefix's requests, plus what each trust window lets through
    before it strikes out again (STRIKES)."""

    @initialize()
    def start(self) -> None:
        self.trust, self.rng, self.now = CacheTrust(), random.Random(0), 0.0
        self.holdings = {"honest": 9, "insider": 9, "empty": 0}
        self.contradicted = False
        self.after = self.insider_after = self.windows = 0
        self.insider_while_distrusted = 0

    @rule()
    def a_request_for_the_prefix(self) -> None:
        distrusted = self.trust.distrusts("insider", self.now)
        pair = pick(self.trust, self.rng, self.now, self.holdings)
        if pair.prefill.id == "insider":
            self.insider_while_distrusted += distrusted
            reported = 0  # its cache is off: it computes everything
        else:
            reported = self.holdings[pair.prefill.id] * BLOCK
        if self.contradicted:
            self.after += 1
            self.insider_after += pair.prefill.id == "insider"
        verdict = self.trust.observe(pair.prefill.id, pair.cached_tokens, reported, self.now)
        if verdict in (Verdict.SHORT, Verdict.DISTRUSTED) and not self.contradicted:
            self.contradicted, self.windows = True, 1
        if verdict is Verdict.DISTRUSTED:
            self.windows += 1  # the next trust window, once this distrust ends

    @rule(seconds=st.sampled_from([0.5, 5.0, DISTRUST_S, 4 * DISTRUST_S]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def the_insider_never_gets_more_than_its_fair_share(self) -> None:
        assert self.insider_while_distrusted == 0
        assert self.insider_after <= self.after / 3 + STRIKES * self.windows

    @invariant()
    def the_honest_member_is_never_distrusted(self) -> None:
        assert not self.trust.distrusts("honest", self.now)


TestInsiderWhoseEventsLie = InsiderWhoseEventsLie.TestCase
