"""An outsider tries every attack issue 9 lists, over real sockets; all must fail.

The registry runs as the README says to run it securely (`--token`, `--admin-token`, and
CURVE where the attack is on the transport). The attacker knows neither token and
everything `/v1/members` publishes (ids, incarnations, specs); it may also replay what
it sniffed. After each attack the membership must be exactly what it was.

The Hypothesis state machine at the end interleaves legitimate members with such an
attacker and checks after every step that no message without a member's secret ever
changed that member's record.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from raw_member import RawMember, member_spec

from engine_agent.agent import Agent, new_incarnation
from pdreg.testing import wait_until
from registry import dashboard, sessions
from registry.client import MembershipView, request_snapshot
from registry.protocol import (
    NO_PROOF,
    Bye,
    ByeReason,
    Heartbeat,
    Load,
    MemberRecord,
    MemberState,
    Register,
    ReplyStatus,
    Report,
    Role,
    make_encoder,
)
from registry.security import ClientCurve, ServerCurve, generate_keys
from registry.server import RegistryConfig, RegistryServer

TOKEN = "fleet-s3cret"
ADMIN = "admin-s3cret"
WAIT_S = 10.0
FORGED_PROOF = b"\x07" * sessions.PROOF_BYTES
_encode = make_encoder().encode


def secure_registry(**overrides: object) -> RegistryServer:
    config = RegistryConfig(port=0, events_port=0, http_port=0, heartbeat_interval_s=60.0,
                            lease_s=180.0, token=TOKEN, admin_token=ADMIN)
    return RegistryServer(replace(config, **overrides)).start()


@pytest.fixture
def registry() -> Iterator[RegistryServer]:
    server = secure_registry()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def victim(registry: RegistryServer) -> Iterator[RawMember]:
    member = RawMember(registry.control_address, member_id="decode-10.0.0.7-8200",
                       role=Role.DECODE, token=TOKEN)
    assert member.register().status is ReplyStatus.OK
    member.heartbeat(Load(running=2, kv_usage=0.25))
    try:
        yield member
    finally:
        member.close()


@pytest.fixture
def attacker(registry: RegistryServer) -> Iterator[RawMember]:
    intruder = RawMember(registry.control_address, member_id="attacker-1")
    try:
        yield intruder
    finally:
        intruder.close()


def record(registry: RegistryServer, member_id: str) -> MemberRecord | None:
    """The member as the loop holds it right now (not the HTTP side's snapshot)."""
    return registry.submit(lambda m, now: m.get(member_id)).result(WAIT_S)  # type: ignore


def public(registry: RegistryServer, member_id: str) -> dict:
    """What anyone can read about a member."""
    return httpx.get(f"{registry.http_url}/v1/members/{member_id}").json()


def rejections(registry: RegistryServer) -> dict[str, float]:
    return dict(registry.stats.rejections)


# --- forged messages about a member -------------------------------------------------------


@pytest.mark.parametrize("forgery", [
    Heartbeat("ID", 0, 10**6, MemberState.DRAINING, Load()),
    Heartbeat("ID", 0, 10**6, MemberState.READY, Load(running=2**31 - 1, waiting=2**31 - 1)),
    Bye("ID", 0, 10**6, ByeReason.CRASHED),
], ids=["draining", "saturated", "bye"])
@pytest.mark.parametrize("proof", [NO_PROOF, FORGED_PROOF], ids=["none", "random"])
def test_forged_messages_change_nothing(registry, victim, attacker, forgery, proof):
    seen = public(registry, victim.id)
    forgery = msgspec.structs.replace(forgery, id=victim.id, incarnation=seen["incarnation"],
                                      proof=proof)
    before = record(registry, victim.id)
    reply = attacker.ask(forgery)
    assert reply.status is ReplyStatus.REJECTED and "proof" in reply.reason
    assert record(registry, victim.id) == before
    # The member itself notices nothing: its own heartbeats are still answered OK.
    assert victim.heartbeat(Load(running=2, kv_usage=0.25)).status is ReplyStatus.OK
    assert record(registry, victim.id).state is MemberState.READY
    assert rejections(registry)["proof"] >= 1


def test_a_forged_report_suspects_nobody(registry, victim, attacker):
    router = RawMember(registry.control_address, member_id="api_server-10.0.0.1-8000",
                       role=Role.API_SERVER, token=TOKEN)
    try:
        assert router.register().status is ReplyStatus.OK
        target = public(registry, victim.id)["incarnation"]
        as_router = Report(router.id, router.spec.incarnation, 10**6, victim.id, target, "x",
                           FORGED_PROOF)
        assert attacker.ask(as_router).status is ReplyStatus.REJECTED
        as_nobody = Report("ghost", 1, 1, victim.id, target, "x", FORGED_PROOF)
        assert attacker.ask(as_nobody).status is ReplyStatus.UNKNOWN
        assert not record(registry, victim.id).suspect
        # The real router's report does count.
        assert router.report(victim.id, target, "connect refused").status is ReplyStatus.OK
        assert record(registry, victim.id).suspect
        assert registry.stats.reports["accepted"] == 1
    finally:
        router.close()


def test_a_captured_message_cannot_be_replayed(registry, victim, attacker):
    victim.heartbeat(Load(running=1), MemberState.JOINING)
    captured = victim.last_frames  # sniffed off the wire, proof and all
    victim.heartbeat(Load(running=3), MemberState.READY)
    before = record(registry, victim.id)
    reply = attacker.send_frames(captured)
    assert reply.status is ReplyStatus.REJECTED and "replay" in reply.reason
    assert record(registry, victim.id) == before
    assert before.state is MemberState.READY and before.load.running == 3


def test_a_proof_cannot_be_moved_to_another_message(registry, victim, attacker):
    victim.heartbeat(Load(running=1))
    (sealed,) = victim.last_frames
    proof = msgspec.msgpack.decode(sealed, type=Heartbeat).proof
    incarnation = public(registry, victim.id)["incarnation"]
    drained = Heartbeat(victim.id, incarnation, 10**9, MemberState.DRAINING, Load(), proof)
    assert attacker.ask(drained).status is ReplyStatus.REJECTED
    assert record(registry, victim.id).state is MemberState.READY


# --- registration ---------------------------------------------------------------------


def test_registration_needs_the_token(registry, attacker):
    for token in ("", "fleet-s3cre", "x" * 256):
        fake = Register(spec=member_spec("decode-6.6.6.6-80", role=Role.DECODE,
                                         http="http://6.6.6.6:80"),
                        nonce=b"n" * 16, token=token, state=MemberState.READY)
        reply = attacker.ask(fake)
        assert reply.status is ReplyStatus.REJECTED and "token" in reply.reason
    assert registry.members() == {}


def test_an_insider_cannot_take_over_an_id(registry, victim):
    """An insider holds the fleet token but not the victim's nonce or session."""
    insider = RawMember(registry.control_address, token=TOKEN, spec=victim.spec)
    try:
        before = record(registry, victim.id)
        evil = msgspec.structs.replace(victim.spec, endpoints=msgspec.structs.replace(
            victim.spec.endpoints, http="http://6.6.6.6:8200"))
        same = insider.register(spec=evil)
        assert same.status is ReplyStatus.REJECTED and same.session == b""
        assert "registered already" in same.reason
        forever = msgspec.structs.replace(evil, incarnation=2**63 - 1)
        reply = insider.register(spec=forever)
        assert reply.status is ReplyStatus.REJECTED and "ahead" in reply.reason
        assert record(registry, victim.id) == before
        assert victim.heartbeat().status is ReplyStatus.OK
    finally:
        insider.close()


def test_a_restarted_member_still_takes_its_id_back_at_once(registry, victim):
    with MembershipView(registry.control_address) as view:
        assert view.wait_for(lambda m: victim.id in m, WAIT_S)
        restarted = RawMember(registry.control_address, token=TOKEN,
                              spec=msgspec.structs.replace(victim.spec,
                                                           incarnation=new_incarnation()))
        try:
            assert restarted.register().status is ReplyStatus.OK
            assert view.wait_for(  # left (replaced), then joined again
                lambda m: victim.id in m
                and m[victim.id].record.spec.incarnation == restarted.spec.incarnation,
                WAIT_S)
            assert registry.stats.departures["replaced"] == 1
            assert victim.heartbeat().status is ReplyStatus.STALE  # the old one is told
        finally:
            restarted.close()


def test_an_insider_is_capped_and_the_refusal_names_the_cap():
    server = secure_registry(max_members=40, max_members_per_model=30)
    insider = RawMember(server.control_address, token=TOKEN)
    try:
        outcomes = []
        for i in range(120):
            model = "tiny" if i < 60 else f"other-{i}"
            spec = member_spec(f"decode-10.1.0.{i}-80", role=Role.DECODE, model=model)
            outcomes.append(insider.register(spec=spec))
        refused = [r.reason for r in outcomes if r.status is ReplyStatus.REJECTED]
        assert sum("--max-members-per-model" in r for r in refused) == 30
        assert sum("member cap reached: 40" in r for r in refused) == 50
        assert wait_until(lambda: len(server.members()) == 40, WAIT_S)
    finally:
        insider.close()
        server.close()


@pytest.mark.parametrize(("where", "value"), [
    ("extra", float("nan")), ("extra", float("inf")), ("kv_usage", float("nan")),
])
def test_non_finite_numbers_are_refused_and_json_stays_valid(registry, victim, where, value):
    load = [1, 0, value, {}] if where == "kv_usage" else [1, 0, 0.5, {"tok_s": value}]
    raw = msgspec.msgpack.encode(["Heartbeat", victim.id, victim.spec.incarnation,
                                  victim.next_seq(), 2, load, NO_PROOF])
    reply = victim.send_frames([sessions.seal(victim.session, raw)])
    assert reply.status is ReplyStatus.REJECTED and "invalid" in reply.reason
    state = httpx.get(f"{registry.http_url}/v1/dashboard").text
    assert "NaN" not in state and "Infinity" not in state
    json.loads(state)
    assert all(math.isfinite(v) for m in httpx.get(f"{registry.http_url}/v1/members").json()
               for v in m["load"].values())


@pytest.mark.parametrize("http", ["http://169.254.169.254:80", "http://[fe80::1]:8000"])
def test_a_metadata_address_cannot_be_advertised(registry, http):
    insider = RawMember(registry.control_address, token=TOKEN,
                        spec=member_spec("decode-x-80", role=Role.DECODE, http=http))
    try:
        reply = insider.register()
        assert reply.status is ReplyStatus.REJECTED and "link-local" in reply.reason
    finally:
        insider.close()


@pytest.mark.parametrize("member_id", ["a/b", "a\nb", "a\x00", "../etc"])
def test_hostile_ids_are_refused(registry, member_id):
    insider = RawMember(registry.control_address, token=TOKEN,
                        spec=member_spec(member_id, role=Role.DECODE))
    try:
        assert insider.register().status is ReplyStatus.REJECTED
    finally:
        insider.close()


def test_an_evicted_impostor_cannot_come_straight_back(registry):
    impostor = RawMember(registry.control_address, member_id="decode-6.6.6.6-80",
                         role=Role.DECODE, token=TOKEN)
    try:
        assert impostor.register().status is ReplyStatus.OK
        url = f"{registry.http_url}/v1/members/{impostor.id}"
        assert httpx.delete(url, params={"ban": 600}).status_code == 401  # needs the admin
        response = httpx.delete(url, params={"ban": 600},
                                headers={"Authorization": f"Bearer {ADMIN}"})
        assert response.status_code == 200 and "banned" in response.json()["result"]
        assert impostor.heartbeat().status is ReplyStatus.UNKNOWN
        again = impostor.register(spec=msgspec.structs.replace(
            impostor.spec, incarnation=new_incarnation()))
        assert again.status is ReplyStatus.REJECTED and "banned" in again.reason
        assert wait_until(lambda: [b["id"] for b in httpx.get(
            f"{registry.http_url}/v1/bans").json()] == [impostor.id], WAIT_S)
    finally:
        impostor.close()


# --- load on the loop -------------------------------------------------------------------


def test_sync_floods_are_rate_limited_and_members_stay_served(registry, victim):
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    try:
        flood.connect(f"tcp://{registry.control_address}")
        from registry.protocol import Sync

        for _ in range(200):
            flood.send(_encode(Sync()))
        assert wait_until(lambda: registry.stats.rejections.get("rate", 0) >= 150, WAIT_S)
        assert victim.heartbeat().status is ReplyStatus.OK
    finally:
        flood.close(linger=0)


def test_dashboard_streams_are_capped(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dashboard, "MAX_STREAMS", 2)
    server = secure_registry()
    try:
        with httpx.Client(timeout=WAIT_S) as client:
            url = f"{server.http_url}/v1/stream"
            with client.stream("GET", url) as first, client.stream("GET", url) as second:
                assert first.status_code == second.status_code == 200
                third = client.get(url)
                assert third.status_code == 503 and "open already" in third.json()["detail"]
            # Closed streams give their slots back.
            assert wait_until(lambda: _stream_opens(client, url), WAIT_S)
    finally:
        server.close()


def _stream_opens(client: httpx.Client, url: str) -> bool:
    with client.stream("GET", url) as response:
        return response.status_code == 200


# --- CURVE: no key, no answer ---------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for name in ("registry", "client", "stranger"):
        generate_keys(tmp_path, name)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "client.key").write_bytes((tmp_path / "client.key").read_bytes())
    return tmp_path


