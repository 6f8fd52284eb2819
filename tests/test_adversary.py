"""An outsider attacks the registry over real sockets (forged, replayed and moved
messages, registering without the token, hostile ids and numbers, floods of syncs,
streams and connections); every attack must fail.

The registry runs as docs/security.md says to run it securely (`--token`, `--admin-token`, and
CURVE where the attack is on the transport). The attacker knows neither token and
everything `/v1/members` publishes (ids, incarnations, specs); it may also replay what
it sniffed. After each attack the membership must be exactly what it was.

The Hypothesis state machine at the end interleaves legitimate members with such an
attacker and checks after every step that no message without a member's secret ever
changed that member's record.
"""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import json
import logging
import math
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
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

from engine_agent import probes
from engine_agent.agent import Agent, new_incarnation
from engine_agent.probes import EngineKind, EngineProbe
from pdreg.cmd_status import fetch_members, render
from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until
from registry import dashboard, http_guard, security, sessions
from registry.client import MembershipView, request_snapshot
from registry.security import ClientCurve, ServerCurve, generate_keys
from registry.server import RegistryConfig, RegistryServer
from wire.limits import NO_PROOF
from wire.protocol import (
    BannedBye,
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
    Sync,
    make_encoder,
)

TOKEN = "fleet-s3cret"
ADMIN = "admin-s3cret"
WAIT_S = 10.0
FORGED_PROOF = b"\x07" * sessions.PROOF_BYTES
_encode = make_encoder().encode


# As the security page says to run a registry: fleet and admin tokens (long timings, so
# nothing expires while a test attacks).
SECURE = {"heartbeat_interval_s": 60.0, "lease_s": 180.0, "token": TOKEN, "admin_token": ADMIN}


def secure_registry(**overrides: object) -> RegistryServer:
    """For the state machines, which take no fixtures: the caller closes it."""
    config = RegistryConfig(port=0, events_port=0, http_port=0)
    return RegistryServer(replace(config, **{**SECURE, **overrides})).start()


@pytest.fixture
def secure(registry_factory: Callable[..., RegistryServer]) -> Callable[..., RegistryServer]:
    """Starts secured registries (SECURE, then the test's overrides); each is closed at
    the end of the test."""
    return lambda **overrides: registry_factory(**{**SECURE, **overrides})


@pytest.fixture
def registry(secure: Callable[..., RegistryServer]) -> RegistryServer:
    return secure()


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
    BannedBye("ID", 0, 10**6, ban_s=2592000.0),
], ids=["draining", "saturated", "bye", "banned-bye"])
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
    assert not registry.submit(lambda m, now: m.admission.banned(now)).result(WAIT_S)


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
        # The real routers' reports do count: two of them outweigh a fresh heartbeat.
        second = RawMember(registry.control_address, member_id="api_server-10.0.0.2-8000",
                           role=Role.API_SERVER, token=TOKEN)
        assert second.register().status is ReplyStatus.OK
        for reporter in (router, second):
            assert reporter.report(victim.id, target, "connect refused").status is \
                ReplyStatus.OK
        second.close()
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


def test_a_restarted_member_takes_its_id_back_once_the_old_process_is_silent(secure):
    server = secure(heartbeat_interval_s=0.2, lease_s=1.0)
    crashed = RawMember(server.control_address, member_id="decode-10.0.0.7-8200",
                        role=Role.DECODE, token=TOKEN)
    try:
        assert crashed.register().status is ReplyStatus.OK  # then never heartbeats again
        with MembershipView(server.control_address) as view:
            restarted = RawMember(server.control_address, token=TOKEN,
                                  spec=msgspec.structs.replace(crashed.spec,
                                                               incarnation=new_incarnation()))
            try:
                assert wait_until(lambda: restarted.register().status is ReplyStatus.OK,
                                  WAIT_S, poll_s=0.2)
                assert view.wait_for(  # left (replaced), then joined again
                    lambda m: crashed.id in m
                    and m[crashed.id].record.spec.incarnation == restarted.spec.incarnation,
                    WAIT_S)
                # The lease that frees the id also expires the old one: either way it left.
                departures = server.stats.departures
                assert departures["expired"] + departures["replaced"] == 1
                assert crashed.heartbeat().status in (ReplyStatus.STALE, ReplyStatus.UNKNOWN)
            finally:
                restarted.close()
    finally:
        crashed.close()


