"""Two registries, as the manifests run them: an operator's drain and ban sent to one are
what both report, and survive a restart of the other.

Real processes on 127.0.0.1: registries A and B, two sim engines that heartbeat to both
(`--registry A,B`), and `pdreg drain|evict|status` as an operator runs them. A registry
passes an admin drain to the member in its heartbeat replies and a ban in its refusal;
the member's agent then tells every registry (DRAINING in its heartbeats and in any
re-registration; when banned, a BannedBye to every registry that accepted it, which then
holds the ban too, and no more registrations). A later process with the id is refused
wherever the ban is held, and so passes it on to a registry that restarted and forgot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from deploy_support import Processes

from pdreg.testing import die_with_parent, free_low_port, wait_until

TOKEN = "fleet-token-for-this-test"
ADMIN_TOKEN = "admin-token-for-this-test"
HEARTBEAT_S = 0.25
WAIT_S = 30.0
STOP_S = 15.0
BAN_S = 600


@dataclass
class Fleet:
    processes: Processes
    ports: dict[str, list[int]] = field(default_factory=dict)  # registry -> its 3 ports

    def start(self, name: str, argv: list[str]) -> None:
        self.processes.start(name, argv, {"PDREG_TOKEN": TOKEN})

    def start_registry(self, name: str) -> None:
        if name not in self.ports:
            taken = {p for ports in self.ports.values() for p in ports}
            ports: list[int] = []
            for _ in range(3):
                ports.append(free_low_port(avoid=taken | set(ports)))
            self.ports[name] = ports
        control, events, http = self.ports[name]
        self.start(name, ["registry", "--host", "127.0.0.1", "--port", str(control),
                          "--events-port", str(events), "--http-port", str(http),
                          "--admin-token", ADMIN_TOKEN,
                          "--heartbeat-interval", str(HEARTBEAT_S)])

    def restart(self, name: str) -> None:
        """Stop NAME and start it again, on the same ports: a registry that forgot
        everything, or a new incarnation of the same member id."""
        self.processes.restart(name)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name][0]}"

    def pdreg(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdreg", *argv], capture_output=True,
                              text=True, timeout=WAIT_S,
                              env={**os.environ, "PDREG_ADMIN_TOKEN": ADMIN_TOKEN})

    def status(self, registry: str) -> dict[str, str]:
        """member id -> state, as REGISTRY's `GET /v1/members` (what `pdreg status`
        prints) shows it; empty while that registry does not answer. Polled over HTTP:
        a CLI process per poll costs a second of CPU."""
        try:
            response = httpx.get(f"http://127.0.0.1:{self.ports[registry][2]}/v1/members",
                                 timeout=WAIT_S)
        except httpx.HTTPError:
            return {}
        return {m["id"]: m["state"] for m in response.json()} if response.is_success else {}

    def cli_status(self, registry: str) -> dict[str, str]:
        """member id -> state, as `pdreg status --json` against REGISTRY prints it."""
        result = self.pdreg("status", "--json", "--registry", self.address(registry))
        assert result.returncode == 0, result.stderr
        return {m["id"]: m["state"] for m in json.loads(result.stdout)}

    def bans(self, registry: str) -> set[str]:
        """Ids REGISTRY refuses as banned now (`GET /v1/bans`; empty while it does not
        answer)."""
        try:
            response = httpx.get(f"http://127.0.0.1:{self.ports[registry][2]}/v1/bans",
                                 timeout=WAIT_S)
        except httpx.HTTPError:
            return set()
        return {ban["id"] for ban in response.json()} if response.is_success else set()

    def log(self, name: str) -> str:
        return self.processes.log(name)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    processes = Processes(tmp_path, stop_s=STOP_S)
    try:
        yield Fleet(processes)
    finally:
        processes.stop()


def test_drain_and_ban_through_one_registry_hold_on_both(fleet: Fleet) -> None:
    for name in ("A", "B"):
        fleet.start_registry(name)
    both = f"{fleet.address('A')},{fleet.address('B')}"
    engines = {}
    for role in ("prefill", "decode"):
        port = free_low_port(avoid={p for ports in fleet.ports.values() for p in ports})
        engines[role] = f"{role}-127.0.0.1-{port}"
        fleet.start(role, ["engine", "--role", role, "--backend", "sim", "--model", "tiny",
                           "--host", "127.0.0.1", "--port", str(port), "--registry", both])
    drained, banned = engines["prefill"], engines["decode"]

    def shows(registry: str, want: dict[str, str]) -> bool:
        fleet.processes.check_alive()
        return fleet.status(registry) == want

    ready = {drained: "ready", banned: "ready"}
    assert wait_until(lambda: shows("A", ready) and shows("B", ready), WAIT_S), \
        (fleet.status("A"), fleet.status("B"))
    assert fleet.cli_status("A") == ready and fleet.cli_status("B") == ready

    # Who may drain: only an operator with A's admin token. Without it A refuses, and
    # nothing reaches the member or B.
    stranger = subprocess.run(
        [sys.executable, "-m", "pdreg", "drain", drained, "--registry", fleet.address("A")],
        capture_output=True, text=True, timeout=WAIT_S,
        env={k: v for k, v in os.environ.items() if k != "PDREG_ADMIN_TOKEN"})
    assert stranger.returncode != 0 and "401" in stranger.stderr, stranger.stderr
    assert fleet.status("A") == ready and fleet.status("B") == ready

    # Drain through A only: B reports it too (the member heard it from A and announced
    # DRAINING to both), and a restarted B learns it at the member's re-registration.
    result = fleet.pdreg("drain", drained, "--registry", fleet.address("A"))
    assert result.returncode == 0, result.stderr
    draining = {drained: "draining", banned: "ready"}
    assert wait_until(lambda: shows("A", draining) and shows("B", draining), WAIT_S), \
        (fleet.status("A"), fleet.status("B"))
    fleet.restart("B")
    seen: list[dict[str, str]] = []

    def b_whole_again() -> bool:
        status = fleet.status("B")
        if status:
            seen.append(status)
        return status == draining
    assert wait_until(b_whole_again, WAIT_S), seen
    # Never shown ready by the restarted B, not even at its first registration.
    assert all(status.get(drained) != "ready" for status in seen), seen

    # Evict with a ban through A: gone from both (the member, refused at A as banned,
    # said a BannedBye to B), and B holds the ban too.
    result = fleet.pdreg("evict", banned, "--ban", str(BAN_S),
                         "--registry", fleet.address("A"))
    assert result.returncode == 0, result.stderr
    only_drained = {drained: "draining"}
    assert wait_until(lambda: shows("A", only_drained) and shows("B", only_drained),
                      WAIT_S), (fleet.status("A"), fleet.status("B"))
    assert wait_until(lambda: banned in fleet.bans("B"), WAIT_S), fleet.bans("B")
    assert banned in fleet.bans("A")
    # A new process with that id: refused at both, it stops registering anywhere.
    told = fleet.log("decode").count("is banned for")
    fleet.restart("decode")
    assert wait_until(lambda: fleet.log("decode").count("is banned for") > told, WAIT_S)
    assert not wait_until(lambda: banned in fleet.status("A") or banned in fleet.status("B"),
                          8 * HEARTBEAT_S, poll_s=HEARTBEAT_S)

    # Restart A, the registry that issued the ban: it forgets, B still holds it. The next
    # process with that id is refused at B and passes the ban on to A in its bye.
    fleet.restart("A")
    assert wait_until(lambda: fleet.status("A") == only_drained, WAIT_S), fleet.status("A")
    assert banned not in fleet.bans("A")
    fleet.restart("decode")
    assert wait_until(lambda: banned in fleet.bans("A"), WAIT_S), fleet.bans("A")
    assert wait_until(lambda: shows("A", only_drained), WAIT_S), fleet.status("A")

    # And the other way round: a restarted B learns it again from the next process,
    # refused at A.
    fleet.restart("B")
    assert wait_until(lambda: shows("B", only_drained), WAIT_S), fleet.status("B")
    # Several heartbeat intervals more: the banned member stays out of B.
    assert not wait_until(lambda: banned in fleet.status("B"), 8 * HEARTBEAT_S,
                          poll_s=HEARTBEAT_S)
    assert banned not in fleet.bans("B")
    fleet.restart("decode")
    assert wait_until(lambda: banned in fleet.bans("B"), WAIT_S), fleet.bans("B")
    assert wait_until(lambda: shows("B", only_drained), WAIT_S), fleet.status("B")

    # What an operator reads: the table against each registry says the same.
    for registry in ("A", "B"):
        table = fleet.pdreg("status", "--registry", fleet.address(registry))
        assert table.returncode == 0, table.stderr
        assert drained in table.stdout and "draining" in table.stdout, table.stdout
        assert banned not in table.stdout, table.stdout
    # The banned engine process itself keeps running (the agent only stopped registering),
    # and so did every new process with that id.
    assert fleet.processes.running["decode"].poll() is None


# --- the agent's side: an Agent in this process, the registries real ---------------------


def test_an_admin_drain_sticks_whatever_the_owner_sets_later(fleet: Fleet) -> None:
    """A sidecar flips its agent to READY whenever its engine's health passes: after an
    operator's drain at one registry, the agent stays DRAINING at every registry."""
    from engine_agent.agent import Agent, default_member_id, new_incarnation
    from wire.protocol import Endpoints, MemberSpec, MemberState, Role

    for name in ("A", "B"):
        fleet.start_registry(name)
    spec = MemberSpec(id=default_member_id(Role.DECODE, "127.0.0.1", 8200),
                      incarnation=new_incarnation(), role=Role.DECODE, model="tiny",
                      protocol="vllm-nixl", endpoints=Endpoints(http="http://127.0.0.1:8200"))

    def states() -> list[str | None]:
        return [fleet.status(name).get(spec.id) for name in ("A", "B")]

    with Agent(spec, registries=[fleet.address("A"), fleet.address("B")], token=TOKEN,
               state=MemberState.READY) as agent:
        assert wait_until(lambda: states() == ["ready"] * 2, WAIT_S), states()
        result = fleet.pdreg("drain", spec.id, "--registry", fleet.address("A"))
        assert result.returncode == 0, result.stderr
        assert wait_until(lambda: states() == ["draining"] * 2, WAIT_S), states()
        agent.set_state(MemberState.READY)  # what a sidecar's health loop does
        assert agent.state is MemberState.DRAINING
        fleet.restart("A")  # forgets its own drain; hears it from the member
        assert wait_until(lambda: states() == ["draining"] * 2, WAIT_S), states()