def curve_for(keys: Path, name: str) -> ClientCurve:
    return ClientCurve.from_files(keys / "registry.key", keys / f"{name}.key_secret")


@pytest.fixture
def curve_registry(keys: Path) -> Iterator[RegistryServer]:
    # A short interval: a view that subscribed late hears of the gap at the next pulse.
    server = secure_registry(curve=ServerCurve.from_files(keys / "registry.key_secret",
                                                          keys / "allowed"),
                             heartbeat_interval_s=0.5, lease_s=5.0)
    try:
        yield server
    finally:
        server.close()


def test_curve_lets_in_only_allowed_keys(curve_registry, keys):
    address = curve_registry.control_address
    allowed = RawMember(address, token=TOKEN, curve=curve_for(keys, "client"))
    plain = RawMember(address, member_id="decode-6.6.6.6-1", token=TOKEN)
    stranger = RawMember(address, member_id="decode-6.6.6.6-2", token=TOKEN,
                         curve=curve_for(keys, "stranger"))
    try:
        assert allowed.register().status is ReplyStatus.OK
        for intruder in (plain, stranger):
            # The handshake fails, so there may be no peer to queue for: do not block.
            with contextlib.suppress(zmq.Again):
                intruder.sock.send(_encode(Register(spec=intruder.spec, nonce=b"n" * 16,
                                                    token=TOKEN)), zmq.NOBLOCK)
            assert not intruder.answers(1.0), "a client without an allowed key got an answer"
        assert list(curve_registry.members()) == [allowed.id]
        assert wait_until(lambda: curve_registry.stats.handshake_failures >= 2, WAIT_S)
        with pytest.raises(TimeoutError, match="CURVE"):
            request_snapshot(address, timeout_s=0.5)
        assert [r.spec.id for r in request_snapshot(
            address, curve=curve_for(keys, "client")).members] == [allowed.id]
    finally:
        for member in (allowed, plain, stranger):
            member.close()


