"""The registry over real sockets: ZeroMQ control and events, HTTP, CLI, metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import pytest
import zmq
from raw_member import RawMember

from pdreg.testing import wait_until
from registry.client import MembershipView
from registry.outcome import Refusal
from registry.server import HARD_MESSAGE_CAP_BYTES, RegistryConfig, RegistryServer
from wire.limits import MAX_MESSAGE_BYTES
from wire.protocol import (
    ByeReason,
    Load,
    MemberState,
    ReplyStatus,
    Sync,
    make_encoder,
    reply_decoder,
)

# Members in these tests heartbeat by hand, so the default registry is patient; the
# detector tests start their own with short timings.
INTERVAL_S = 1.0
LEASE_S = 5.0
FAST_INTERVAL_S = 0.2
SUSPECT_WINDOW_LEASE_S = 2.0
WAIT_S = 10.0  # generous: other test processes share two cores


def start_registry(**overrides: object) -> RegistryServer:
    config = RegistryConfig(port=0, events_port=0, http_port=0, heartbeat_interval_s=INTERVAL_S,
                            lease_s=LEASE_S)
    return RegistryServer(replace(config, **overrides)).start()


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryServer]) -> RegistryServer:
    return registry_factory(heartbeat_interval_s=INTERVAL_S, lease_s=LEASE_S)


@pytest.fixture
def member(registry: RegistryServer) -> Iterator[RawMember]:
    m = RawMember(registry.control_address)
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def view(registry: RegistryServer) -> Iterator[MembershipView]:
    with MembershipView(registry.control_address) as v:
        assert v.wait_for(lambda _: v.synced, WAIT_S)
        yield v


def settles(predicate) -> bool:
    return wait_until(predicate, WAIT_S)


def metric(registry: RegistryServer, series: str) -> float:
    """One series' value, named exactly as exposed: `name` or `name{label="v"}`."""
    for line in httpx.get(f"{registry.http_url}/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    raise AssertionError(f"{series} not in /metrics")


def test_register_is_visible_everywhere(registry, member, view):
    reply = member.register()
    assert reply.status is ReplyStatus.OK
    assert reply.heartbeat_interval_s == INTERVAL_S
    assert reply.events_port == registry.events_port and reply.http_port == registry.http_port

    assert view.wait_for(lambda m: member.spec.id in m and m[member.spec.id].routable, WAIT_S)

    listed = httpx.get(f"{registry.http_url}/v1/members").json()
    assert [m["id"] for m in listed] == [member.spec.id]
    one = httpx.get(f"{registry.http_url}/v1/members/{member.spec.id}").json()
    assert one["role"] == "prefill" and one["state"] == "ready" and one["model"] == "tiny"
    assert httpx.get(f"{registry.http_url}/v1/members/nobody").status_code == 404

    with member.kept_alive(INTERVAL_S):  # the CLI starts slowly on a busy machine
        status = subprocess.run(
            [sys.executable, "-m", "pdreg", "status", "--registry", registry.control_address,
             "--json"], capture_output=True, text=True, timeout=60, check=True)
        table = subprocess.run(
            [sys.executable, "-m", "pdreg", "status", "--registry", registry.control_address],
            capture_output=True, text=True, timeout=60, check=True).stdout
    members = json.loads(status.stdout)
    assert members[0]["id"] == member.spec.id
    for key in ("id", "role", "model", "state", "incarnation", "protocol", "endpoints", "load",
                "heartbeat_age_s"):
        assert key in members[0]
    assert set(members[0]["load"]) >= {"running", "waiting", "kv_usage"}

    assert member.spec.id in table and "ready" in table and "routable: 1 prefill" in table


def test_member_filters(registry, member):
    member.register(MemberState.JOINING)
    base = f"{registry.http_url}/v1/members"
    assert len(httpx.get(base, params={"role": "prefill"}).json()) == 1
    assert httpx.get(base, params={"role": "decode"}).json() == []
    assert len(httpx.get(base, params={"state": "joining"}).json()) == 1
    assert httpx.get(base, params={"state": "routable"}).json() == []
    assert httpx.get(base, params={"role": "encoder"}).status_code == 400
    assert httpx.get(base, params={"state": "sleepy"}).status_code == 400


def test_heartbeats_carry_load_to_views(registry, member, view):
    member.register()
    member.heartbeat(Load(running=5, waiting=2, kv_usage=0.5))
    assert view.wait_for(lambda m: member.spec.id in m and m[member.spec.id].load.running == 5,
                         WAIT_S)
    assert settles(lambda: registry.members()[member.spec.id].load.waiting == 2)


def test_silent_member_is_suspected_then_expired(registry_factory):
    # Suspect after 2 intervals (0.4 s), expired at the lease: a window of 1.6 s in which
    # the view must see the member present and suspect, not merely gone.
    registry = registry_factory(heartbeat_interval_s=FAST_INTERVAL_S,
                                lease_s=SUSPECT_WINDOW_LEASE_S)
    member = RawMember(registry.control_address)
    try:
        with MembershipView(registry.control_address) as view:
            member.register()
            assert view.wait_for(lambda m: member.spec.id in m, WAIT_S)
            assert view.wait_for(
                lambda m: member.spec.id in m and m[member.spec.id].record.suspect, WAIT_S)
            assert view.wait_for(lambda m: member.spec.id not in m, WAIT_S)
        # Expiry runs on the registry's own timer: the member sent nothing after its
        # Register, so no message of its own can have made the registry look at it.
        # (How late a busy machine lets the loop run is no test here: the registry moves
        # its deadlines by its own lag on purpose.)
        assert metric(registry, 'pdreg_departures_total{reason="expired"}') == 1
    finally:
        member.close()


def test_bye_is_gone_at_once(registry, member, view):
    member.register()
    assert view.wait_for(lambda m: member.spec.id in m, WAIT_S)
    assert member.bye(ByeReason.SHUTDOWN).status is ReplyStatus.OK
    assert view.wait_for(lambda m: member.spec.id not in m, WAIT_S)
    # Gone by its bye, not by waiting for the lease to run out.
    assert metric(registry, 'pdreg_departures_total{reason="bye"}') == 1
    assert metric(registry, 'pdreg_departures_total{reason="expired"}') == 0


def test_restarted_registry_asks_members_to_register_again(registry, member):
    member.register()
    with MembershipView(registry.control_address) as view:
        assert view.wait_for(lambda m: member.spec.id in m, WAIT_S)
        old_epoch = view.links()[0].epoch
        port, events_port, http_port = (registry.control_port, registry.events_port,
                                        registry.http_port)
        registry.close()
        restarted = start_registry(port=port, events_port=events_port, http_port=http_port)
        try:
            reply = member.heartbeat()
            assert reply.status is ReplyStatus.UNKNOWN
            assert "register again" in reply.reason
            assert member.register().status is ReplyStatus.OK
            assert settles(lambda: member.spec.id in restarted.members())
            # The view followed the new epoch and never lost the member on the way.
            assert view.wait_for(lambda m: view.links()[0].epoch not in (0, old_epoch),
                                 WAIT_S)
            assert member.spec.id in view.members()
        finally:
            restarted.close()


@pytest.mark.parametrize("garbage", [
    [b"\x00\x01garbage"],
    [os.urandom(512)],
    [make_encoder().encode(["Heartbeat", "x", "not-an-int", 1, 2, [0, 0, 0.0]])],
    [make_encoder().encode({"hello": "world"})],
    [b"three", b"whole", b"frames"],
    [b"\x91" + b"\xa1x" * 10],
    [b"x" * (MAX_MESSAGE_BYTES + 1)],
], ids=["bytes", "random", "wrong-type", "map", "multipart", "truncated", "oversized"])
def test_garbage_is_refused_counted_and_harmless(registry, member, garbage):
    member.register()
    before = sum(_rejections(registry).values())
    intruder = zmq.Context.instance().socket(zmq.DEALER)
    intruder.setsockopt(zmq.LINGER, 0)
    try:
        intruder.connect(f"tcp://{registry.control_address}")
        intruder.send_multipart(garbage)
        assert intruder.poll(WAIT_S * 1e3), "the registry should answer with a rejection"
        reply = reply_decoder().decode(intruder.recv())
        assert reply.status is ReplyStatus.REJECTED and reply.reason
    finally:
        intruder.close(linger=0)
    assert settles(lambda: sum(_rejections(registry).values()) == before + 1)
    # The loop is alive and the member untouched.
    assert member.heartbeat().status is ReplyStatus.OK
    assert member.spec.id in registry.members()


def test_huge_frames_and_floods_do_not_hurt(registry, member):
    member.register()
    ctx = zmq.Context.instance()
    huge = ctx.socket(zmq.DEALER)
    huge.setsockopt(zmq.LINGER, 0)
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)
    try:
        huge.connect(f"tcp://{registry.control_address}")
        huge.send(b"\x00" * (HARD_MESSAGE_CAP_BYTES * 4))  # libzmq drops this peer
        flood.connect(f"tcp://{registry.control_address}")
        for _ in range(5000):
            flood.send(b"\xc1", zmq.NOBLOCK)
        for _ in range(20):
            assert member.heartbeat().status is ReplyStatus.OK
        assert settles(lambda: _rejections(registry).get("malformed", 0) >= 5000)
    finally:
        huge.close(linger=0)
        flood.close(linger=0)
    assert member.spec.id in registry.members()
    assert metric(registry, "pdreg_loop_errors_total") == 0


