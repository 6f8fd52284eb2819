"""The engine agent against a real registry (RegistryServer in-process, short intervals)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from engine_agent.agent import (
    BACKOFF_MAX_S,
    Agent,
    backoff_delay_s,
    default_member_id,
    new_incarnation,
    wait_for_idle,
)
from pdreg.testing import free_low_port, wait_until
from registry.client import parse_registries
from registry.server import RegistryConfig, RegistryServer
from wire.protocol import ByeReason, Endpoints, Load, MemberSpec, MemberState, ReplyStatus, Role

INTERVAL_S = 0.2
LEASE_S = 1.5
TIMEOUT_S = 10.0  # generous: the machine is shared and loaded


def make_server(port: int = 0, token: str = "") -> RegistryServer:
    return RegistryServer(RegistryConfig(
        host="127.0.0.1", port=port, events_port=0, http_port=-1,
        heartbeat_interval_s=INTERVAL_S, lease_s=LEASE_S, token=token)).start()


def make_spec(port: int = 8100, role: Role = Role.PREFILL,
              incarnation: int | None = None) -> MemberSpec:
    return MemberSpec(
        id=default_member_id(role, "127.0.0.1", port),
        incarnation=new_incarnation() if incarnation is None else incarnation,
        role=role, model="tiny", protocol="vllm-nixl",
        endpoints=Endpoints(http=f"http://127.0.0.1:{port}", kv_host="127.0.0.1",
                            kv_port=5600))


@pytest.fixture
def server() -> Iterator[RegistryServer]:
    srv = make_server()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            agent.stop()


def test_registers_heartbeats_load_and_leaves(server: RegistryServer,
                                              agents: list[Agent]) -> None:
    load = Load(running=3, waiting=1, kv_usage=0.25)
    spec = make_spec()
    agent = Agent(spec, registries=server.control_address, load=lambda: load).start()
    agents.append(agent)
    assert wait_until(lambda: spec.id in server.members(), TIMEOUT_S)
    assert server.members()[spec.id].state is MemberState.JOINING
    assert wait_until(lambda: agent.registered, TIMEOUT_S)

    agent.set_state(MemberState.READY)
    assert wait_until(lambda: server.members()[spec.id].state is MemberState.READY, TIMEOUT_S)
    assert wait_until(lambda: server.members()[spec.id].load == load, TIMEOUT_S)
    load = Load(running=7, waiting=0, kv_usage=0.5)
    assert wait_until(lambda: server.members()[spec.id].load == load, TIMEOUT_S)

    agent.stop()
    assert wait_until(lambda: spec.id not in server.members(), TIMEOUT_S)
    agent.stop()  # safe twice


def test_failing_or_invalid_load_callback_sends_last_good_load(
        server: RegistryServer, agents: list[Agent]) -> None:
    good = Load(running=5)
    calls = {"n": 0}

    def flaky_load() -> Load:
        calls["n"] += 1
        if calls["n"] <= 2:
            return good
        if calls["n"] % 2:
            raise RuntimeError("metrics endpoint down")
        return Load(running=1, kv_usage=2.0)  # out of range: must not reach the wire

    spec = make_spec()
    agent = Agent(spec, registries=server.control_address, load=flaky_load,
                  state=MemberState.READY).start()
    agents.append(agent)
    assert wait_until(lambda: calls["n"] >= 8, TIMEOUT_S)
    member = server.members()[spec.id]
    assert member.load == good
    assert agent.registered


def test_rejoins_within_about_one_interval_after_registry_restart(agents: list[Agent]) -> None:
    srv = make_server()
    port = srv.control_port
    spec = make_spec()
    try:
        agent = Agent(spec, registries=srv.control_address, state=MemberState.READY).start()
        agents.append(agent)
        assert wait_until(lambda: spec.id in srv.members(), TIMEOUT_S)
    finally:
        srv.close()
    srv = make_server(port)
    try:
        started = time.monotonic()
        assert wait_until(lambda: spec.id in srv.members(), TIMEOUT_S)
        rejoin_s = time.monotonic() - started
        # Interval + one round trip, plus slack for a loaded machine and the snapshot
        # period of the registry's members() view.
        assert rejoin_s < 2.5, rejoin_s
        assert srv.members()[spec.id].state is MemberState.READY
    finally:
        srv.close()


def test_keeps_trying_while_registry_is_down_and_joins_when_it_appears(
        agents: list[Agent]) -> None:
    port = free_low_port()
    spec = make_spec()
    agent = Agent(spec, registries=f"127.0.0.1:{port}").start()
    agents.append(agent)
    assert not wait_until(lambda: agent.registered, 1.0)
    srv = make_server(port)
    try:
        assert wait_until(lambda: spec.id in srv.members(), TIMEOUT_S)
        assert wait_until(lambda: agent.registered, TIMEOUT_S)  # its reply may come later
    finally:
        srv.close()


def test_unreachable_or_silent_registry_never_blocks_the_caller() -> None:
    """An engine's own start-up and shutdown never wait on a registry: start(),
    set_state() and stop() return while one registry refuses connections and the other
    holds the agent's Register unanswered for ever."""
    import zmq

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    registries = [f"127.0.0.1:{free_low_port()}", f"127.0.0.1:{silent_port}"]
    spec = make_spec()
    agent = Agent(spec, registries=registries)

    def returns(call: Callable[[], object]) -> bool:
        """Whether `call` returns (on a thread of its own; a call that waited for the
        silent registry's reply would still be waiting at the deadline)."""
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(TIMEOUT_S)
        return not caller.is_alive()

    try:
        assert returns(lambda: (agent.start(), agent.set_state(MemberState.READY)))
        assert silent.poll(TIMEOUT_S * 1000)  # the agent's Register is there, unanswered
        assert not wait_until(lambda: agent.registered, 0.8)
        # The bye is skipped after a short wait, and the loop thread has ended (stop()
        # did not give up on it after its own join timeout).
        assert returns(agent.stop)
        assert not any(t.name == f"pdreg-agent-{spec.id}" for t in threading.enumerate())
    finally:
        agent.stop()
        silent.close()
        ctx.term()