def test_curve_end_to_end_with_an_agent_and_a_view(curve_registry, keys):
    """Events too travel only to allowed keys: a view without one never syncs."""
    curve = curve_for(keys, "client")
    spec = member_spec("decode-127.0.0.1-9300", incarnation=new_incarnation(),
                       role=Role.DECODE)
    address = curve_registry.control_address
    with MembershipView(address, curve=curve) as view, \
            MembershipView(address) as blind, \
            Agent(spec, registries=address, token=TOKEN, curve=curve,
                  state=MemberState.READY) as agent:
        assert view.wait_for(lambda m: spec.id in m and m[spec.id].routable, WAIT_S)
        assert wait_until(lambda: agent.registered, WAIT_S)  # its reply may come after
        assert not blind.synced and blind.members() == {}


# --- the state machine ------------------------------------------------------------------

MEMBERS = 3
ALLOWED_NEXT = {
    MemberState.JOINING: set(MemberState),
    MemberState.READY: set(MemberState),
    MemberState.DRAINING: {MemberState.DRAINING},
}
loads = st.builds(Load, st.integers(0, 2**31 - 1), st.integers(0, 100),
                  st.floats(0.0, 1.0))


class LegitimateMembersAndAnAttacker(RuleBasedStateMachine):
    """Legitimate members register, heartbeat and leave; an attacker who knows every
    public field (and sniffs every frame) forges, replays and re-registers in between."""

    @initialize()
    def start(self) -> None:
        self.registry = secure_registry(http_port=-1)
        address = self.registry.control_address
        self.members = [RawMember(address, member_id=f"decode-10.0.0.{i}-8000",
                                  role=Role.DECODE, token=TOKEN,
                                  spec=member_spec(f"decode-10.0.0.{i}-8000", 1 + i,
                                                   Role.DECODE)) for i in range(MEMBERS)]
        self.attacker = RawMember(address, member_id="attacker-1")
        self.expected: dict[str, tuple[MemberState, Load]] = {}
        self.sniffed: list[list[bytes]] = []

    def teardown(self) -> None:
        for member in (*self.members, self.attacker):
            member.close()
        self.registry.close()

    def _sniff(self, member: RawMember) -> None:
        self.sniffed.append(member.last_frames)

    # -- legitimate members -------------------------------------------------------------

    @rule(i=st.integers(0, MEMBERS - 1), state=st.sampled_from(list(MemberState)))
    def register(self, i: int, state: MemberState) -> None:
        member = self.members[i]
        if member.id in self.expected:
            return
        if member.session:  # it left before: a restarted process, a newer incarnation
            member.restart(member.spec.incarnation + 1)
        assert member.register(state).status is ReplyStatus.OK
        self._sniff(member)
        self.expected[member.id] = (state, Load())

    @rule(i=st.integers(0, MEMBERS - 1), state=st.sampled_from(list(MemberState)), load=loads)
    def heartbeat(self, i: int, state: MemberState, load: Load) -> None:
        member = self.members[i]
        if member.id not in self.expected:
            return
        assert member.heartbeat(load, state).status is ReplyStatus.OK
        self._sniff(member)
        held, _ = self.expected[member.id]
        self.expected[member.id] = (state if state in ALLOWED_NEXT[held] else held, load)

    @rule(i=st.integers(0, MEMBERS - 1))
    def leave(self, i: int) -> None:
        member = self.members[i]
        if member.id not in self.expected:
            return
        assert member.bye().status is ReplyStatus.OK
        self._sniff(member)
        del self.expected[member.id]

    # -- the attacker ---------------------------------------------------------------------

    def _answer(self, message: object) -> None:
        reply = self.attacker.ask(message)
        assert reply.status is not ReplyStatus.OK or isinstance(message, Bye), reply

    @rule(i=st.integers(0, MEMBERS - 1), state=st.sampled_from(list(MemberState)), load=loads,
          seq=st.integers(0, 2**63 - 1), proof=st.sampled_from([NO_PROOF, FORGED_PROOF]))
    def forge_heartbeat(self, i, state, load, seq, proof) -> None:
        spec = self.members[i].spec
        self._answer(Heartbeat(spec.id, spec.incarnation, seq, state, load, proof))

    @rule(i=st.integers(0, MEMBERS - 1), seq=st.integers(0, 2**63 - 1))
    def forge_bye(self, i: int, seq: int) -> None:
        spec = self.members[i].spec
        self._answer(Bye(spec.id, spec.incarnation, seq, ByeReason.CRASHED, FORGED_PROOF))

    @rule(i=st.integers(0, MEMBERS - 1), reporter=st.integers(0, MEMBERS - 1))
    def forge_report(self, i: int, reporter: int) -> None:
        spec, by = self.members[i].spec, self.members[reporter].spec
        self._answer(Report(by.id, by.incarnation, 2**62, spec.id, spec.incarnation, "x",
                            FORGED_PROOF))

    @rule(i=st.integers(0, MEMBERS - 1), state=st.sampled_from(list(MemberState)),
          token=st.sampled_from(["", "guess"]))
    def reregister(self, i: int, state: MemberState, token: str) -> None:
        spec = self.members[i].spec
        self._answer(Register(spec=spec, nonce=b"a" * 16, state=state, token=token))

    @precondition(lambda self: self.sniffed)
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """Anything a member sent before, byte for byte (a replayed Register is a retry
        that changes nothing, or the incarnation said bye and it is refused)."""
        self.attacker.send_frames(data.draw(st.sampled_from(self.sniffed)))

    # -- what must hold -----------------------------------------------------------------

    @invariant()
    def records_match_what_members_said(self) -> None:
        if not hasattr(self, "registry"):
            return
        held = self.registry.submit(lambda m, now: {r.id: r for r in m.records()}).result(
            WAIT_S)
        assert set(held) == set(self.expected)
        for member_id, (state, load) in self.expected.items():
            record = held[member_id]
            assert (record.state, record.load, record.suspect) == (state, load, False)
            assert record.spec == next(m.spec for m in self.members if m.id == member_id)



LegitimateMembersAndAnAttacker.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None)
test_no_message_without_a_secret_changes_a_record = LegitimateMembersAndAnAttacker.TestCase