def test_wrong_token_is_refused():
    server = start_registry(token="s3cret")
    try:
        wrong = RawMember(server.control_address, token="guess")
        right = RawMember(server.control_address, member_id="decode-127.0.0.1-9002",
                          token="s3cret")
        reply = wrong.register()
        assert reply.status is ReplyStatus.REJECTED and "token" in reply.reason
        assert right.register().status is ReplyStatus.OK
        assert settles(lambda: list(server.members()) == ["decode-127.0.0.1-9002"])
        assert metric(server, 'pdreg_registrations_total{result="rejected"}') == 1
        wrong.close()
        right.close()
    finally:
        server.close()


def test_stale_incarnation_is_refused(registry):
    new = RawMember(registry.control_address, incarnation=5)
    old = RawMember(registry.control_address, incarnation=4)
    try:
        assert new.register().status is ReplyStatus.OK
        assert old.register().status is ReplyStatus.STALE
        assert old.heartbeat().status is ReplyStatus.STALE
        assert settles(lambda: registry.members().get(new.spec.id) is not None)
        assert registry.members()[new.spec.id].spec.incarnation == 5
    finally:
        new.close()
        old.close()


def test_admin_actions_need_the_admin_token():
    server = start_registry(admin_token="adm")
    m = RawMember(server.control_address)
    try:
        m.register()
        assert settles(lambda: m.spec.id in server.members())
        url = f"{server.http_url}/v1/members/{m.spec.id}"
        assert httpx.post(f"{url}/drain").status_code == 401
        assert httpx.post(f"{url}/drain",
                          headers={"Authorization": "Bearer nope"}).status_code == 401
        auth = {"Authorization": "Bearer adm"}
        assert httpx.post(f"{url}/drain", headers=auth).status_code == 200
        assert settles(lambda: server.members()[m.spec.id].state is MemberState.DRAINING)
        assert httpx.post(f"{server.http_url}/v1/members/ghost/drain",
                          headers=auth).status_code == 404
        assert httpx.delete(url).status_code == 401
        assert httpx.delete(url, headers=auth).status_code == 200
        assert settles(lambda: m.spec.id not in server.members())
        # An evicted member that keeps heartbeating is told to register again.
        assert m.heartbeat().status is ReplyStatus.UNKNOWN
    finally:
        m.close()
        server.close()


