"""Elasticity of pdreg, sglang-router and vllm-router, measured end to end on loopback.

    .venv/bin/python bench/bench_elasticity.py [--rounds 2] [--routers pdreg,sglang,vllm]

For each router in turn: 2 prefill + 2 decode sim engines (registered with a registry,
which only pdreg reads) under steady streaming traffic. How each router learns about an
engine is its own way:

- pdreg: the engine registers itself; the router follows the registry's events;
- sglang-router 0.3.2: the operator's automation POSTs /workers when the engine is ready
  (default health checks);
- vllm-router 0.1.17: `--vllm-discovery-address`; a pinger per engine sends vLLM P2P's
  msgpack ping every 3 s, as vLLM's P2P engines do, and stops when the engine dies.

Each round starts one more decode, then kill -9s the oldest decode, measuring:

- join: from the engine's ready line to the first request it serves (its own request
  counter on /metrics, sampled every SAMPLE_PERIOD_S);
- kill: once the dead engine's process is gone, a "tombstone" listener takes over its
  port and records every POST that arrives (and resets the connection, as a dead host's
  port would refuse it): the time from SIGKILL to the last one within KILL_WINDOW_S, how
  many arrived, and the client requests that failed meanwhile (for pdreg also how many
  streams it migrated, from pdreg_router_migrations_total).

Prints one Markdown table (the figures bench/RESULTS.md quotes).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `bench` and pdreg

from bench import peers  # noqa: E402
from pdreg.demo.cluster import Cluster, ClusterConfig  # noqa: E402
from pdreg.demo.traffic import TrafficGenerator  # noqa: E402
from pdreg.testing import free_low_port, wait_until  # noqa: E402

SAMPLE_PERIOD_S = 0.02
WAIT_TIMEOUT_S = 60.0
SETTLE_S = 1.5  # traffic after a join before the kill
KILL_WINDOW_S = 10.0  # how long the dead engine's port is watched after kill -9
VLLM_PING_INTERVAL_S = 3.0  # vLLM's P2P engines ping their proxy this often
REQUEST_COUNTER = "pdreg:engine_requests_total"
SIM_ARGS = ("--sim-prefill-delay", "0.002", "--sim-decode-delay", "0.01")
HTTP_TIMEOUT_S = 5.0


def requests_served(url: str) -> float:
    """The engine's own request counter (0 while it cannot answer)."""
    try:
        text = httpx.get(url + "/metrics", timeout=HTTP_TIMEOUT_S).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        if line.startswith(REQUEST_COUNTER):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def host_port(url: str) -> str:
    return url.split("//", 1)[1]


# --- the dead engine's port ------------------------------------------------------------


class Tombstone:
    """Listens on a dead engine's port; records when each POST arrives, then resets.

    A connection reset after accept stands in for a refused connect: every router treats
    both as a failed upstream, and the tombstone sees what a dead host cannot report.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.post_times: list[float] = []  # time.monotonic() of each POST
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(128)
        self._sock.settimeout(0.1)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tombstone-{port}",
                                        daemon=True)

    def start(self) -> Tombstone:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5.0)
        self._sock.close()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(0.5)
                try:
                    head = conn.recv(16)
                except OSError:
                    head = b""
                if head.startswith(b"POST"):
                    self.post_times.append(time.monotonic())
                # linger 0: close with RST, like a port nothing listens on
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# --- vLLM P2P discovery pings ----------------------------------------------------------


class DiscoveryPinger:
    """What a vLLM P2P engine does: ping the proxy's ZMQ socket every 3 s."""

    def __init__(self, context: zmq.Context, address: str, kind: str, http_address: str,
                 zmq_address: str) -> None:
        self._message = msgspec.msgpack.encode({"type": kind, "http_address": http_address,
                                                "zmq_address": zmq_address})
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{address}")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pinger-{http_address}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._socket.send(self._message)
                if self._stopping.wait(VLLM_PING_INTERVAL_S):
                    return
        finally:
            self._socket.close()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5.0)


# --- how each router learns about engines ----------------------------------------------


