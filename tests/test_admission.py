"""Sessions, admission and limits on the pure membership: one rule per test, fast.

Over real sockets the same attacks are tried in test_adversary.py.
"""

from __future__ import annotations

import msgspec
import pytest
from membership_ops import JOINING, READY, ROUTER, fresh, nonce_for, signed, spec

from registry import sessions
from registry.admission import MAX_BAN_S, MAX_BANS, Limits
from registry.ratelimit import SyncLimiter
from wire.protocol import (
    BannedBye,
    Bye,
    ByeReason,
    Heartbeat,
    LeaveReason,
    Load,
    MemberLeft,
    MemberState,
    ReplyStatus,
    Report,
    Role,
    make_encoder,
)

FORGED = b"\x07" * sessions.PROOF_BYTES
_encode = make_encoder().encode


def as_sent(message: Heartbeat | Bye | BannedBye | Report) -> tuple[object, bytes]:
    """`message` as it arrives, proof as given (not sealed): decoded, and its bytes."""
    payload = _encode(message)
    return msgspec.msgpack.decode(payload, type=type(message)), payload


def test_register_hands_out_a_fresh_secret_per_member():
    m = fresh()
    a, b = m.join(spec("a")), m.join(spec("b"))
    assert len(a.session) * 8 >= 128 and len(b.session) * 8 >= 128
    assert a.session != b.session
    # The secret never travels in records, snapshots or events.
    assert all(a.session not in repr(r).encode() for r in m.records())


def test_a_heartbeat_without_the_secret_changes_nothing():
    m = fresh()
    m.join(spec(), READY, Load(running=1))
    before = m.get("p0")
    beat = Heartbeat("p0", 1, 99, MemberState.DRAINING, Load(running=2**31 - 1))
    for forged in (beat, msgspec.structs.replace(beat, proof=FORGED)):
        outcome = m.heartbeat(*as_sent(forged), 1.0)
        assert outcome.status is ReplyStatus.REJECTED and outcome.kind == "proof"
    wrong_key = m.heartbeat(*signed(b"x" * 32, beat), 1.0)  # sealed, with another key
    assert wrong_key.kind == "proof"
    assert m.get("p0") == before
    assert m.take_load_digests(1.0) == {}


def test_a_proof_binds_every_field():
    m = fresh()
    m.join(spec())
    session = m.sessions[("p0", 1)]
    good = Heartbeat("p0", 1, 5, READY, Load(running=1))
    sealed, _ = signed(session, good)
    altered = Heartbeat("p0", 1, 5, MemberState.DRAINING, Load(running=1), proof=sealed.proof)
    assert m.heartbeat(*as_sent(altered), 1.0).kind == "proof"
    assert m.get("p0").state is READY


def test_replays_and_old_seqs_are_refused():
    m = fresh()
    m.join(spec())
    session = m.sessions[("p0", 1)]
    beat = Heartbeat("p0", 1, 5, READY, Load(running=1))
    assert m.heartbeat(*signed(session, beat), 1.0).status is ReplyStatus.OK
    again = m.heartbeat(*signed(session, beat), 1.1)
    assert again.status is ReplyStatus.REJECTED and again.kind == "replay"
    older = Heartbeat("p0", 1, 4, MemberState.DRAINING, Load())
    assert m.heartbeat(*signed(session, older), 1.2).kind == "replay"
    assert m.get("p0").state is READY


def test_a_bye_needs_the_secret():
    m = fresh()
    m.join(spec())
    bye = Bye("p0", 1, 7, ByeReason.SHUTDOWN)
    assert m.bye(*signed(b"y" * 32, bye)).kind == "proof"
    assert "p0" in m
    assert m.leave("p0", 1).status is ReplyStatus.OK
    assert "p0" not in m


def test_only_routers_may_report_and_only_with_their_own_secret():
    m = fresh()
    m.join(spec("p0"))
    m.join(spec("d0"))  # a decode: holds a session, but is no router
    report = Report("d0", 1, 1, "p0", 1, "dislike")
    outcome = m.report(*signed(m.sessions[("d0", 1)], report), 0.1)
    assert outcome.status is ReplyStatus.REJECTED and outcome.kind == "reporter"
    m.join(spec(ROUTER, 1, role=Role.API_SERVER))
    forged = Report(ROUTER, 1, 2, "p0", 1, "forged")
    assert m.report(*signed(b"z" * 32, forged), 0.1).kind == "proof"
    assert not m.get("p0").suspect
    assert m.accuse("p0", 1, 2.0).kind == "accepted"  # p0 silent for 2 intervals
    assert m.get("p0").suspect


