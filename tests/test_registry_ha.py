"""Two registries on one real etcd, as real processes: admin intents reach both through
the store (not through the member), stand when every registry is killed -9, and an etcd
outage costs admin writes (503) but not membership or routing; when etcd is back the
registries reconcile by themselves.

Real processes on 127.0.0.1: etcd, `pdreg registry --store etcd://...` A and B, members
(an Agent in a process of its own, to freeze it with SIGSTOP; raw members speaking the
wire protocol, which do exactly what they are told), sim engines and `pdreg router`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from deploy_support import Processes
from etcd_process import EtcdProcess, requires_etcd
from raw_member import RawMember

from pdreg.cmd_status import fetch_fleet
from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until
from router.guard import LOOPBACK_ALLOW
from wire.protocol import MemberState, ReplyStatus

pytestmark = requires_etcd
ADMIN_TOKEN = "admin-token-for-this-test"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HEARTBEAT_S = 0.25
LEASE_S = 10.0  # a frozen member stays registered for the length of a check
WAIT_S = 30.0
PROPAGATION_S = 2.0  # an intent taken by one registry shows on the other within this
HERE = Path(__file__).parent


@dataclass
class HaFleet:
    tmp: Path
    etcd: EtcdProcess
    processes: Processes
    ports: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)
    raw: list[RawMember] = field(default_factory=list)
    alive: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # heartbeats

    def free_port(self) -> int:
        taken = {p for ports in self.ports.values() for p in ports}
        taken |= {self.etcd.client_port, self.etcd.peer_port}
        return free_low_port(avoid=taken)

    def start_registry(self, name: str) -> None:
        if name not in self.ports:
            self.ports[name] = (self.free_port(), 0, 0)
            self.ports[name] = (self.ports[name][0], self.free_port(), self.free_port())
        control, events, http = self.ports[name]
        self.processes.start(name, [
            "registry", "--port", str(control), "--events-port", str(events),
            "--http-port", str(http), "--admin-token", ADMIN_TOKEN,
            "--heartbeat-interval", str(HEARTBEAT_S), "--lease", str(LEASE_S),
            "--store", f"etcd://{self.etcd.endpoint}/ha"], {})
        assert wait_until(lambda: self.healthy(name), WAIT_S), self.processes.log(name)

    def kill9(self, name: str) -> None:
        proc = self.processes.running.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def signal(self, name: str, signum: int) -> None:
        self.processes.running[name].send_signal(signum)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name][0]}"

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name][2]}"

    def healthy(self, name: str) -> bool:
        try:
            return httpx.get(f"{self.url(name)}/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, name: str, path: str) -> object:
        return httpx.get(f"{self.url(name)}{path}", timeout=5.0).json()

    def registries(self, name: str) -> set[str]:
        """The replica set as registry NAME knows it (ids)."""
        entries = self.get(name, "/v1/registries")
        assert isinstance(entries, list)
        return {entry["id"] for entry in entries}

    def states(self, name: str) -> dict[str, str]:
        """member id -> state as registry NAME shows it ("cordoned" for a cordon)."""
        try:
            members = self.get(name, "/v1/members")
        except httpx.HTTPError:
            return {}
        assert isinstance(members, list)
        return {m["id"]: "cordoned" if m["cordoned"] else m["state"] for m in members}

    def metric(self, name: str, line_start: str) -> float | None:
        try:
            text = httpx.get(f"{self.url(name)}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def pdreg(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdreg", *argv], capture_output=True,
                              text=True, timeout=WAIT_S,
                              env={**os.environ, "PDREG_ADMIN_TOKEN": ADMIN_TOKEN})

    def member(self, member_id: str, *registries: str, incarnation: int = 5) -> list[RawMember]:
        """A raw member registered READY at each registry (a socket per registry)."""
        members = [RawMember(self.address(r), member_id, incarnation=incarnation)
                   for r in registries]
        self.raw += members
        return members


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[HaFleet]:
    etcd = EtcdProcess(tmp_path / "etcd").start()
    fleet = HaFleet(tmp_path, etcd, Processes(tmp_path, stop_s=15.0))
    try:
        for name in ("A", "B"):
            fleet.start_registry(name)
        yield fleet
    finally:
        fleet.alive.close()
        for member in fleet.raw:
            member.close()
        for proc in fleet.others:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            stop_process(proc, 10.0)
        fleet.processes.stop()
        etcd.stop()


def _agent_process(ha: HaFleet, member_id: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "agent_process.py"),
         f"{ha.address('A')},{ha.address('B')}", member_id, "9100"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    ha.others.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def test_intents_reach_every_registry_and_stand_when_every_registry_is_killed(
        ha: HaFleet) -> None:
    frozen = _agent_process(ha, "decode-frozen")
    raw = ha.member("decode-raw", "A", "B")
    alive = ha.alive
    for member in raw:
        assert member.register().status is ReplyStatus.OK
        alive.enter_context(member.kept_alive(HEARTBEAT_S))
    both = {"decode-frozen": "ready", "decode-raw": "ready"}
    assert wait_until(lambda: ha.states("A") == both == ha.states("B"), WAIT_S)
    assert ha.registries("A") == {ha.address("A"), ha.address("B")}

    # A drain through A while the member is frozen: it can carry nothing, B hears it from
    # the store.
    frozen.send_signal(signal.SIGSTOP)
    answer = httpx.post(f"{ha.url('A')}/v1/members/decode-frozen/drain", headers=ADMIN)
    assert answer.status_code == 200 and answer.json()["applied"], answer.text
    started = time.monotonic()
    assert wait_until(lambda: ha.states("B").get("decode-frozen") == "draining",
                      PROPAGATION_S), ha.states("B")
    shown_on_b_s = time.monotonic() - started
    # The other way round, and the rest of what an operator can say: a drain through B
    # (of a member that never relays anything), a cordon of an id not registered yet
    # through A, a ban through B's HTTP URL alone (the CLI needs no control port).
    answer = httpx.post(f"{ha.url('B')}/v1/members/decode-raw/drain", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    assert wait_until(lambda: ha.states("A").get("decode-raw") == "draining", PROPAGATION_S)
    assert httpx.post(f"{ha.url('A')}/v1/members/decode-later/cordon",
                      headers=ADMIN).status_code == 200
    banned = ha.pdreg("evict", "decode-banned", "--ban", "600", "--registry", ha.url("B"))
    assert banned.returncode == 0 and "every registry applies it" in banned.stdout, banned

    status_s = _clients_name_a_frozen_registry(ha, set(both))

    # Every registry killed -9, the frozen member woken (it never heard of its drain),
    # the registries started again on the same ports.
    alive.close()
    ha.kill9("A")
    ha.kill9("B")
    frozen.send_signal(signal.SIGCONT)
    for name in ("A", "B"):
        ha.start_registry(name)
    later = ha.member("decode-later", "A")[0]
    banned_again = ha.member("decode-banned", "B")[0]
    for member in (*raw, later):  # the same process registers again, saying READY
        assert member.register(MemberState.READY).status is ReplyStatus.OK
        alive.enter_context(member.kept_alive(HEARTBEAT_S))
    refused = banned_again.register(MemberState.READY)
    assert refused.status is ReplyStatus.REJECTED and refused.banned_s > 500

    want_a = {"decode-frozen": "draining", "decode-raw": "draining",
              "decode-later": "cordoned"}
    want_b = {"decode-frozen": "draining", "decode-raw": "draining"}
    assert wait_until(lambda: ha.states("A") == want_a and ha.states("B") == want_b,
                      WAIT_S), (ha.states("A"), ha.states("B"))
    assert wait_until(lambda: ha.registries("B") == {ha.address("A"), ha.address("B")},
                      WAIT_S), ha.registries("B")
    alive.close()
    assert shown_on_b_s < PROPAGATION_S and status_s < 10.0  # (bench/bench_store.py times)


def _clients_name_a_frozen_registry(ha: HaFleet, members: set[str]) -> float:
    """Registry A frozen: status and drain given both still answer, and name it. The
    seconds status took."""
    ha.signal("A", signal.SIGSTOP)
    try:
        started = time.monotonic()
        fleet = fetch_fleet(f"{ha.address('A')},{ha.url('B')}")
        status_s = time.monotonic() - started
        assert set(fleet.unreachable) == {ha.address("A")}
        assert {m["id"] for m in fleet.members} == members
        drained = ha.pdreg("drain", "decode-raw", "--registry",
                           f"{ha.address('A')},{ha.address('B')}")
        assert drained.returncode == 0, drained
        assert f"registry {ha.address('A')} unreachable" in drained.stderr, drained.stderr
    finally:
        ha.signal("A", signal.SIGCONT)
    return status_s


def test_with_etcd_down_routing_goes_on_and_admin_writes_answer_503(ha: HaFleet) -> None:
    both = f"{ha.address('A')},{ha.address('B')}"
    engines: dict[str, str] = {}
    for role in ("prefill", "decode"):
        port = ha.free_port()
        engines[role] = f"{role}-127.0.0.1-{port}"
        ha.processes.start(role, ["engine", "--role", role, "--backend", "sim", "--model",
                                  "tiny", "--host", "127.0.0.1", "--port", str(port),
                                  "--registry", both], {})
    router_port = ha.free_port()
    ha.processes.start("router", ["router", "--registry", both, "--port", str(router_port),
                                  "--policy", "round_robin", "--allow-upstream",
                                  LOOPBACK_ALLOW], {})
    router = f"http://127.0.0.1:{router_port}"

    def served() -> bool:
        try:
            response = httpx.post(f"{router}/v1/completions", timeout=10.0, json={
                "model": "tiny", "prompt": "hello", "max_tokens": 4})
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and bool(response.json()["choices"])

    assert wait_until(served, WAIT_S * 2), ha.processes.log("router")[-2000:]

    ha.etcd.kill()
    for name in ("A", "B"):
        assert wait_until(lambda n=name: ha.metric(n, 'pdreg_store_up{kind="etcd"}') == 0.0,
                          WAIT_S)
    assert all(served() for _ in range(10))  # routing unharmed
    for name in ("A", "B"):  # heartbeats go on: every member is there and fresh
        members = ha.get(name, "/v1/members")
        assert isinstance(members, list)
        assert {m["id"]: m["state"] for m in members if m["role"] != "api_server"} == {
            engines["prefill"]: "ready", engines["decode"]: "ready"}
        assert all(m["heartbeat_age_s"] < 2.0 for m in members)
    refused = ha.pdreg("drain", engines["decode"], "--registry", ha.url("A"))
    assert refused.returncode != 0 and "HTTP 503" in refused.stderr, refused
    assert "store" in refused.stderr and "etcd" in refused.stderr, refused.stderr
    assert httpx.post(f"{ha.url('B')}/v1/members/x-1/cordon", headers=ADMIN).status_code == 503
    assert ha.states("A")[engines["decode"]] == "ready"

    ha.etcd.start()  # the same data and ports
    for name in ("A", "B"):
        assert wait_until(lambda n=name: ha.metric(n, 'pdreg_store_up{kind="etcd"}') == 1.0
                          and (ha.metric(n, 'pdreg_store_reloads_total{reason="reconnect"}')
                               or 0) >= 1 and ha.metric(n, "pdreg_store_lease_held") == 1.0,
                          WAIT_S), name
    assert wait_until(lambda: len(ha.registries("A")) == 2, WAIT_S)
    assert served()
    answer = httpx.post(f"{ha.url('B')}/v1/members/{engines['decode']}/drain", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    assert wait_until(lambda: ha.states("A").get(engines["decode"]) == "draining",
                      PROPAGATION_S), ha.states("A")
