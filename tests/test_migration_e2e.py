"""No stream lost: 32 concurrent streams over real torch engines survive a kill -9 of a
decode, a kill -9 of a prefill and a decode frozen (SIGSTOP) for 10 s, and every output
is token-identical to an undisturbed run.

A real registry, 2 prefill + 3 decode reference engines (torch, greedy) registering
themselves, the router in-process with a short stream-idle timeout. Four waves of the
same 32 streaming requests (half completions, half chat; half asking for token ids):
the first undisturbed, then one per fault, injected while the victim holds streams.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from reference_helpers import EngineHandle, start_engines, stop_all

from pdreg.testing import CPU_ENGINE_TTFT_SLO_MS, wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from router.config import AdmissionOptions, KvOptions, PairingOptions, Retries, Timeouts
from router.guard import LOOPBACK_ALLOW
from router.service import RouterConfig, RouterServer
from wire.protocol import MemberState

STREAMS = 32
MAX_TOKENS = 32
FREEZE_S = 10.0
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[RegistryServer, list[EngineHandle]]]:
    from registry.server import RegistryConfig

    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0,
                                             heartbeat_interval_s=0.2, lease_s=1.0)).start()
    # A short KV lease: KV held for a killed decode must not hold up the final drain.
    engine_args = ["--max-running", "16", "--kv-lease", "3"]
    handles: list[EngineHandle] = []
    try:
        handles = start_engines(
            [{"role": role, "backend": "torch", "registry": registry.control_address,
              "extra_args": engine_args} for role in ["prefill"] * 2 + ["decode"] * 3])
        yield registry, handles
    finally:
        for handle in handles:  # a frozen engine cannot drain
            if handle.proc.poll() is None:
                os.kill(handle.proc.pid, signal.SIGCONT)
        stop_all(handles)
        registry.close()


@pytest.fixture(scope="module")
def router(cluster: tuple[RegistryServer, list[EngineHandle]]) -> Iterator[RouterServer]:
    registry, handles = cluster
    view = MembershipView(registry.control_address).start()
    server = RouterServer(RouterConfig(port=0, upstream=Timeouts(idle_read_s=5.0),
                                       retries=Retries(max_migrations=5),
                                       pairing=PairingOptions(quarantine_s=3.0),
                                       # every request takes both legs: the faults
                                       # are the prefill's and the decode's
                                       kv=KvOptions(disagg_min_uncached_tokens=0),
                                       # once a prefill is gone nothing here may be
                                       # refused, only served later
                                       admission=AdmissionOptions(
                                           ttft_slo_ms=CPU_ENGINE_TTFT_SLO_MS),
                                       allow_upstream=LOOPBACK_ALLOW),
                          view).start()
    try:
        assert view.wait_for(lambda m: all(
            h.id in m and m[h.id].record.state is MemberState.READY for h in handles), WAIT_S)
        yield server
    finally:
        server.close()
        view.close()


def request(i: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                            "stream": True, "return_token_ids": i % 4 < 2,
                            "stream_options": {"include_usage": True}}
    text = f"stream {i}: the registry keeps the live membership ✓"
    if i % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                               "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


class Started:
    """How many streams of the current wave have had their first token."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.count += 1


def run_one(url: str, i: int, started: Started) -> dict[str, Any]:
    """What the client saw: ids (if asked), text, ids of the response, usage, errors."""
    path, body = request(i)
    out: dict[str, Any] = {"status": 0, "ids": [], "text": "", "response_ids": set(),
                           "usage": None, "errors": [], "done": False}
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        out["status"] = response.status_code
        lines: list[str] = []
        counted = False
        for line in response.iter_lines():
            if not counted and '"token_ids"' in line:  # a token's chunk (ids or null)
                started.add()
                counted = True
            lines.append(line)
    for line in lines:
        if line == "data: [DONE]":
            out["done"] = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            out["response_ids"].add(event["id"])
            out["usage"] = event.get("usage") or out["usage"]
            for choice in event["choices"]:
                out["ids"] += choice.get("token_ids") or []
                out["text"] += (choice["delta"].get("content") or "" if "delta" in choice
                                else choice["text"])
    return out