def test_the_same_incarnation_again_needs_the_registrants_nonce():
    m = fresh()
    first = m.join(spec())
    other = msgspec.structs.replace(spec(), model="stolen")
    takeover = m.register(other, READY, Load(), 0.1, nonce=b"t" * 16)
    assert takeover.status is ReplyStatus.REJECTED and takeover.kind == "takeover"
    assert m.get("p0").spec.model == "m"
    # The real process retrying (its first reply was lost) gets its own session back.
    retry = m.register(spec(), READY, Load(), 0.2, nonce=nonce_for("p0", 1))
    assert retry.status is ReplyStatus.OK and retry.session == first.session


def test_a_retry_changes_nothing_and_a_changed_spec_needs_a_new_incarnation():
    m = fresh()
    m.join(spec(), JOINING)
    m.beat("p0", 1, READY, Load(running=3), 1.0)
    before = m.get("p0")
    nonce = nonce_for("p0", 1)
    assert m.register(spec(), JOINING, Load(), 2.0, nonce=nonce).status is ReplyStatus.OK
    assert m.get("p0") == before  # a replayed Register neither revives nor reverts
    moved = msgspec.structs.replace(spec(), model="other")
    assert m.register(moved, READY, Load(), 2.0, nonce=nonce).kind == "takeover"


def test_an_incarnation_that_said_bye_cannot_be_brought_back():
    m = fresh()
    m.join(spec())
    m.leave("p0", 1)
    again = m.register(spec(), READY, Load(), 1.0, nonce=nonce_for("p0", 1))
    assert again.status is ReplyStatus.REJECTED and again.kind == "departed"
    assert m.join(spec(incarnation=2), now=1.0).status is ReplyStatus.OK


def test_a_newer_incarnation_waits_for_a_live_holder_then_replaces_visibly():
    m = fresh()
    m.join(spec(incarnation=1))
    m.take_events()
    contested = m.join(spec(incarnation=2), now=0.1)
    assert contested.kind == "contested" and m.get("p0").spec.incarnation == 1
    assert m.take_events() == []
    assert m.join(spec(incarnation=2), now=3.5).status is ReplyStatus.OK  # holder silent
    left = m.take_events()[0]
    assert isinstance(left, MemberLeft) and left.reason is LeaveReason.REPLACED
    assert m.beat("p0", 1).status is ReplyStatus.STALE  # the old process is told


@pytest.mark.parametrize(("ahead_s", "status"), [
    (0.0, ReplyStatus.OK),
    (59.0, ReplyStatus.OK),
    (61.0, ReplyStatus.REJECTED),
    (1e9, ReplyStatus.REJECTED),
])
def test_incarnations_far_ahead_of_the_registry_clock_are_refused(ahead_s, status):
    m = fresh()
    now = 1000.0
    incarnation = int((now + ahead_s) * 1e9)
    assert m.join(spec(incarnation=incarnation), now=now).status is status


def test_incarnation_2_63_cannot_lock_an_id():
    m = fresh()
    outcome = m.join(spec(incarnation=2**63 - 1))
    assert outcome.kind == "incarnation" and "ahead" in outcome.reason


def test_member_caps_name_the_cap():
    m = fresh(limits=Limits(max_members=3, max_members_per_model=2))
    assert m.join(spec("a", model="x")).status is ReplyStatus.OK
    assert m.join(spec("b", model="x")).status is ReplyStatus.OK
    per_model = m.join(spec("c", model="x"))
    assert per_model.kind == "cap" and "--max-members-per-model" in per_model.reason
    assert m.join(spec("c", model="y")).status is ReplyStatus.OK
    total = m.join(spec("d", model="z"))
    assert total.kind == "cap" and "--max-members" in total.reason and "3 members" in total.reason
    # A restart of a member already held is no new member: the caps let it through.
    assert m.join(spec("a", incarnation=2, model="x"), now=3.5).status is ReplyStatus.OK
    m.leave("c", 1)
    assert m.join(spec("d", model="z")).status is ReplyStatus.OK


def test_evict_can_ban_an_id_for_a_while():
    m = fresh()
    m.join(spec())
    assert m.evict("p0", 10.0, ban_s=30.0).status is ReplyStatus.OK
    refused = m.join(spec(incarnation=2), now=20.0)
    assert refused.kind == "banned" and "another 20s" in refused.reason
    assert m.admission.banned(20.0) == {"p0": pytest.approx(20.0)}
    assert m.join(spec(incarnation=2), now=40.1).status is ReplyStatus.OK
    assert m.admission.banned(40.1) == {}


def test_evict_without_a_member_or_ban_is_unknown():
    m = fresh()
    assert m.evict("ghost", 0.0).status is ReplyStatus.UNKNOWN
    assert m.evict("ghost", 0.0, ban_s=5).status is ReplyStatus.OK  # a ban ahead of time
    assert m.join(spec("ghost"), now=1.0).kind == "banned"


