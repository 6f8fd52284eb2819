"""Overload without collapse: routers side by side past the fleet's capacity.

2 prefill + 2 decode sim engines (each prefill serves one prompt at a time, 0.5 s each:
the prefills are the bottleneck, about 4 requests/s; small, so that 4x the load does not
saturate this shared machine's CPUs before the engines). The fleet's capacity is measured first (a
closed loop through pdreg without admission). Then open-loop Poisson arrivals at 0.5, 1,
2 and 4 times that, for --duration seconds each, streamed: three classes (critical 20%,
standard 50%, sheddable 30%) and ten tenants, one of them noisy with half the traffic.

Rows, in one run: pdreg with admission (classes file below), pdreg with --no-admission,
with --routers N also pdreg with admission behind N routers (registered, so each takes
1/N of every member's budget; the arrivals alternate between them), and with --peers
the peers bench/peers.py installs: sglang-router with its opt-in global limit and FIFO
queue (--max-concurrent-requests, --queue-size, --queue-timeout-secs) and without it
(both in front of the same engines registered as sglang), and vllm-router (which has no
admission).

Per row and load: goodput (requests that met their class's TTFT SLO, per second),
critical p99 TTFT, how fast refusals came (p99), answers without Retry-After, requests
without an answer, Jain's index of goodput/demand over the standard tenants and the
noisy tenant's goodput/demand beside the others', and the router's RSS after the run.
Beside Jain's index, the index a perfectly fair server would show with the same arrivals
and the same number of standard requests served well (max-min fair shares of them over
the tenants' demands): with a few requests per tenant a cell, the index is far from 1
even then.

    .venv/bin/python bench/bench_overload.py [--duration 6] [--loads 0.5,1,2,4]
        [--durations 15,15,15,60] [--routers 2] [--only-admission] [--peers]

The critical class's floor (what no router could beat on these engines) is
bench/overload_floor.py's.

Writes bench/out/overload.json; the plot bench/plots/overload.png (matplotlib from
.venv-peers) when it is there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # `bench` and pdreg; the engine helpers

from reference_helpers import EngineHandle, start_engines, stop_all  # noqa: E402

from bench import peers  # noqa: E402
from bench.load import completion, run_closed_loop  # noqa: E402
from bench.procs import LOCAL_ROUTER_FLAGS, router_process, rss_bytes  # noqa: E402
from bench.tables import p99, print_table, write_json  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402

OUT = REPO / "bench" / "out" / "overload.json"
PLOT = REPO / "bench" / "plots" / "overload.png"
PROMPT = "overload " * 10  # with a unique first word (no prefix-cache hits), about 100
# byte tokens on the sim: 0.5 s of prefill, one prompt at a time per prefill
SIM_ARGS = ["--sim-prefill-delay", "0.005", "--sim-decode-delay", "0.005",
            "--max-running", "1"]
MAX_TOKENS = 8
CLASSES = {"critical": (0.2, 1.5), "standard": (0.5, 3.0), "sheddable": (0.3, 3.0)}
CLASSES_TOML = """default = "standard"
[classes.critical]
priority = 2
ttft_slo_ms = 1500
[classes.standard]
priority = 1
ttft_slo_ms = 3000
[classes.sheddable]
priority = 0
ttft_slo_ms = 3000
sheddable = true
"""
TENANTS = 10  # t0 is the noisy one: half the traffic
ANSWER_TIMEOUT_S = 60.0
CAPACITY_REQUESTS = 40
CAPACITY_CONCURRENCY = 8
# sglang-router's limit: what the fleet serves at once (2 prefills x 1 slot), a queue
# of two seconds' arrivals at capacity, and the standard SLO as its timeout.
SGLANG_LIMIT = ["--max-concurrent-requests", "2", "--queue-size", "8",
                "--queue-timeout-secs", "3"]


@dataclass
class Outcome:
    klass: str
    tenant: str
    status: int  # 0: no answer (timeout, reset)
    answered_s: float  # arrival to the status line
    ttft_s: float | None  # arrival to the first streamed token (200 only)
    retry_after: bool


@dataclass
class Cell:
    router: str
    load: float
    offered_rps: float
    sent: int
    goodput_rps: float
    critical_p99_s: float
    critical_refused: int
    refusal_p99_ms: float  # every refusal (a 503 at a deadline waited for it)
    shed_p99_ms: float  # 429s alone: the "at once" refusals
    refused: int
    no_retry_after: int
    unanswered: int
    jain_standard: float
    jain_quiet: float  # the nine tenants that are not noisy
    jain_quiet_fair: float  # what a perfectly fair server shows with the same arrivals
    noisy_ratio: float  # the noisy tenant's goodput/demand (standard class)
    others_ratio: float  # the other standard tenants'
    duration_s: float = 0.0
    router_rss_mb: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)


@dataclass
class Target:
    name: str
    urls: list[str]  # the routers the arrivals alternate between
    pids: list[int]

    @property
    def url(self) -> str:
        return self.urls[0]


async def _one(session: aiohttp.ClientSession, url: str, klass: str, tenant: str
               ) -> Outcome:
    started = time.monotonic()
    body = {"model": "tiny", "prompt": _prompt(), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True}
    headers = {"x-pdreg-priority": klass, "x-pdreg-tenant": tenant}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers=headers) as response:
            answered = time.monotonic() - started
            ttft = None
            if response.status == 200:
                async for line in response.content:
                    if ttft is None and line.startswith(b"data: ") \
                            and not line.startswith(b"data: [DONE]"):
                        ttft = time.monotonic() - started
            else:
                await response.read()
            return Outcome(klass, tenant, response.status, answered, ttft,
                           "Retry-After" in response.headers)
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(klass, tenant, 0, time.monotonic() - started, None, False)


def _prompt() -> str:
    return f"{random.getrandbits(40):010x} {PROMPT}"


def _arrivals(rate: float, duration_s: float, seed: int) -> list[tuple[float, str, str]]:
    rng = random.Random(seed)
    names, weights = list(CLASSES), [share for share, _ in CLASSES.values()]
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        tenant = "t0" if rng.random() < 0.5 else f"t{rng.randint(1, TENANTS - 1)}"
        out.append((t, rng.choices(names, weights)[0], tenant))


async def open_loop(urls: list[str], rate: float, duration_s: float, seed: int
                    ) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        start = time.monotonic()
        tasks = []
        for index, (at, klass, tenant) in enumerate(_arrivals(rate, duration_s, seed)):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            url = urls[index % len(urls)]
            tasks.append(asyncio.create_task(_one(session, url, klass, tenant)))
        return list(await asyncio.gather(*tasks))


def _jain(values: list[float]) -> float:
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def _fair_shares(demands: dict[str, int], served: int) -> dict[str, float]:
    """Max-min fair shares of `served` requests over the tenants' demands (each gets
    min(demand, level), the level set so that the shares add up to `served`)."""
    shares = dict.fromkeys(demands, 0.0)
    left, open_ = float(served), sorted(demands, key=demands.__getitem__)
    while open_ and left > 1e-9:
        level = left / len(open_)
        tenant = open_[0]
        if demands[tenant] - shares[tenant] <= level:  # the smallest is met in full
            left -= demands[tenant] - shares[tenant]
            shares[tenant] = float(demands[tenant])
            open_.pop(0)
        else:
            for name in open_:
                shares[name] += level
            left = 0.0
    return shares


def summarize(router: str, load: float, rate: float, duration_s: float,
              outcomes: list[Outcome]) -> Cell:
    def good(o: Outcome) -> bool:
        return o.status == 200 and o.ttft_s is not None and o.ttft_s <= CLASSES[o.klass][1]
    critical = [o.ttft_s for o in outcomes
                if o.klass == "critical" and o.status == 200 and o.ttft_s is not None]
    refused = [o for o in outcomes if o.status not in (0, 200)]
    ratios, demands = {}, {}
    for tenant in (f"t{i}" for i in range(TENANTS)):
        mine = [o for o in outcomes if o.klass == "standard" and o.tenant == tenant]
        if mine:
            ratios[tenant] = sum(map(good, mine)) / len(mine)
            demands[tenant] = len(mine)
    others = [v for t, v in ratios.items() if t != "t0"]
    fair = _fair_shares(demands, sum(1 for o in outcomes if o.klass == "standard" and good(o)))
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    return Cell(
        router=router, load=load, offered_rps=round(rate, 2), sent=len(outcomes),
        goodput_rps=round(sum(map(good, outcomes)) / duration_s, 2),
        critical_p99_s=round(p99(sorted(critical)), 3) if critical else float("nan"),
        critical_refused=sum(1 for o in outcomes if o.klass == "critical" and o.status != 200),
        refusal_p99_ms=round(1000 * p99(sorted(o.answered_s for o in refused)), 1)
        if refused else 0.0,
        shed_p99_ms=round(1000 * p99(sorted(o.answered_s for o in refused
                                            if o.status == 429)), 1)
        if any(o.status == 429 for o in refused) else 0.0,
        refused=len(refused), no_retry_after=sum(1 for o in refused if not o.retry_after),
        unanswered=sum(1 for o in outcomes if o.status == 0),
        jain_standard=round(_jain(list(ratios.values())), 3),
        jain_quiet=round(_jain(others), 3),
        jain_quiet_fair=round(_jain([fair[t] / demands[t] for t in demands if t != "t0"]), 3),
        noisy_ratio=round(ratios.get("t0", 0.0), 3),
        others_ratio=round(sum(others) / len(others), 3) if others else 0.0,
        duration_s=duration_s, statuses=statuses)


@contextmanager
def engines(handshake: str) -> Iterator[tuple[RegistryServer, list[EngineHandle]]]:
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0)).start()
    handles: list[EngineHandle] = []
    try:
        handles = start_engines([{"role": role, "backend": "sim", "protocol": handshake,
                                  "registry": registry.control_address,
                                  "extra_args": SIM_ARGS}
                                 for role in ("prefill", "prefill", "decode", "decode")])
        yield registry, handles
    finally:
        stop_all(handles)
        registry.close()


@contextmanager
def pdreg(registry: str, admission: bool, routers: int = 1) -> Iterator[Target]:
    """pdreg, with admission or without; behind `routers` routers, registered when more
    than one (so that each counts the others and takes its share of every budget)."""
    name = "pdreg admission" if admission else "pdreg no admission"
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as classes, ExitStack() as stack:
        classes.write(CLASSES_TOML)
        classes.flush()
        flags = [*LOCAL_ROUTER_FLAGS, *(["--classes", classes.name] if admission
                                        else ["--no-admission"])]
        started = [stack.enter_context(router_process(registry, "peak_ewma", flags=flags,
                                                      register=routers > 1))
                   for _ in range(routers)]
        urls = [router.url for router in started]
        if routers > 1:
            _counted(urls, routers)
            name += f", {routers} routers"
        yield Target(name, urls, [router.proc.pid for router in started])


def _counted(urls: list[str], routers: int) -> None:
    """Wait until every router counts `routers` routers (its budgets split N ways)."""
    deadline = time.monotonic() + 30
    for url in urls:
        while json.loads(urllib.request.urlopen(url + "/v1/admission", timeout=5).read()
                         )["routers"] != routers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} does not count {routers} routers")
            time.sleep(0.2)


@contextmanager
def peer(start: Callable[[], peers.PeerRouter], label: str = "") -> Iterator[Target]:
    router = start()
    try:
        yield Target(label or router.name, [router.url], [router.proc.pid])
    finally:
        router.stop()


def _ready(url: str) -> None:
    send = completion(url, {"model": "tiny", "prompt": "warm", "max_tokens": 1})
    deadline = time.monotonic() + 30
    while run_closed_loop(send, 1, 1).failed:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} serves nothing")
        time.sleep(0.2)


def capacity(url: str) -> float:
    """Requests/s the fleet completes when always busy (pdreg without admission)."""
    _ready(url)

    async def send(session: aiohttp.ClientSession) -> bool:
        body = {"model": "tiny", "prompt": _prompt(), "max_tokens": MAX_TOKENS,
                "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as response:
            await response.read()
            return response.status == 200
    load = run_closed_loop(send, CAPACITY_REQUESTS, CAPACITY_CONCURRENCY)
    return len(load.latencies) / load.wall_s


def run_row(target: Target, rps: float, loads: list[float], durations: list[float]
            ) -> list[Cell]:
    for url in target.urls:
        _ready(url)
    cells = []
    for index, (load, duration_s) in enumerate(zip(loads, durations, strict=True)):
        rate = load * rps
        outcomes = asyncio.run(open_loop(target.urls, rate, duration_s, seed=index))
        cell = summarize(target.name, load, rate, duration_s, outcomes)
        if target.pids:  # the largest router's
            cell.router_rss_mb = round(max(map(rss_bytes, target.pids)) / 2**20, 1)
        print(f"  {target.name} {load}x: goodput {cell.goodput_rps}/s, critical p99 "
              f"{cell.critical_p99_s}s, statuses {cell.statuses}", flush=True)
        cells.append(cell)
        time.sleep(2.0)  # the engines drain what the last load left
    return cells


def lineups(with_peers: bool, routers: int, only_admission: bool
            ) -> Iterator[tuple[str, list[Callable[..., AbstractContextManager[Target]]]]]:
    yield "vllm-nixl", [
        lambda reg, hs: pdreg(reg, True),
        *([lambda reg, hs: pdreg(reg, True, routers)] if routers > 1 else []),
        *([] if only_admission else [lambda reg, hs: pdreg(reg, False)])]
    if with_peers:
        def prefills(hs: list[EngineHandle]) -> list[EngineHandle]:
            return [h for h in hs if h.id.startswith("prefill")]

        def decodes(hs: list[EngineHandle]) -> list[str]:
            return [h.url for h in hs if h.id.startswith("decode")]
        yield "vllm-nixl", [lambda reg, hs: peer(lambda: peers.start_vllm_router(
            [h.url for h in prefills(hs)], decodes(hs)))]
        yield "sglang", [
            lambda reg, hs: peer(lambda: peers.start_sglang_router(
                [(h.url, h.bootstrap_port) for h in prefills(hs)], decodes(hs),
                extra_args=SGLANG_LIMIT), "sglang-router (limit)"),
            lambda reg, hs: peer(lambda: peers.start_sglang_router(
                [(h.url, h.bootstrap_port) for h in prefills(hs)], decodes(hs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per load")
    parser.add_argument("--loads", default="0.5,1,2,4")
    parser.add_argument("--durations", default="",
                        help="seconds per load, one per --loads (default: --duration each)")
    parser.add_argument("--routers", type=int, default=1,
                        help="also a row with admission behind this many routers")
    parser.add_argument("--only-admission", action="store_true",
                        help="leave out the row without admission")
    parser.add_argument("--peers", action="store_true", help="the peer routers too")
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    durations = ([float(x) for x in args.durations.split(",")] if args.durations
                 else [args.duration] * len(loads))
    if len(durations) != len(loads):
        parser.error("--durations needs one value per load")
    cells: list[Cell] = []
    rps = 0.0
    for handshake, factories in lineups(args.peers, args.routers, args.only_admission):
        with engines(handshake) as (registry, handles):
            if not rps:
                with pdreg(registry.control_address, False) as target:
                    rps = capacity(target.url)
                print(f"capacity: {rps:.1f} requests/s", flush=True)
            for factory in factories:
                try:
                    with factory(registry.control_address, handles) as target:
                        cells += run_row(target, rps, loads, durations)
                except RuntimeError as exc:  # a peer that would not start: its row is left out
                    print(f"  skipped: {str(exc)[:300]}", flush=True)
    write_json(OUT, {"capacity_rps": rps, "durations_s": durations,
                     "cells": [asdict(c) for c in cells]})
    print_table(["router", "load", "s", "offered/s", "goodput/s", "critical p99 s",
                 "critical refused", "429 p99 ms", "refusal p99 ms", "refused",
                 "no Retry-After", "unanswered", "Jain all / quiet / fair", "noisy / others",
                 "RSS MB"],
                [(c.router, f"{c.load:g}x", f"{c.duration_s:g}", c.offered_rps, c.goodput_rps,
                  c.critical_p99_s, c.critical_refused, c.shed_p99_ms, c.refusal_p99_ms,
                  c.refused, c.no_retry_after, c.unanswered,
                  f"{c.jain_standard} / {c.jain_quiet} / {c.jain_quiet_fair}",
                  f"{c.noisy_ratio} / {c.others_ratio}", c.router_rss_mb) for c in cells])
    plot()
    return 0


def plot() -> None:
    python = peers.PEERS_VENV / "bin" / "python"
    script = REPO / "bench" / "plots" / "plot_overload.py"
    if python.exists() and script.exists():
        subprocess.run([str(python), str(script), str(OUT), str(PLOT)], check=False)


if __name__ == "__main__":
    sys.exit(main())