def wave(url: str, during: Callable[[Started], None] | None = None
         ) -> list[dict[str, Any]]:
    started = Started()
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(run_one, url, i, started) for i in range(STREAMS)]
        if during is not None:
            during(started)
        return [f.result() for f in futures]


def mid_stream(server: RouterServer, candidates: list[EngineHandle], started: Started
               ) -> Callable[[], EngineHandle | None]:
    """Once most streams have tokens: the candidate holding the most of them (at least 2),
    else None. The victim is chosen then, not before: a latency-aware policy decides
    which decodes take the wave."""
    def busiest() -> EngineHandle | None:
        if started.count < STREAMS * 3 // 4:
            return None
        counts = server.router.in_flight.counts
        best = max(candidates, key=lambda h: counts.get(h.id, 0))
        return best if counts.get(best.id, 0) >= 2 else None
    return busiest


def test_no_stream_is_lost(cluster: tuple[RegistryServer, list[EngineHandle]],
                           router: RouterServer) -> None:
    _, handles = cluster
    prefills, decodes = handles[:2], handles[2:]
    baseline = wave(router.url)
    for out in baseline:
        assert out["status"] == 200 and out["done"] and not out["errors"], out
    for i, out in enumerate(baseline):
        if i % 4 < 2:
            assert len(out["ids"]) == MAX_TOKENS

    def kill_prefill(handle: EngineHandle) -> Callable[[Started], None]:
        def act(started: Started) -> None:  # while requests are in their prefill
            assert wait_until(lambda: router.router.in_flight.counts.get(handle.id, 0) >= 1,
                              WAIT_S), "no request on the victim"
            handle.proc.send_signal(signal.SIGKILL)
        return act

    alive_decodes = list(decodes)

    def victim(started: Started) -> EngineHandle:
        pick = mid_stream(router, alive_decodes, started)
        deadline = time.monotonic() + WAIT_S
        while (handle := pick()) is None:
            assert time.monotonic() < deadline, "no decode holds streams"
            time.sleep(0.01)
        return handle

    def kill(started: Started) -> None:
        handle = victim(started)
        handle.proc.send_signal(signal.SIGKILL)
        alive_decodes.remove(handle)

    def freeze(started: Started) -> None:
        handle = victim(started)
        os.kill(handle.proc.pid, signal.SIGSTOP)
        time.sleep(FREEZE_S)  # the fault itself: frozen this long
        os.kill(handle.proc.pid, signal.SIGCONT)

    faults = [("kill -9 a decode", kill),
              ("kill -9 a prefill", kill_prefill(prefills[0])),
              (f"SIGSTOP a decode for {FREEZE_S:g} s", freeze)]
    for name, act in faults:
        results = wave(router.url, act)
        for i, (got, want) in enumerate(zip(results, baseline, strict=True)):
            assert got["status"] == 200 and got["done"], (name, i, got)
            assert not got["errors"], (name, i, got["errors"])
            assert got["text"] == want["text"], (name, i)
            assert got["ids"] == want["ids"], (name, i)
            assert len(got["response_ids"]) == 1, (name, i)
            # The token counts are the client's bill; what the caches held (a later
            # wave finds the earlier's prompts cached) is not.
            assert _counts(got["usage"]) == _counts(want["usage"]), (name, i)
    metrics = httpx.get(router.url + "/metrics").text
    migrated = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("pdreg_router_migrations_total{"))
    assert migrated >= 2  # the killed decode's streams and the frozen one's, at least
    assert 'outcome="failed_midstream"' not in metrics


def _counts(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A usage without its `prompt_tokens_details` (cached tokens)."""
    if usage is None:
        return None
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