def test_a_newer_incarnation_waits_while_the_holder_heartbeats(
        server: RegistryServer, agents: list[Agent]) -> None:
    old_spec = make_spec(incarnation=1000)
    old = Agent(old_spec, registries=server.control_address).start()
    agents.append(old)
    assert wait_until(lambda: old.registered, TIMEOUT_S)
    new = Agent(make_spec(incarnation=2000), registries=server.control_address).start()
    agents.append(new)
    assert wait_until(lambda: server.stats.rejections.get("contested", 0) >= 2, TIMEOUT_S)
    assert server.members()[old_spec.id].spec.incarnation == 1000 and not new.registered
    old.stop()  # said bye: the id is free, and the waiting agent takes it
    assert wait_until(lambda: new.registered and server.members().get(old_spec.id)
                      is not None and server.members()[old_spec.id].spec.incarnation
                      == 2000, TIMEOUT_S)


def test_an_agent_told_stale_registers_again_until_its_id_is_free(
        server: RegistryServer, agents: list[Agent], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="engine_agent")
    spec = make_spec(incarnation=1000)
    agent = Agent(spec, registries=server.control_address).start()
    agents.append(agent)
    assert wait_until(lambda: agent.registered, TIMEOUT_S)
    newer = msgspec.structs.replace(spec, incarnation=2000)

    def usurp(membership, now):  # a newer incarnation that never heartbeats
        membership.evict(spec.id, now)
        return membership.register(newer, MemberState.READY, Load(), now, nonce=b"u" * 16)

    assert server.submit(usurp).result(TIMEOUT_S).status is ReplyStatus.OK
    assert wait_until(lambda: "STALE" in caplog.text, TIMEOUT_S)
    # The usurper expires after its lease; the agent, still trying, is back.
    assert wait_until(lambda: server.members().get(spec.id) is not None
                      and server.members()[spec.id].spec.incarnation == 1000
                      and agent.registered, TIMEOUT_S + LEASE_S)