# --- the dashboard with two registries -----------------------------------------------

SCRAPE_S = 1


def _panel_exprs(title: str) -> list[str]:
    from deploy_support import dashboard_queries, grafana_to_promql
    return [grafana_to_promql(q.expr) for q in dashboard_queries() if q.panel == title]


def test_dashboard_counts_each_member_once_with_two_registries(fleet: Fleet) -> None:
    """A real Prometheus scraping both registries: the membership panel counts each
    member once (not once per registry), and each registry's version counter is its own
    series, not one max() of two unrelated counters."""
    import httpx
    import yaml
    from deploy_support import tool

    for name in ("A", "B"):
        fleet.start_registry(name)
    both = f"{fleet.address('A')},{fleet.address('B')}"
    for role in ("prefill", "decode"):
        port = free_low_port(avoid={p for ports in fleet.ports.values() for p in ports})
        fleet.start(role, ["engine", "--role", role, "--backend", "sim", "--model", "tiny",
                           "--host", "127.0.0.1", "--port", str(port), "--registry", both])
    config = fleet.processes.logs / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "pdreg-registry", "static_configs": [
            {"targets": [f"127.0.0.1:{fleet.ports[n][2]}" for n in ("A", "B")]}]}]}))
    port = free_low_port(avoid={p for ports in fleet.ports.values() for p in ports})
    log = (fleet.processes.logs / "prometheus.log").open("wb")
    fleet.processes.running["prometheus"] = subprocess.Popen(
        [tool("prometheus"), f"--config.file={config}",
         f"--storage.tsdb.path={fleet.processes.logs / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    log.close()

    def query(expr: str) -> dict[str, float]:
        fleet.processes.check_alive()
        try:
            body = httpx.get(f"http://127.0.0.1:{port}/api/v1/query",
                             params={"query": expr}, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                for r in body.get("data", {}).get("result", [])}

    [members] = _panel_exprs("Members by role and state")
    want = {json.dumps({"role": role, "state": "ready"}, sort_keys=True): 1.0
            for role in ("prefill", "decode")}
    # Both registries scraped, each holding both engines ready ...
    assert wait_until(lambda: len(query('pdreg_members{state="ready"} > 0')) == 4, WAIT_S), \
        query("pdreg_members")
    # ... and the panel counts 1 prefill and 1 decode, not 2 of each.
    assert wait_until(lambda: {k: v for k, v in query(members).items() if v} == want,
                      WAIT_S), query(members)
    [version] = _panel_exprs("Membership version")
    assert len(query(version)) == 2, query(version)  # one series per registry