class Harness:
    """One router under test: start it, tell it about a new engine, see an engine die."""

    name = ""

    def start(self, cluster: Cluster, engines: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    def joined(self, role: str, engine: dict[str, Any]) -> None:
        """Called the moment a new engine printed its ready line."""

    def killed(self, engine: dict[str, Any]) -> None:
        """Called right after an engine was killed with SIGKILL."""

    def stop(self) -> None:
        """Stop whatever start() started outside the cluster."""

    def migrations(self) -> float | None:
        """Streams the router has continued on another pair so far (None: it cannot)."""
        return None


class PdregHarness(Harness):
    name = "pdreg"
    url = ""

    def start(self, cluster: Cluster, engines: list[dict[str, Any]]) -> str:
        cluster.start_router()
        self.url = cluster.router_url
        return self.url

    def migrations(self) -> float | None:
        text = httpx.get(self.url + "/metrics", timeout=HTTP_TIMEOUT_S).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdreg_router_migrations_total{"))


class SglangHarness(Harness):
    name = "sglang-router"

    def __init__(self) -> None:
        self.router: peers.PeerRouter | None = None

    def start(self, cluster: Cluster, engines: list[dict[str, Any]]) -> str:
        self.router = peers.start_sglang_router(
            [(e["url"], e["bootstrap_port"]) for e in engines if e["role"] == "prefill"],
            [e["url"] for e in engines if e["role"] == "decode"])
        return self.router.url

    def joined(self, role: str, engine: dict[str, Any]) -> None:
        assert self.router is not None
        body: dict[str, Any] = {"url": engine["url"], "worker_type": role}
        if role == "prefill":
            body["bootstrap_port"] = engine["bootstrap_port"]
        response = httpx.post(self.router.url + "/workers", json=body, timeout=HTTP_TIMEOUT_S)
        if response.status_code >= 300:
            raise RuntimeError(f"POST /workers: HTTP {response.status_code} {response.text}")

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()


class VllmHarness(Harness):
    name = "vllm-router"

    def __init__(self) -> None:
        self.router: peers.PeerRouter | None = None
        self.context = zmq.Context()
        self.address = ""
        self.pingers: dict[str, DiscoveryPinger] = {}  # engine url -> its pinger

    def start(self, cluster: Cluster, engines: list[dict[str, Any]]) -> str:
        self.address = f"127.0.0.1:{free_low_port()}"
        self.router = peers.start_vllm_router([], [], discovery_address=self.address)
        for engine in engines:
            self.joined(engine["role"], engine)
        return self.router.url

    def joined(self, role: str, engine: dict[str, Any]) -> None:
        # a P2P engine's zmq_address is its KV port; decodes have none here, and the
        # router only copies the address into the request id
        zmq_port = engine["kv_port"] or int(engine["url"].rsplit(":", 1)[1])
        self.pingers[engine["url"]] = DiscoveryPinger(
            self.context, self.address, "P" if role == "prefill" else "D",
            host_port(engine["url"]), f"127.0.0.1:{zmq_port}")

    def killed(self, engine: dict[str, Any]) -> None:
        pinger = self.pingers.pop(engine["url"], None)
        if pinger is not None:
            pinger.stop()  # the pings came from inside the engine: they die with it

    def stop(self) -> None:
        for pinger in self.pingers.values():
            pinger.stop()
        self.pingers.clear()
        if self.router is not None:
            self.router.stop()
        self.context.term()


HARNESSES: dict[str, Callable[[], Harness]] = {
    "pdreg": PdregHarness, "sglang": SglangHarness, "vllm": VllmHarness}


# --- the measurement -------------------------------------------------------------------


@dataclass
class Figures:
    router: str
    joins_s: list[float] = field(default_factory=list)
    last_request_s: list[float] = field(default_factory=list)
    sent_to_dead: list[int] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    migrated: list[int] = field(default_factory=list)
    ok: int = 0


def measure(harness: Harness, args: argparse.Namespace) -> Figures:
    cluster = Cluster(ClusterConfig(
        backend=args.backend, heartbeat_interval_s=args.heartbeat_interval,
        lease_s=args.lease, engine_args=SIM_ARGS if args.backend == "sim" else (),
        log_level="WARNING"))
    traffic: TrafficGenerator | None = None
    figures = Figures(harness.name)
    try:
        cluster.start_registry()
        roles = ["prefill", "prefill", "decode", "decode"]
        ids = cluster.start_engines(roles)
        engines = [{**cluster.engines[i].ready, "role": r} for i, r in zip(ids, roles,
                                                                             strict=True)]
        url = harness.start(cluster, engines)
        traffic = TrafficGenerator(url, clients=args.clients).start()
        if not traffic.wait_ok(20, WAIT_TIMEOUT_S):
            raise RuntimeError(f"{harness.name}: no traffic gets through")
        for _ in range(args.rounds):
            measure_join(cluster, harness, figures)
            time.sleep(SETTLE_S)  # steady traffic on the new set before the kill
            measure_kill(cluster, harness, traffic, figures)
        figures.ok = traffic.ok_count
    finally:
        if traffic is not None:
            traffic.stop()
        harness.stop()
        cluster.stop_all()
        cluster.remove_logs()
    return figures


def measure_join(cluster: Cluster, harness: Harness, figures: Figures) -> None:
    managed = cluster.spawn_engine("decode")
    cluster.wait_engine(managed)
    ready_at = time.monotonic()
    engine = {**managed.ready, "role": "decode"}
    harness.joined("decode", engine)
    if not wait_until(lambda: requests_served(engine["url"]) > 0, WAIT_TIMEOUT_S,
                      poll_s=SAMPLE_PERIOD_S):
        raise TimeoutError(f"{harness.name} never routed to the new decode")
    figures.joins_s.append(time.monotonic() - ready_at)


def measure_kill(cluster: Cluster, harness: Harness, traffic: TrafficGenerator,
                 figures: Figures) -> None:
    victim_id = cluster.engine_ids("decode")[0]
    managed = cluster.retire(victim_id)
    engine = {**managed.ready, "role": "decode"}
    migrations_before = harness.migrations()
    kill_at = time.monotonic()
    managed.kill()
    managed.wait(10.0)
    harness.killed(engine)
    tombstone = Tombstone(int(engine["url"].rsplit(":", 1)[1])).start()
    try:
        time.sleep(KILL_WINDOW_S)  # the observation window itself
    finally:
        tombstone.stop()
    window_end = kill_at + KILL_WINDOW_S
    posts = [t for t in tombstone.post_times if t <= window_end]
    figures.sent_to_dead.append(len(posts))
    figures.last_request_s.append((posts[-1] - kill_at) if posts else 0.0)
    figures.failures.append(sum(1 for r in traffic.records()
                                if not r.ok and kill_at <= r.finished <= window_end))
    migrations_after = harness.migrations()
    if migrations_before is not None and migrations_after is not None:
        figures.migrated.append(int(migrations_after - migrations_before))


def print_table(results: list[Figures], args: argparse.Namespace) -> None:
    def ms(values: list[float]) -> str:
        return (f"{statistics.median(values) * 1e3:.0f} ms (max {max(values) * 1e3:.0f})"
                if values else "-")

    def count(values: list[int]) -> str:
        return f"{statistics.mean(values):.1f} (max {max(values)})" if values else "-"

    print(f"\nbackend {args.backend}, {args.clients} streaming clients, {args.rounds} rounds "
          f"per router, pdreg heartbeat {args.heartbeat_interval} s / lease {args.lease} s, "
          f"kill window {KILL_WINDOW_S:g} s, sampling {SAMPLE_PERIOD_S * 1e3:.0f} ms\n")
    print("| router | ready → first routed request | kill -9 → last request sent to it "
          f"| requests sent to the dead engine in {KILL_WINDOW_S:g} s "
          "| failed client requests per kill | streams migrated per kill | requests ok |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for f in results:
        print(f"| {f.router} | {ms(f.joins_s)} | {ms(f.last_request_s)} | "
              f"{count(f.sent_to_dead)} | {count(f.failures)} | {count(f.migrated)} | "
              f"{f.ok} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--routers", default="pdreg,sglang,vllm",
                        help=f"comma-separated, of {', '.join(HARNESSES)}")
    parser.add_argument("--backend", choices=("sim", "torch"), default="sim")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--heartbeat-interval", type=float, default=0.5)
    parser.add_argument("--lease", type=float, default=2.0)
    args = parser.parse_args()
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    unknown = [n for n in names if n not in HARNESSES]
    if unknown:
        parser.error(f"unknown routers {unknown}; choose from {list(HARNESSES)}")
    if any(n != "pdreg" for n in names):
        peers.ensure_peers_venv()
    results = []
    for name in names:
        print(f"{name}: measuring", flush=True)
        figures = measure(HARNESSES[name](), args)
        print(f"  joins {[round(j * 1e3) for j in figures.joins_s]} ms, last request "
              f"{[round(t * 1e3) for t in figures.last_request_s]} ms, sent to dead "
              f"{figures.sent_to_dead}, failed {figures.failures}, migrated "
              f"{figures.migrated or '-'}", flush=True)
        results.append(figures)
    print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