def test_bad_token_is_rejected_and_logged(agents: list[Agent],
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="engine_agent")
    srv = make_server(token="s3cret")
    try:
        spec = make_spec()
        agent = Agent(spec, registries=srv.control_address, token="wrong").start()
        agents.append(agent)
        assert wait_until(lambda: "REJECTED" in caplog.text, TIMEOUT_S)
        assert "token" in caplog.text
        assert not agent.registered and spec.id not in srv.members()
        good = Agent(make_spec(port=8101), registries=srv.control_address,
                     token="s3cret").start()
        agents.append(good)
        assert wait_until(lambda: good.registered, TIMEOUT_S)
    finally:
        srv.close()


def test_drain_waits_for_in_flight_then_says_bye(server: RegistryServer,
                                                agents: list[Agent]) -> None:
    spec = make_spec(role=Role.DECODE)
    agent = Agent(spec, registries=server.control_address, state=MemberState.READY).start()
    agents.append(agent)
    assert wait_until(lambda: spec.id in server.members(), TIMEOUT_S)
    in_flight = {"n": 2}
    result: dict[str, bool] = {}
    drainer = threading.Thread(target=lambda: result.update(
        drained=agent.drain(lambda: in_flight["n"], timeout_s=TIMEOUT_S)))
    drainer.start()
    try:
        assert wait_until(
            lambda: server.members()[spec.id].state is MemberState.DRAINING, TIMEOUT_S)
        in_flight["n"] = 0
        assert wait_until(lambda: spec.id not in server.members(), TIMEOUT_S)
    finally:
        in_flight["n"] = 0
        drainer.join(TIMEOUT_S)
    assert result == {"drained": True}


def test_drain_times_out(server: RegistryServer) -> None:
    agent = Agent(make_spec(), registries=server.control_address).start()
    try:
        started = time.monotonic()
        assert agent.drain(lambda: 1, timeout_s=0.3) is False
        assert time.monotonic() - started < 2.0
    finally:
        agent.stop(ByeReason.SHUTDOWN)


def test_invalid_spec_fails_at_construction() -> None:
    bad_url = make_spec()
    bad_url = MemberSpec(id=bad_url.id, incarnation=1, role=Role.PREFILL, model="tiny",
                         protocol="vllm-nixl", endpoints=Endpoints(http="not a url"))
    with pytest.raises(ValueError, match=r"endpoints\.http"):
        Agent(bad_url, registries="127.0.0.1:7600")
    with pytest.raises(ValueError, match="invalid member spec"):
        Agent(MemberSpec(id="has space", incarnation=1, role=Role.PREFILL, model="m",
                         protocol="vllm-nixl", endpoints=Endpoints(http="http://h:1")),
              registries="127.0.0.1:7600")


@pytest.mark.parametrize(("failures", "low", "high"), [
    (1, 0.05, 0.1),
    (2, 0.1, 0.2),
    (3, 0.2, 0.4),
    (10, BACKOFF_MAX_S / 2, BACKOFF_MAX_S),
    (100, BACKOFF_MAX_S / 2, BACKOFF_MAX_S),
])
def test_backoff_is_exponential_with_jitter_and_capped(failures: int, low: float,
                                                       high: float) -> None:
    rng = random.Random(0)
    for _ in range(50):
        assert low <= backoff_delay_s(failures, rng) <= high