def test_an_insider_is_capped_and_the_refusal_names_the_cap(secure):
    server = secure(max_members=40, max_members_per_model=30)
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
    for m in httpx.get(f"{registry.http_url}/v1/members").json():
        load = m["load"]
        figures = [load["running"], load["waiting"], load["kv_usage"], *load["extra"].values()]
        assert all(math.isfinite(v) for v in figures)


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
        from wire.protocol import Sync

        for _ in range(200):
            flood.send(_encode(Sync()))
        assert wait_until(lambda: registry.stats.rejections.get("rate", 0) >= 150, WAIT_S)
        assert victim.heartbeat().status is ReplyStatus.OK
    finally:
        flood.close(linger=0)


def test_dashboard_streams_are_capped(monkeypatch: pytest.MonkeyPatch, secure):
    monkeypatch.setattr(dashboard, "MAX_STREAMS", 2)
    server = secure()
    with httpx.Client(timeout=WAIT_S) as client:
        url = f"{server.http_url}/v1/stream"
        with client.stream("GET", url) as first, client.stream("GET", url) as second:
            assert first.status_code == second.status_code == 200
            third = client.get(url)
            assert third.status_code == 503 and "open already" in third.json()["detail"]
        # Closed streams give their slots back.
        assert wait_until(lambda: _stream_opens(client, url), WAIT_S)


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
def curve_registry(keys: Path, secure: Callable[..., RegistryServer]) -> RegistryServer:
    # A short interval: a view that subscribed late hears of the gap at the next pulse.
    return secure(curve=ServerCurve.from_files(keys / "registry.key_secret", keys / "allowed"),
                  heartbeat_interval_s=0.5, lease_s=5.0)


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


# --- doors a secured registry must keep shut: admin actions without an admin token, a
# replayed Register, reads and snapshots beyond loopback, fresh identities, slow requests,
# hostile bodies, hijacked ids, a router's reports, engines' credentials and gauges ---------


