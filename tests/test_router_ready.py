"""/ready's detail: a status and the warnings an operator must see, and the log saying
each warning once, at start and whenever it changes. The first warning: members whose
HTTP or KV address is outside --allow-upstream, which no request can ever reach."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import msgspec
import pytest
from standins_fleet import Fleet, LoopThread, live_member

from pdreg.testing import wait_until
from registry.client import LiveMember
from router.guard import LOOPBACK_ALLOW, UpstreamPolicy
from router.readiness import Readiness, ReadyWarning
from router.service import RouterConfig, RouterServer
from router.unroutable import MAX_NAMED, Unroutable
from wire.protocol import Handshake, Role

P, D = Role.PREFILL, Role.DECODE
BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


def start_router(routers: list[RouterServer], fleet: Fleet, **config: Any) -> RouterServer:
    server = RouterServer(RouterConfig(port=0, warm_connections=0, **config),
                          fleet.view).start()
    routers.append(server)
    return server


def ready(server: RouterServer, api_key: str = "") -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(server.url + "/ready", headers=headers)
    return r.status_code, r.json()


def said(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and text in r.getMessage()]


def kv_host_of(member: LiveMember, kv_host: str) -> LiveMember:
    """`member` as if it registered `kv_host` for its KV side."""
    spec = member.record.spec
    spec = msgspec.structs.replace(spec, endpoints=msgspec.structs.replace(
        spec.endpoints, kv_host=kv_host))
    return msgspec.structs.replace(member, record=msgspec.structs.replace(member.record, spec=spec))


# --- over real sockets -----------------------------------------------------------------------

def test_members_outside_allow_upstream_are_said_at_start_in_ready_and_the_log(
        loop_thread: LoopThread, routers: list[RouterServer],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router")
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D)
    server = start_router(routers, fleet, allow_upstream="10.0.0.0/8")
    # At start, with no request and no probe: the router follows membership itself.
    assert wait_until(lambda: said(caplog, logging.WARNING, "never be routed"), 10)
    status, body = ready(server)
    assert status == 200 and body["status"] == "ready"  # a warning never makes it unready
    (warning,) = body["warnings"]
    assert "2 member(s) can never be routed to" in warning and "10.0.0.0/8" in warning
    assert "d1 (http 127.0.0.1)" in warning and "p1 (http 127.0.0.1)" in warning
    # What the warning foretells: every request to them fails.
    assert httpx.post(server.url + "/v1/completions", json=BODY, timeout=30).status_code == 502
    assert "pdreg_router_unroutable_members 2.0" in httpx.get(server.url + "/metrics").text
    for _ in range(3):
        ready(server)
    assert len(said(caplog, logging.WARNING, "never be routed")) == 1  # once, not per probe
    fleet.remove("p1")
    status, body = ready(server)
    assert "1 member(s)" in body["warnings"][0] and "p1" not in body["warnings"][0]
    assert len(said(caplog, logging.WARNING, "never be routed")) == 2  # it changed: said again
    fleet.remove("d1")
    assert ready(server) == (200, {"status": "ready", "warnings": []})
    assert said(caplog, logging.INFO, "no longer: 1 member(s) can never be routed")


def test_a_kv_address_outside_allow_upstream_is_a_warning_too(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D)
    server = start_router(routers, fleet, allow_upstream=LOOPBACK_ALLOW)
    assert ready(server) == (200, {"status": "ready", "warnings": []})
    members = dict(fleet.view.members())
    members["p1"] = kv_host_of(members["p1"], "169.254.169.254")  # HTTP allowed, KV not
    fleet.view.set(members)
    status, body = ready(server)
    assert status == 200 and len(body["warnings"]) == 1
    assert "p1 (kv 169.254.169.254)" in body["warnings"][0]
    assert httpx.post(server.url + "/v1/completions", json=BODY, timeout=30).status_code == 502


def test_who_may_read_which_members_and_addresses(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    """/ready is a probe anyone reaching the port calls: with an API key set, only a
    client holding it learns which members and addresses (as on /v1/kv)."""
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    server = start_router(routers, fleet, allow_upstream="10.0.0.0/8", api_key="k")
    for key in ("", "wrong"):
        status, body = ready(server, key)
        assert status == 200 and body["warnings"] == [
            "1 member(s) can never be routed to: an address outside --allow-upstream"]
    (warning,) = ready(server, "k")[1]["warnings"]
    assert "p1 (http 127.0.0.1)" in warning and "10.0.0.0/8" in warning


def test_draining_answers_503_with_its_warnings(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    server = start_router(routers, fleet, allow_upstream="10.0.0.0/8")
    server.drain()
    assert wait_until(lambda: ready(server)[0] == 503, 5)
    body = ready(server)[1]
    assert body["status"] == "draining" and "p1 (http 127.0.0.1)" in body["warnings"][0]


# --- the rules, as tables ----------------------------------------------------------------------

@pytest.mark.parametrize(("allow", "http", "kv_host", "refused"), [
    (LOOPBACK_ALLOW, "http://127.0.0.1:8000", "", ""),
    ("", "http://127.0.0.1:8000", "", "http 127.0.0.1"),  # the default: public only
    ("", "http://203.0.113.5:8000", "", ""),
    ("10.0.0.0/8", "http://[::1]:8000", "", "http ::1"),
    ("10.0.0.0/8", "http://10.1.2.3:8000", "10.1.2.4", ""),
    ("10.0.0.0/8", "http://10.1.2.3:8000", "10.9.0.1", ""),
    ("10.0.0.0/8", "http://10.1.2.3:8000", "192.168.0.9", "kv 192.168.0.9"),
    ("10.0.0.0/8", "http://engine.cluster.local:8000", "", ""),  # a name: the pool judges it
    ("10.0.0.0/8", "http://10.1.2.3:8000", "kv.cluster.local", ""),
])
def test_which_addresses_can_never_be_routed_to(allow: str, http: str, kv_host: str,
                                                refused: str) -> None:
    unroutable = Unroutable(UpstreamPolicy.build(allow), allow)
    unroutable.on_members({"p": kv_host_of(live_member("p", P, http), kv_host)})
    assert unroutable.members == ({"p": refused} if refused else {})


def test_routers_are_not_members_to_route_to() -> None:
    unroutable = Unroutable(UpstreamPolicy.build("10.0.0.0/8"))
    unroutable.on_members({"r": live_member("r", Role.API_SERVER, "http://127.0.0.1:8000")})
    assert unroutable.members == {} and unroutable.warnings() == []


def test_a_warning_names_a_few_members_and_counts_the_rest() -> None:
    unroutable = Unroutable(UpstreamPolicy.build("10.0.0.0/8"), "10.0.0.0/8")
    n = MAX_NAMED + 3
    unroutable.on_members({f"p{i:02}": live_member(f"p{i:02}", P, "http://127.0.0.1:1")
                           for i in range(n)})
    (warning,) = (w.full() for w in unroutable.warnings())
    assert warning.startswith(f"{n} member(s) can never be routed to")
    assert "p00 (http 127.0.0.1)" in warning and f"p{MAX_NAMED:02}" not in warning
    assert warning.endswith(" and 3 more")


def test_readiness_logs_a_warning_when_it_appears_and_when_it_clears(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.readiness")
    held: list[ReadyWarning] = []
    readiness = Readiness()
    readiness.add(lambda: held)  # a new source is one line

    def broken() -> list[ReadyWarning]:
        raise RuntimeError("a source that fails")
    readiness.add(broken)
    assert readiness.warnings() == [] and readiness.warnings() == []
    assert len(said(caplog, logging.ERROR, "source failed")) == 1  # once, not per call
    held.append(ReadyWarning("model x cannot be matched exactly"))
    for _ in range(3):
        assert readiness.warnings() == held
    assert said(caplog, logging.WARNING, "model x") == [
        "[router] model x cannot be matched exactly"]
    held.clear()
    assert readiness.warnings() == []
    assert said(caplog, logging.INFO, "no longer: model x")