def test_registry_addresses_are_parsed_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_registries("a:1, b:2,a:1") == ["a:1", "b:2"]
    assert parse_registries(["tcp://h:7600"]) == ["h:7600"]
    monkeypatch.setenv("PDREG_REGISTRY", "env:9")
    assert parse_registries(None) == ["env:9"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        Agent(make_spec(), registries="nohost")


def test_drain_waits_for_a_quiet_period_not_a_single_zero():
    start = time.monotonic()

    def in_flight() -> int:
        # Idle at first, then a late request arrives (sent before a router saw DRAINING).
        return 1 if 0.1 <= time.monotonic() - start < 0.3 else 0

    assert wait_for_idle(in_flight, timeout_s=10.0, member_id="d", quiet_s=0.4)
    assert time.monotonic() - start >= 0.3 + 0.4


def test_drain_times_out_while_busy():
    assert not wait_for_idle(lambda: 1, timeout_s=0.2, member_id="d", quiet_s=0.1)


def test_set_state_and_report_after_stop_touch_no_reused_descriptor(
        server: RegistryServer) -> None:
    """Once stopped, a late set_state() or report() must not write into whatever file
    the process opened since under the wake-up's old descriptor number."""
    import os

    agent = Agent(make_spec(), registries=server.control_address).start()
    assert wait_until(lambda: agent.registered, TIMEOUT_S)
    agent.stop()
    pipes = [os.pipe() for _ in range(8)]  # likely to reuse the freed descriptor numbers
    try:
        agent.set_state(MemberState.DRAINING)
        agent.report("decode-x-1", 1, "late")
        for read_end, _ in pipes:
            os.set_blocking(read_end, False)
            with pytest.raises(BlockingIOError):
                os.read(read_end, 1)
    finally:
        for read_end, write_end in pipes:
            os.close(read_end)
            os.close(write_end)


def test_a_stop_right_after_start_still_says_bye(server: RegistryServer) -> None:
    """The bye needs the session the Register's reply brings: stop() waits for it."""
    for port in range(8100, 8105):
        Agent(make_spec(port), registries=server.control_address).start().stop()
    # Well within the lease: nobody lingers until expiry.
    assert wait_until(lambda: not server.members(), LEASE_S / 2), list(server.members())


def test_a_woken_loop_goes_back_to_sleep(server: RegistryServer, agents: list[Agent]) -> None:
    """A state change wakes the loop; the wake-up must be consumed, or every later poll
    returns at once and the agent burns a core next to its engine (pyzmq reports a plain
    socket by its descriptor, which the loop once failed to recognise)."""
    agent = Agent(make_spec(), registries=server.control_address)
    rounds = 0
    receive = agent._receive

    def counted(*args: object) -> None:
        nonlocal rounds
        rounds += 1
        receive(*args)  # type: ignore[arg-type]

    agent._receive = counted  # type: ignore[method-assign]
    agents.append(agent.start())
    assert wait_until(lambda: agent.registered, TIMEOUT_S)
    agent.set_state(MemberState.READY)
    # members() is the published view: it may not hold the member yet when it registered.
    assert wait_until(lambda: getattr(server.members().get(agent.spec.id), "state", None)
                      is MemberState.READY, TIMEOUT_S)
    before = rounds
    time.sleep(1.0)  # the window counted: one heartbeat interval is 0.2 s
    # A sleeping loop turns a few times per interval (send, reply); a spinning one
    # turns hundreds of thousands of times a second.
    assert rounds - before < 100, f"{rounds - before} loop rounds in 1 s while idle"


def test_a_ban_at_one_registry_is_passed_on_to_the_others(agents: list[Agent]) -> None:
    """An operator bans a member at registry A: its agent says a BannedBye to B, which
    then holds the ban too. A later process with that id, at B and a registry that never
    heard of the ban (a restarted A), is refused at B and passes the ban on to the other."""
    a, b, c = make_server(), make_server(), make_server()
    try:
        spec = make_spec(port=8140)
        first = Agent(spec, registries=[a.control_address, b.control_address]).start()
        agents.append(first)
        assert wait_until(lambda: spec.id in a.members() and spec.id in b.members(),
                          TIMEOUT_S)

        def bans(server: RegistryServer) -> dict[str, float]:
            return server.submit(lambda m, now: m.admission.banned(now)).result(TIMEOUT_S)

        a.submit(lambda m, now: m.evict(spec.id, now, ban_s=300.0)).result(TIMEOUT_S)
        assert wait_until(lambda: spec.id in bans(b), TIMEOUT_S)
        assert spec.id not in b.members() and 0 < bans(b)[spec.id] <= 300.0
        assert wait_until(lambda: not first.registered, TIMEOUT_S)

        later = Agent(make_spec(port=8140), registries=[c.control_address,
                                                        b.control_address]).start()
        agents.append(later)
        assert wait_until(lambda: spec.id in bans(c), TIMEOUT_S)
        assert 0 < bans(c)[spec.id] <= bans(b)[spec.id] + 1.0
        assert wait_until(lambda: spec.id not in c.members() and not later.registered,
                          TIMEOUT_S)
    finally:
        for server in (a, b, c):
            server.close()