def _outside_address() -> str | None:
    """This machine's address on its first non-loopback interface, or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if ipaddress.ip_address(address).is_loopback else address


OUTSIDE = _outside_address()
needs_outside = pytest.mark.skipif(OUTSIDE is None, reason="no non-loopback address")
BEARER = {"Authorization": f"Bearer {ADMIN}"}


@needs_outside
def test_admin_actions_without_an_admin_token_come_only_from_this_machine(secure):
    """Bound beyond loopback with only a fleet token, a plain POST or DELETE from the
    network drains, evicts and bans nobody (not even ids that do not exist yet)."""
    server = secure(host=OUTSIDE, admin_token="")
    victim = RawMember(server.control_address, member_id="decode-10.0.0.7-8200",
                       role=Role.DECODE, token=TOKEN)
    try:
        assert victim.register().status is ReplyStatus.OK
        base = f"{server.http_url}/v1/members"
        assert httpx.post(f"{base}/{victim.id}/drain").status_code == 403
        for target in (victim.id, "decode-10.0.0.9-8200"):
            assert httpx.delete(f"{base}/{target}", params={"ban": 2592000}).status_code == 403
        assert record(server, victim.id).state is MemberState.READY
        assert victim.heartbeat().status is ReplyStatus.OK
        assert not server.submit(lambda m, now: m.admission.banned(now)).result(WAIT_S)
    finally:
        victim.close()


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},
], ids=["origin", "null-origin", "sec-fetch"])
def test_a_web_page_cannot_fire_admin_actions(registry, victim, headers):
    """What a browser sends cross-site (a form POST, a fetch) is refused, with or without
    the admin token (a rebinding page would reach loopback with a matching Host)."""
    url = f"{registry.http_url}/v1/members/{victim.id}"
    for extra in ({}, BEARER):
        assert httpx.post(f"{url}/drain", headers={**headers, **extra}).status_code == 403
        assert httpx.delete(url, headers={**headers, **extra}).status_code == 403
    assert record(registry, victim.id).state is MemberState.READY
    assert httpx.post(f"{url}/drain", headers=BEARER).status_code == 200  # the operator's


def test_a_replayed_register_returns_no_session_anyone_can_use(registry):
    victim = RawMember(registry.control_address, member_id="decode-10.0.0.7-8200",
                       role=Role.DECODE, token=TOKEN)
    sniffer = RawMember(registry.control_address, member_id="attacker-1")
    try:
        assert victim.register().status is ReplyStatus.OK
        sniffed = victim.last_frames
        assert TOKEN.encode() not in sniffed[0]  # the token never crosses the wire
        reply = sniffer.send_frames(sniffed)
        assert reply.status is ReplyStatus.OK and reply.session_salt
        # What came back is sealed with the token: as a session it proves nothing.
        for session in (reply.session, sessions.open_session(
                sessions.token_key("guess"), victim.nonce, reply.session_salt,
                reply.session)):
            sniffer.session = session
            for seq in (1, 2**63 - 1):
                forged = Heartbeat(victim.id, victim.spec.incarnation, seq,
                                   MemberState.DRAINING, Load())
                assert sniffer.ask_signed(forged).status is ReplyStatus.REJECTED
        assert record(registry, victim.id).state is MemberState.READY
        assert victim.heartbeat().status is ReplyStatus.OK
    finally:
        victim.close()
        sniffer.close()


def test_a_seq_far_ahead_locks_nobody_out(registry, victim):
    """Even the session holder's own seq = 2^63-1 is refused without moving the last
    seq, so the member's next ordinary heartbeat still counts; re-registering with its
    nonce hands the member its session again."""
    far = Heartbeat(victim.id, victim.spec.incarnation, 2**63 - 1, MemberState.READY, Load())
    reply = victim.ask_signed(far)
    assert reply.status is ReplyStatus.REJECTED and "seq" in reply.reason
    assert victim.heartbeat(Load(running=4)).status is ReplyStatus.OK
    session = victim.session
    assert victim.register().status is ReplyStatus.OK and victim.session == session
    assert victim.heartbeat(Load(running=5)).status is ReplyStatus.OK
    assert record(registry, victim.id).load.running == 5
    assert rejections(registry)["seq"] == 1


def test_a_token_in_clear_is_refused(registry, attacker):
    clear = Register(spec=member_spec("decode-6.6.6.6-80", role=Role.DECODE), nonce=b"n" * 16,
                     token=TOKEN, state=MemberState.READY)
    reply = attacker.ask(clear)
    assert reply.status is ReplyStatus.REJECTED and "token" in reply.reason
    assert registry.members() == {}


@needs_outside
def test_reads_beyond_loopback_need_the_fleet_token(secure):
    server = secure(host=OUTSIDE)
    victim = RawMember(server.control_address, member_id="decode-10.0.0.7-8200",
                       role=Role.DECODE, token=TOKEN)
    try:
        assert victim.register().status is ReplyStatus.OK
        base = server.http_url
        for path in ("/v1/members", f"/v1/members/{victim.id}", "/v1/bans", "/v1/dashboard",
                     "/"):
            refused = httpx.get(f"{base}{path}")
            assert refused.status_code == 401 and victim.id not in refused.text
            assert refused.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(f"{base}/v1/members", headers={"Authorization": "Bearer guess"}
                         ).status_code == 401
        for auth in ({"Authorization": f"Bearer {TOKEN}"}, BEARER):
            members = httpx.get(f"{base}/v1/members", headers=auth).json()
            assert [m["id"] for m in members] == [victim.id]
        basic = httpx.get(f"{base}/v1/dashboard", auth=("operator", TOKEN))  # a browser's
        assert basic.status_code == 200 and victim.id in basic.text
        assert httpx.get(f"{base}/healthz").status_code == 200  # probes stay open
    finally:
        victim.close()


@needs_outside
def test_snapshots_beyond_loopback_need_the_fleet_token(secure):
    server = secure(host=OUTSIDE)
    victim = RawMember(server.control_address, member_id="decode-10.0.0.7-8200",
                       role=Role.DECODE, token=TOKEN)
    address = server.control_address
    try:
        assert victim.register().status is ReplyStatus.OK
        with pytest.raises(RuntimeError, match="fleet token"):
            request_snapshot(address)
        with pytest.raises(RuntimeError, match="fleet token"):
            request_snapshot(address, token="guess")
        for token in (TOKEN, ADMIN):  # pdreg drain/evict prove theirs with the admin token
            assert [r.spec.id for r in request_snapshot(address, token=token).members] == [
                victim.id]
        with MembershipView(address) as blind, MembershipView(address, token=TOKEN) as view:
            assert view.wait_for(lambda m: victim.id in m, WAIT_S)
            assert not blind.synced and blind.members() == {}
        # pdreg status takes the token the way every command does.
        assert [m["id"] for m in fetch_members(address, token=TOKEN)] == [victim.id]
        assert victim.heartbeat().status is ReplyStatus.OK
    finally:
        victim.close()


@needs_outside
def test_fresh_identities_from_one_address_do_not_multiply_snapshots(
        monkeypatch: pytest.MonkeyPatch, secure):
    """Each ZeroMQ connection is an identity with its own sync budget: new connections
    from one address are limited (a burst, then CONNECTS_PER_S), so a flood of fresh
    identities (here an insider's, holding the token) gets few snapshots, and the
    member already connected is served."""
    monkeypatch.setattr(security, "CONNECT_BURST", 8)
    monkeypatch.setattr(security, "CONNECTS_PER_S", 0.01)
    server = secure(host=OUTSIDE)
    victim = RawMember(server.control_address, member_id="decode-10.0.0.7-8200",
                       role=Role.DECODE, token=TOKEN)
    flood = []
    proved_sync = _encode(sessions.prove_sync(Sync(), TOKEN, _encode))  # an insider's
    try:
        assert victim.register().status is ReplyStatus.OK  # its connection: one of 8
        for _ in range(40):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{server.control_address}")
            flood.append(sock)
            with contextlib.suppress(zmq.Again):
                sock.send(proved_sync, zmq.NOBLOCK)
        assert wait_until(lambda: server.stats.syncs >= 7, WAIT_S)  # the rest of the burst
        time.sleep(0.5)  # give the refused ones every chance to be answered after all
        answered = sum(bool(sock.poll(0)) for sock in flood)
        assert answered == server.stats.syncs == 7
        assert victim.heartbeat().status is ReplyStatus.OK
    finally:
        for sock in flood:
            sock.close(linger=0)
        victim.close()


@pytest.mark.parametrize(("address", "events", "allowed"), [
    ("10.0.0.1", [0.0] * 3, [True, True, False]),  # burst of 2
    ("10.0.0.1", [0.0, 0.0, 1.0], [True, True, True]),  # refilled after a second
    ("127.0.0.1", [0.0] * 5, [True] * 5),  # this machine's own clients: never limited
])
def test_connection_limiter_table(address, events, allowed):
    limiter = security.ConnectionLimiter(burst=2, per_s=1.0)
    assert [limiter.allow(address, at) for at in events] == allowed


def test_trickling_requests_are_cut_off_and_real_ones_served(
        monkeypatch: pytest.MonkeyPatch, secure):
    monkeypatch.setattr(http_guard, "REQUEST_READ_TIMEOUT_S", 1.0)
    server = secure()
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    slow = []
    try:
        before = http_guard.guard_stats.read_timeouts
        for _ in range(60):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"GET /v1/members HTTP/1.1\r\nHost: x\r\nX-a: ")
            slow.append(sock)
        # A real request is answered while the slow ones hang...
        assert httpx.get(f"{server.http_url}/v1/members", timeout=WAIT_S).status_code == 200
        # ...and each slow one is closed once its deadline passes, however it trickles.
        for sock in slow:
            sock.settimeout(WAIT_S)
            with contextlib.suppress(OSError):
                sock.sendall(b"b")
            # Closed with unread bytes may read as a reset: as good as a close.
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(100) == b""
        assert http_guard.guard_stats.read_timeouts - before >= 60
    finally:
        for sock in slow:
            sock.close()


@pytest.mark.parametrize("body", [b"[" * 5000, b"{" * 5000, b"x" * 200_000],
                         ids=["nested-list", "nested-object", "large"])
def test_hostile_bodies_get_4xx_and_no_traceback(registry, victim, body, caplog):
    caplog.set_level(logging.ERROR)
    url = f"{registry.http_url}/v1/members/{victim.id}"
    for method in ("POST", "DELETE"):
        target = f"{url}/drain" if method == "POST" else url
        response = httpx.request(method, target, content=body,
                                 headers={"Content-Type": "application/json"})
        assert 400 <= response.status_code < 500
    chunked = httpx.post(f"{url}/drain", content=iter([body]), headers=BEARER)
    assert chunked.status_code in (200, 413)
    assert not [r for r in caplog.records if r.exc_info]
    assert record(registry, victim.id).state in (MemberState.READY, MemberState.DRAINING)


def test_an_insider_cannot_hijack_a_live_id_with_a_newer_incarnation(registry, victim):
    before = record(registry, victim.id)
    insider = RawMember(registry.control_address, token=TOKEN, spec=msgspec.structs.replace(
        victim.spec, incarnation=new_incarnation() + 30 * 10**9,
        endpoints=msgspec.structs.replace(victim.spec.endpoints, http="http://6.6.6.6:8200")))
    try:
        for _ in range(3):
            reply = insider.register()
            assert reply.status is ReplyStatus.REJECTED and "contested" in reply.reason
            assert reply.session == b""
            assert victim.heartbeat().status is ReplyStatus.OK
        assert record(registry, victim.id).spec == before.spec
        assert rejections(registry)["contested"] == 3
        assert registry.stats.departures.get("replaced", 0) == 0
        # Its bye about the id (with its own incarnation) removes nothing either.
        assert insider.bye().status is ReplyStatus.UNKNOWN
        assert record(registry, victim.id).spec == before.spec
    finally:
        insider.close()


def test_one_router_cannot_keep_a_healthy_member_out(registry, victim):
    router = RawMember(registry.control_address, member_id="api_server-10.0.0.1-8000",
                       role=Role.API_SERVER, token=TOKEN)
    try:
        assert router.register().status is ReplyStatus.OK
        target = victim.spec.incarnation
        for _ in range(40):  # 20 a second for two seconds: a router hammering its reports
            assert router.report(victim.id, target, "refused").status is ReplyStatus.OK
            assert not record(registry, victim.id).suspect
        reports = registry.stats.reports
        assert reports["outweighed"] == 1 and reports["limited"] == 39
        assert reports.get("accepted", 0) == 0
        assert public(registry, victim.id)["routable"]
    finally:
        router.close()


def test_load_extras_never_overwrite_the_named_figures(registry, victim):
    fake = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "tok_s": 12.5}
    assert victim.heartbeat(Load(running=500, waiting=900, kv_usage=0.99,
                                 extra=fake)).status is ReplyStatus.OK
    assert wait_until(lambda: public(registry, victim.id)["load"]["running"] == 500, WAIT_S)
    load = public(registry, victim.id)["load"]
    assert (load["running"], load["waiting"], load["kv_usage"]) == (500, 900, 0.99)
    assert load["extra"] == fake
    dashboard_state = httpx.get(f"{registry.http_url}/v1/dashboard").json()
    shown = next(m for m in dashboard_state["members"] if m["id"] == victim.id)["load"]
    assert (shown["running"], shown["waiting"], shown["kv_usage"]) == (500, 900, 0.99)
    table = render(fetch_members(registry.control_address))
    row = next(line for line in table.splitlines() if line.startswith(victim.id))
    assert row.split()[5:8] == ["500", "900", "99"]


def test_the_engine_never_sees_pdregs_credentials(registry, tmp_path):
    """Model code runs inside the engine: it must not find the fleet token (an insider's
    credential) or any other pdreg secret in its environment."""
    seen = tmp_path / "engine-env"
    port = free_low_port()
    engine = (f"env > {shlex.quote(str(seen))}; exec {shlex.quote(sys.executable)} -m "
              f"engine_agent.standins --kind vllm --port {port} --model tiny")
    secrets_env = {"PDREG_TOKEN": TOKEN, "PDREG_ADMIN_TOKEN": ADMIN,
                   "PDREG_API_KEY": "client-key", "PDREG_REGISTRY": registry.control_address}
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "agent", "--engine", "vllm", "--engine-url",
         f"http://127.0.0.1:{port}", "--role", "decode", "--health-interval", "0.1",
         "--", "bash", "-c", engine],
        env={**os.environ, **secrets_env}, preexec_fn=die_with_parent)
    try:
        member_id = f"decode-127.0.0.1-{port}"
        assert wait_until(lambda: (m := registry.members().get(member_id)) is not None
                          and m.state is MemberState.READY, WAIT_S * 3)
        names = {line.partition("=")[0] for line in seen.read_text().splitlines()}
        assert not names & {"PDREG_TOKEN", "PDREG_ADMIN_TOKEN", "PDREG_API_KEY"}
        assert "PDREG_REGISTRY" in names and "PATH" in names  # the rest is the engine's
        assert TOKEN not in seen.read_text()
    finally:
        assert stop_process(sidecar, 30) == 0


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("running", ["+Inf", "-Inf", "NaN", "1e300"])
def test_a_hostile_gauge_is_skipped_and_counted_never_fatal(running):
    _Metrics.body = (
        '# TYPE vllm:num_requests_running gauge\n'
        f'vllm:num_requests_running{{model_name="tiny",engine="0"}} {running}\n'
        'vllm:num_requests_running{model_name="tiny",engine="1"} 3.0\n'
        '# TYPE vllm:num_requests_waiting gauge\n'
        'vllm:num_requests_waiting{model_name="tiny",engine="0"} 2.0\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\n'
        'vllm:kv_cache_usage_perc{model_name="tiny",engine="0"} 0.5\n').encode()
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    probe = EngineProbe(EngineKind.VLLM, f"http://127.0.0.1:{engine.server_address[1]}")
    try:
        before = probes.skipped_values["vllm:num_requests_running"]
        load = probe.load()
        assert load == Load(running=3, waiting=2, kv_usage=0.5)  # the good engine's figures
        assert probe.in_flight() == 5
        assert probes.skipped_values["vllm:num_requests_running"] - before == 2
    finally:
        probe.close()
        engine.shutdown()
        engine.server_close()


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
        # A bye about an id not held is answered OK (idempotent), and changes nothing.
        assert reply.status is not ReplyStatus.OK or isinstance(message, Bye | BannedBye), \
            reply

    @rule(i=st.integers(0, MEMBERS - 1), state=st.sampled_from(list(MemberState)), load=loads,
          seq=st.integers(0, 2**63 - 1), proof=st.sampled_from([NO_PROOF, FORGED_PROOF]))
    def forge_heartbeat(self, i, state, load, seq, proof) -> None:
        spec = self.members[i].spec
        self._answer(Heartbeat(spec.id, spec.incarnation, seq, state, load, proof))

    @rule(i=st.integers(0, MEMBERS - 1), seq=st.integers(0, 2**63 - 1))
    def forge_bye(self, i: int, seq: int) -> None:
        spec = self.members[i].spec
        self._answer(Bye(spec.id, spec.incarnation, seq, ByeReason.CRASHED, FORGED_PROOF))

    @rule(i=st.integers(0, MEMBERS - 1), seq=st.integers(0, 2**63 - 1),
          ban_s=st.floats(0, 1e9))
    def forge_banned_bye(self, i: int, seq: int, ban_s: float) -> None:
        spec = self.members[i].spec
        self._answer(BannedBye(spec.id, spec.incarnation, seq, ban_s, FORGED_PROOF))

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
        assert not self.registry.submit(lambda m, now: m.admission.banned(now)).result(WAIT_S)
        for member_id, (state, load) in self.expected.items():
            record = held[member_id]
            assert (record.state, record.load, record.suspect) == (state, load, False)
            assert record.spec == next(m.spec for m in self.members if m.id == member_id)



LegitimateMembersAndAnAttacker.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None)
test_no_message_without_a_secret_changes_a_record = LegitimateMembersAndAnAttacker.TestCase


# --- the insider state machine: an id hijacked, a member reported out -----------------

VICTIM_ID = "decode-10.0.0.7-8200"
EVIL_HTTP = "http://6.6.6.6:8200"


class LegitimateAgentAndAnInsider(RuleBasedStateMachine):
    """A legitimate member heartbeats; an insider holding the fleet token, with a router
    (api_server) of its own and members of its own, tries to displace it: newer
    incarnations of its id, the same incarnation with another nonce, floods of failure
    reports, forged and replayed heartbeats and byes. CURVE is assumed (as docs/security.md
    says for token holders on the same network): the insider sniffs the victim's sealed
    heartbeats, not the Register exchange.

    After every step: the id is held by the victim's own incarnation and spec, in the
    state and with the load it last announced, and not suspect (one router alone cannot
    outweigh its fresh heartbeats).
    """

    @initialize()
    def start(self) -> None:
        self.registry = secure_registry(http_port=-1)
        address = self.registry.control_address
        self.victim = RawMember(address, token=TOKEN, spec=member_spec(
            VICTIM_ID, new_incarnation(), Role.DECODE, http="http://10.0.0.7:8200"))
        assert self.victim.register().status is ReplyStatus.OK
        self.said: tuple[MemberState, Load] = (MemberState.READY, Load())
        self.router = RawMember(address, member_id="api_server-6.6.6.6-8000",
                                role=Role.API_SERVER, token=TOKEN)
        assert self.router.register().status is ReplyStatus.OK
        self.insider = RawMember(address, token=TOKEN, spec=member_spec(
            VICTIM_ID, self.victim.spec.incarnation, Role.DECODE, http=EVIL_HTTP))
        self.own = 0
        self.sniffed: list[list[bytes]] = []

    def teardown(self) -> None:
        for member in (self.victim, self.router, self.insider):
            member.close()
        self.registry.close()

    # -- the legitimate agent ------------------------------------------------------------

    @rule(state=st.sampled_from([MemberState.READY, MemberState.JOINING]), load=loads)
    def heartbeat(self, state: MemberState, load: Load) -> None:
        assert self.victim.heartbeat(load, state).status is ReplyStatus.OK
        self.sniffed.append(self.victim.last_frames)
        self.said = (state, load)

    # -- the insider ---------------------------------------------------------------------

    @rule(ahead_s=st.floats(-5.0, 59.0), nonce=st.binary(min_size=16, max_size=16),
          same_spec=st.booleans())
    def claim_the_id(self, ahead_s: float, nonce: bytes, same_spec: bool) -> None:
        """A Register for the victim's id: an incarnation near now (a newer one within
        what admission allows, or the very same one) under the insider's own nonce."""
        incarnation = max(self.victim.spec.incarnation,
                          new_incarnation() + int(ahead_s * 1e9))
        spec = self.victim.spec if same_spec else self.insider.spec
        self.insider.nonce = nonce
        reply = self.insider.register(spec=msgspec.structs.replace(spec,
                                                                   incarnation=incarnation))
        assert reply.status is not ReplyStatus.OK, reply
        assert not reply.session

    @rule(count=st.integers(1, 25))
    def flood_reports(self, count: int) -> None:
        for _ in range(count):
            reply = self.router.report(VICTIM_ID, self.victim.spec.incarnation, "refused")
            assert reply.status is ReplyStatus.OK  # noted, limited or outweighed

    @rule(state=st.sampled_from(list(MemberState)), seq=st.integers(0, 2**63 - 1),
          proof=st.sampled_from([NO_PROOF, FORGED_PROOF]), bye=st.booleans())
    def forge(self, state: MemberState, seq: int, proof: bytes, bye: bool) -> None:
        spec = self.victim.spec
        message: object = (Bye(spec.id, spec.incarnation, seq, ByeReason.CRASHED, proof)
                           if bye else Heartbeat(spec.id, spec.incarnation, seq, state,
                                                 Load(), proof))
        assert self.insider.ask(message).status is ReplyStatus.REJECTED

    @precondition(lambda self: self.sniffed)
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        reply = self.insider.send_frames(data.draw(st.sampled_from(self.sniffed)))
        assert reply.status is ReplyStatus.REJECTED

    @rule()
    def register_own_member(self) -> None:
        """What the token is for: members of its own, which change nobody else."""
        self.own += 1
        own = RawMember(self.registry.control_address, token=TOKEN, spec=member_spec(
            f"decode-6.6.6.{self.own}-8000", new_incarnation(), Role.DECODE, http=EVIL_HTTP))
        try:
            assert own.register().status is ReplyStatus.OK
        finally:
            own.close()

    # -- what must hold ------------------------------------------------------------------

    @invariant()
    def the_victim_holds_its_id(self) -> None:
        if not hasattr(self, "registry"):
            return
        held = record(self.registry, VICTIM_ID)
        assert held is not None and held.spec == self.victim.spec
        assert (held.state, held.load, held.suspect) == (*self.said, False)


LegitimateAgentAndAnInsider.TestCase.settings = settings(
    max_examples=15, stateful_step_count=25, deadline=None)
test_an_insider_never_displaces_a_member_that_heartbeats = (
    LegitimateAgentAndAnInsider.TestCase)
