"""Two registries, one frozen: a dead engine leaves the router's merged view in time.

Real processes on 127.0.0.1, as deploy/ runs them: registries A and B, two prefills and
two decodes (sim engines) heartbeating to both, and a router merging both views, with
clients sending requests throughout. B is frozen (SIGSTOP: a registry pod on a lost
node), then a decode is killed -9 (no bye). A expires it after its lease; B's last word
still holds it, so the router must drop B from the merge once B has been silent past
its lease (registry/merge.py). Before, the router kept picking the dead decode after
every quarantine. The decode must be gone from the router's view within lease + 2 s,
and no client request may fail meanwhile (a pick of the dead decode is retried).

What the router's view holds shows in what it picks: with a short quarantine (0.5 s) a
decode still in the view is picked again every half second or so, so the last pick of
the dead one says when it left.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deploy_support import Processes

from pdreg.testing import LowPorts, wait_until

HEARTBEAT_S = 0.25
LEASE_S = 1.0
WAIT_S = 60.0
GONE_WITHIN_S = LEASE_S + 2.0
CLIENTS = 4
BODY = {"model": "tiny", "prompt": "the merged view", "max_tokens": 4}
QUARANTINE_S = 0.5
WATCH_AFTER_S = 3.0  # picks watched this long past the deadline: none may come


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    running = Processes(tmp_path, stop_s=20.0)
    try:
        yield running
    finally:
        for proc in running.running.values():  # a frozen process cannot stop
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        running.stop()


class Clients:
    """CLIENTS threads posting completions through the router until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.failed: list[str] = []  # each prefixed with its monotonic time
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True)
                         for _ in range(CLIENTS)]

    def _run(self) -> None:
        with httpx.Client(timeout=30.0) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(self.url + "/v1/completions", json=BODY)
                except httpx.HTTPError as exc:
                    self.failed.append(f"{time.monotonic():.2f} {exc!r}")
                    continue
                if response.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{time.monotonic():.2f} {response.status_code} "
                                       f"{response.text[:200]}")

    def __enter__(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=40)


def picks(router: str, member_id: str) -> float:
    """How often the router has chosen `member_id` (its pdreg_router_picks_total)."""
    text = httpx.get(router + "/metrics", timeout=5.0).text
    series = f'pdreg_router_picks_total{{member="{member_id}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(series))


@pytest.mark.timeout(240)
def test_a_frozen_registry_does_not_keep_a_dead_decode_routable(processes: Processes) -> None:
    port = LowPorts()
    registries = {}
    for name in ("A", "B"):
        control, events, http = port(), port(), port()
        registries[name] = f"127.0.0.1:{control}"
        processes.start(name, ["registry", "--host", "127.0.0.1", "--port", str(control),
                               "--events-port", str(events), "--http-port", str(http),
                               "--heartbeat-interval", str(HEARTBEAT_S),
                               "--lease", str(LEASE_S)], {},
                        log_level="INFO")  # joins, suspicions, expiries: when each was
    both = ",".join(registries.values())
    engines = {}
    for role in ("prefill", "prefill", "decode", "decode"):
        http_port = port()
        member_id = f"{role}-127.0.0.1-{http_port}"
        engines[member_id] = member_id
        processes.start(member_id, ["engine", "--role", role, "--backend", "sim",
                                    "--protocol", "vllm-nixl", "--model", "tiny",
                                    "--host", "127.0.0.1", "--port", str(http_port),
                                    "--registry", both,
                                    # a prefill holds KV for the decode killed below until
                                    # it times out: its drain at the end need not wait
                                    "--drain-timeout", "2"], {})
    router_port = port()
    processes.start("router", ["router", "--registry", both, "--host", "127.0.0.1",
                               "--port", str(router_port), "--policy", "peak_ewma",
                               "--quarantine", str(QUARANTINE_S), "--no-register",
                               "--allow-upstream", "127.0.0.0/8", "--drain-delay", "0"], {})
    router = f"http://127.0.0.1:{router_port}"
    decodes = sorted(m for m in engines if m.startswith("decode"))
    victim = decodes[0]

    def serves() -> bool:
        processes.check_alive()
        try:
            return httpx.post(router + "/v1/completions", json=BODY, timeout=10.0).is_success
        except httpx.HTTPError:
            return False
    assert wait_until(serves, WAIT_S)

    def everyone_picked() -> bool:
        processes.check_alive()
        try:
            return all(picks(router, member) > 0 for member in engines)
        except httpx.HTTPError:
            return False
    with Clients(router) as clients:
        assert wait_until(everyone_picked, WAIT_S), clients.failed[:5]
        os.kill(processes.running["B"].pid, signal.SIGSTOP)
        processes.running[victim].kill()  # kill -9: no bye, A expires it after its lease
        killed_at = time.monotonic()
        deadline = killed_at + GONE_WITHIN_S + WATCH_AFTER_S
        last_pick_at, seen = killed_at, picks(router, victim)
        while time.monotonic() < deadline:  # when the router last chose the dead decode
            now_picks = picks(router, victim)
            if now_picks > seen:
                seen, last_pick_at = now_picks, time.monotonic()
            time.sleep(0.05)
        served = clients.ok
        assert wait_until(lambda: clients.ok >= served + 20, WAIT_S), clients.failed[:5]
    os.kill(processes.running["B"].pid, signal.SIGCONT)
    processes.running.pop(victim).wait()
    gone_after_s = last_pick_at - killed_at
    assert gone_after_s <= GONE_WITHIN_S, f"still picked {gone_after_s:.1f}s after the kill"
    if clients.failed:  # in full (an assertion's message is cut): the router's log says
        # which legs failed and what it quarantined; A's, whom it expired or suspected
        pytest.fail(f"B frozen and {victim} killed at {killed_at:.2f}; refused:\n"
                    + "\n".join(clients.failed[:10])
                    + f"\n--- router:\n{processes.log('router')[-6000:]}"
                    + f"\n--- A:\n{processes.log('A')[-4000:]}", pytrace=False)