# --- a ban passed on by the banned member (BannedBye): how a ban reaches every registry --


def test_a_banned_bye_removes_the_member_and_holds_its_ban_here():
    m = fresh()
    m.join(spec(), READY, now=0.0)
    m.take_events()
    bye = BannedBye("p0", 1, 3, ban_s=120.0)
    assert m.banned_bye(*signed(m.sessions[("p0", 1)], bye), 10.0).status is ReplyStatus.OK
    (left,) = m.take_events()
    assert isinstance(left, MemberLeft) and left.reason is LeaveReason.EVICTED
    assert m.admission.banned(10.0) == {"p0": pytest.approx(120.0)}
    refused = m.join(spec(incarnation=2), now=20.0)
    assert refused.kind == "banned" and refused.banned_s == pytest.approx(110.0)
    assert m.join(spec(incarnation=3), now=130.1).status is ReplyStatus.OK


def test_a_banned_bye_is_capped_and_never_shortens_a_ban_held_here():
    m = fresh()
    m.join(spec(), READY, now=0.0)
    m.banned_bye(*signed(m.sessions[("p0", 1)], BannedBye("p0", 1, 1, ban_s=1e9)), 0.0)
    assert m.admission.banned(0.0) == {"p0": pytest.approx(MAX_BAN_S)}
    # An operator here banned q0 for longer than the member says: the longer ban stands.
    m.join(spec("q0"), READY, now=0.0)
    assert m.admission.ban("q0", 0.0, 500.0) is None
    m.banned_bye(*signed(m.sessions[("q0", 1)], BannedBye("q0", 1, 2, ban_s=10.0)), 1.0)
    assert m.admission.banned(1.0)["q0"] == pytest.approx(499.0)
    assert "q0" not in m


def test_nobody_but_the_member_can_pass_a_ban_on():
    """A forged, replayed, stale or unproven BannedBye bans nobody and removes nobody."""
    m = fresh()
    m.join(spec("victim"), READY, now=0.0)
    m.join(spec("other"), READY, now=0.0)
    victim = m.sessions[("victim", 1)]
    forged = BannedBye("victim", 1, 5, ban_s=600.0)
    for message in (forged, msgspec.structs.replace(forged, proof=FORGED)):
        assert m.banned_bye(*as_sent(message), 1.0).kind == "proof"
    # Another member's own session cannot speak for the victim.
    assert m.banned_bye(*signed(m.sessions[("other", 1)], forged), 1.0).kind == "proof"
    # A sealed message from the victim, replayed: refused once its seq was used.
    assert m.beat("victim", 1, now=1.0).status is ReplyStatus.OK  # seq now above 1
    replay = BannedBye("victim", 1, 1, ban_s=600.0)
    assert m.banned_bye(*signed(victim, replay), 1.5).kind == "replay"
    # An old incarnation's, and one for an id not held here (nobody to prove it).
    assert m.banned_bye(*signed(victim, BannedBye("victim", 0, 99, 600.0)),
                        1.5).status is ReplyStatus.STALE
    assert m.banned_bye(*as_sent(BannedBye("ghost", 1, 1, 600.0)),
                        1.5).status is ReplyStatus.OK
    assert "victim" in m and "other" in m
    assert m.admission.banned(2.0) == {}
    assert m.join(spec("ghost"), now=2.0).status is ReplyStatus.OK


def test_a_banned_bye_beyond_the_ban_table_still_removes_the_member():
    m = fresh()
    for i in range(MAX_BANS):
        m.admission.ban(f"b{i}", 0.0, 100.0)
    m.join(spec(), READY, now=0.0)
    bye = BannedBye("p0", 1, 1, ban_s=60.0)
    assert m.banned_bye(*signed(m.sessions[("p0", 1)], bye), 1.0).status is ReplyStatus.OK
    assert "p0" not in m and "p0" not in m.admission.banned(1.0)


def test_sync_limiter_per_peer_and_overall():
    limiter = SyncLimiter(peer_burst=2, peer_syncs_per_s=1, bytes_per_s=100,
                          burst_bytes=100)
    assert limiter.wait_s(b"a", 10, 0.0) == 0
    assert limiter.wait_s(b"a", 10, 0.0) == 0
    assert limiter.wait_s(b"a", 10, 0.0) == pytest.approx(1.0)  # a's burst is spent
    assert limiter.wait_s(b"b", 80, 0.0) == 0  # b has its own, but the total is nearly out
    assert limiter.wait_s(b"c", 10, 0.0) == pytest.approx(0.1)
    assert limiter.wait_s(b"c", 10, 0.1) == 0  # refilled; c's refusal did not spend c