def test_drain_cli(registry, member):
    member.register()
    assert settles(lambda: member.spec.id in registry.members())
    with member.kept_alive(INTERVAL_S):
        out = subprocess.run([sys.executable, "-m", "pdreg", "drain", member.spec.id,
                              "--registry", registry.control_address], capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert settles(
        lambda: registry.members()[member.spec.id].state is MemberState.DRAINING)


def test_sync_filters_by_model(registry, member):
    member.register()
    assert settles(lambda: member.spec.id in registry.members())
    assert [r.spec.id for r in member.ask(Sync(models=["tiny"])).members] == [member.spec.id]
    assert member.ask(Sync(models=["other"])).members == []


def test_metrics_pass_promtool(registry, member):
    member.register()
    member.heartbeat(Load(running=1))
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing in CI: .ci/run installs the prometheus package")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    text = httpx.get(f"{registry.http_url}/metrics").text
    for name in ("pdreg_members", "pdreg_heartbeats_total", "pdreg_registrations_total",
                 "pdreg_departures_total", "pdreg_rejected_messages_total",
                 "pdreg_member_heartbeat_age_seconds", "pdreg_membership_version",
                 "pdreg_self_preservation", "pdreg_loop_lag_seconds"):
        assert re.search(rf"^{name}[{{ ]", text, re.MULTILINE), f"{name} not exposed"
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_openapi_and_health(registry):
    assert httpx.get(f"{registry.http_url}/healthz").json()["status"] == "ok"
    paths = httpx.get(f"{registry.http_url}/openapi.json").json()["paths"]
    assert {"/v1/members", "/v1/members/{member_id}", "/v1/members/{member_id}/drain"} <= set(
        paths)


def test_every_refusal_kind_is_a_series_from_the_start(registry):
    """A dashboard's rate() of a refusal kind needs its series before the first one."""
    assert _rejections(registry) == {refusal.value: 0.0 for refusal in Refusal}


def _rejections(registry: RegistryServer) -> dict[str, float]:
    text = httpx.get(f"{registry.http_url}/metrics").text
    found = {}
    for line in text.splitlines():
        if line.startswith("pdreg_rejected_messages_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


def test_a_view_merges_several_registries_and_survives_losing_one():
    first, second = start_registry(), start_registry()
    addresses = [first.control_address, second.control_address]
    both = RawMember(first.control_address, member_id="decode-127.0.0.1-9100")
    only_second = RawMember(second.control_address, member_id="prefill-127.0.0.1-9101")
    also_second = RawMember(second.control_address, member_id="decode-127.0.0.1-9100")
    try:
        with MembershipView(addresses) as view:
            both.register()
            also_second.register()  # the same member heartbeats to each registry
            only_second.register()
            assert view.wait_for(lambda m: set(m) == {"decode-127.0.0.1-9100",
                                                       "prefill-127.0.0.1-9101"}, WAIT_S)
            # Both links live (the second alone holds everyone, so the view may show them
            # all while the first still syncs; a link that never synced is not "away").
            assert settles(lambda: all(link.state.value == "live" for link in view.links()))
            first.close()  # one registry gone: the view keeps serving from the other
            # Keep the members alive on the second while the view notices the first is away.
            assert settles(lambda: (also_second.heartbeat(), only_second.heartbeat())
                           and view.links()[0].state.value == "away")
            assert set(view.members()) == {"decode-127.0.0.1-9100", "prefill-127.0.0.1-9101"}
    finally:
        for m in (both, only_second, also_second):
            m.close()
        first.close()
        second.close()


def test_members_json_lists_the_adapters_and_context_length_a_router_serves_by() -> None:
    from registry.views import member_json
    from wire.protocol import Endpoints, MemberRecord, MemberSpec, MemberState, Role

    spec = MemberSpec(id="decode-a", incarnation=1, role=Role.DECODE, model="tiny",
                      protocol="vllm-nixl", endpoints=Endpoints(http="http://10.0.0.1:8000"),
                      adapters=("sql", "chat"), max_model_len=2048)
    shown = member_json(MemberRecord(spec=spec, state=MemberState.READY), 0.0)
    assert shown["adapters"] == ["sql", "chat"] and shown["max_model_len"] == 2048
