"""End to end: a real registry, reference engines as processes, the router, the openai client.

Engines register themselves; the router learns them through a MembershipView. Checks:
both handshakes give the same tokens as a mixed engine; joining, draining and killed
members; no decode at all.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from reference_helpers import EngineHandle, collect, metrics, start_engine, start_engines

from pdreg.testing import die_with_parent, stop_process, wait_until
from registry.client import LiveMember, MembershipView
from registry.server import RegistryServer
from router.config import PairingOptions
from router.guard import LOOPBACK_ALLOW
from router.service import RouterConfig, RouterServer
from wire.protocol import Handshake, MemberState, Role

VIEW_TIMEOUT_S = 15.0


@pytest.fixture
def router(view: MembershipView) -> Iterator[RouterServer]:
    server = RouterServer(RouterConfig(port=0, policy="round_robin",
                                       pairing=PairingOptions(quarantine_s=3.0),
                                       allow_upstream=LOOPBACK_ALLOW),
                          view).start()
    try:
        yield server
    finally:
        server.close()


class Engines:
    def __init__(self, registry: RegistryServer) -> None:
        self.registry = registry
        self.handles: list[EngineHandle] = []

    def start(self, *specs: dict[str, object]) -> list[EngineHandle]:
        full = [{"backend": "sim", "registry": self.registry.control_address, **s}
                for s in specs]
        handles = start_engines(full)
        self.handles += handles
        return handles

    def stop_all(self) -> None:
        for handle in self.handles:
            handle.stop(timeout_s=10)


@pytest.fixture
def engines(registry: RegistryServer) -> Iterator[Engines]:
    e = Engines(registry)
    try:
        yield e
    finally:
        e.stop_all()


def routable(view: MembershipView, *ids: str) -> Callable[[], bool]:
    def check() -> bool:
        members = view.members()
        return all(i in members and members[i].record.state is MemberState.READY
                   for i in ids)
    return check


def gone_or_not_ready(view: MembershipView, member_id: str) -> Callable[[], bool]:
    def check() -> bool:
        member: LiveMember | None = view.members().get(member_id)
        return member is None or member.record.state is not MemberState.READY
    return check


def oai(router: RouterServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)


# --- handshakes: identical to a mixed engine ----------------------------------------------------

@pytest.mark.parametrize("protocol", [Handshake.VLLM_NIXL, Handshake.SGLANG])
def test_both_endpoints_stream_and_not_match_a_mixed_engine(
        protocol: str, engines: Engines, view: MembershipView, router: RouterServer) -> None:
    p, d = engines.start({"role": "prefill", "protocol": protocol},
                         {"role": "decode", "protocol": protocol})
    mixed = start_engine(role="mixed", backend="sim", protocol=protocol)  # not registered
    engines.handles.append(mixed)
    assert view.wait_for(lambda m: routable(view, p.id, d.id)(), VIEW_TIMEOUT_S)
    bodies = [("/v1/completions", {"model": "tiny", "prompt": "the quick brown fox",
                                   "max_tokens": 8, "ignore_eos": True}),
              ("/v1/chat/completions", {"model": "tiny", "max_tokens": 6, "ignore_eos": True,
                                        "messages": [{"role": "user", "content": "hello"}]})]
    with httpx.Client(timeout=60) as http:
        for path, body in bodies:
            for stream in (False, True):
                full = {**body, "stream": stream, "return_token_ids": True}
                want = collect(http.post(mixed.url + path, json=full), stream)
                got = collect(http.post(router.url + path, json=full), stream)
                assert got == want, (path, stream)
                assert want[0], "no tokens compared"
    # And through the openai client.
    c = oai(router)
    text = c.completions.create(model="tiny", prompt="abc", max_tokens=4,
                                extra_body={"ignore_eos": True}).choices[0].text
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model="tiny", prompt="abc", max_tokens=4, stream=True,
        extra_body={"ignore_eos": True}))
    assert text == streamed and text
    assert [m.id for m in c.models.list()] == ["tiny"]


# --- elasticity ---------------------------------------------------------------------------------

def test_no_decode_is_503_before_any_leg(engines: Engines, view: MembershipView,
                                        router: RouterServer) -> None:
    """No routable decode: the client is told at once (503, Retry-After), and the prefill
    is never asked to compute a prompt no decode could take over."""
    (p,) = engines.start({"role": "prefill"})
    assert view.wait_for(lambda m: routable(view, p.id)(), VIEW_TIMEOUT_S)
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"},
                   timeout=VIEW_TIMEOUT_S)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
    assert r.headers["Retry-After"] == "1"
    assert metrics(p.url).get("pdreg:engine_requests_total", 0.0) == 0.0


def test_a_joining_member_gets_requests_promptly(engines: Engines, view: MembershipView,
                                                 router: RouterServer) -> None:
    p1, d1 = engines.start({"role": "prefill"}, {"role": "decode"})
    assert view.wait_for(lambda m: routable(view, p1.id, d1.id)(), VIEW_TIMEOUT_S)
    c = oai(router)
    c.completions.create(model="tiny", prompt="x", max_tokens=1)
    joined = time.monotonic()
    (p2,) = engines.start({"role": "prefill"})
    assert view.wait_for(lambda m: routable(view, p2.id)(), VIEW_TIMEOUT_S)
    for i in range(4):  # round robin over two prefills
        c.completions.create(model="tiny", prompt=f"x{i}", max_tokens=1)
    text = httpx.get(router.url + "/metrics").text
    assert f'pdreg_router_picks_total{{member="{p2.id}",role="prefill"}} 2.0' in text
    assert time.monotonic() - joined < VIEW_TIMEOUT_S


def _load(router: RouterServer, stop: threading.Event, errors: list[str], ok: list[int],
          max_tokens: int = 4) -> None:
    with httpx.Client(timeout=60) as http:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": i % 2 == 0}
            try:
                r = http.post(router.url + "/v1/completions", json=body)
                if r.status_code != 200 or (body["stream"] and "[DONE]" not in r.text) \
                        or '"error"' in r.text:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                else:
                    ok.append(1)
            except httpx.HTTPError as exc:
                errors.append(repr(exc))


def _run_load(router: RouterServer, workers: int, action: Callable[[], None],
              max_tokens: int = 4) -> tuple[list[str], int]:
    stop = threading.Event()
    errors: list[str] = []
    ok: list[int] = []
    with ThreadPoolExecutor(workers) as pool:
        for _ in range(workers):
            pool.submit(_load, router, stop, errors, ok, max_tokens)
        try:
            assert wait_until(lambda: len(ok) >= 10, 30), errors[:3]
            action()
            before = len(ok)
            assert wait_until(lambda: len(ok) >= before + 20, 30), errors[:3]
        finally:
            stop.set()
    return errors, len(ok)


def test_kill_9_of_a_prefill_under_load_is_invisible(engines: Engines, view: MembershipView,
                                                     router: RouterServer) -> None:
    p1, p2, d = engines.start({"role": "prefill"}, {"role": "prefill"}, {"role": "decode"})
    assert view.wait_for(lambda m: routable(view, p1.id, p2.id, d.id)(), VIEW_TIMEOUT_S)
    errors, served = _run_load(router, 4, lambda: p1.proc.send_signal(signal.SIGKILL))
    assert errors == [] and served >= 30
    assert view.wait_for(lambda m: p1.id not in m, VIEW_TIMEOUT_S)  # registry expired it


def test_a_draining_member_finishes_in_flight_and_gets_nothing_new(
        engines: Engines, view: MembershipView, router: RouterServer) -> None:
    p, d1, d2 = engines.start({"role": "prefill"}, {"role": "decode"},
                              {"role": "decode", "extra_args": [
                                  "--sim-decode-delay", "0.01"]})
    assert view.wait_for(lambda m: routable(view, p.id, d1.id, d2.id)(), VIEW_TIMEOUT_S)

    def drain_d2() -> None:
        d2.proc.send_signal(signal.SIGTERM)
        assert wait_until(gone_or_not_ready(view, d2.id), VIEW_TIMEOUT_S)

    errors, _ = _run_load(router, 4, drain_d2, max_tokens=8)
    assert errors == []
    assert d2.proc.wait(30) == 0  # drained cleanly
    picks_before = _picks(router, d2.id)
    oai(router).completions.create(model="tiny", prompt="after", max_tokens=1)
    assert _picks(router, d2.id) == picks_before


def _picks(router: RouterServer, member_id: str) -> float:
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith(f'pdreg_router_picks_total{{member="{member_id}"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- the CLI ----------------------------------------------------------------------------------

def test_cli_router_registers_itself_and_serves(registry: RegistryServer,
                                                engines: Engines) -> None:
    engines.start({"role": "prefill"}, {"role": "decode"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "router", "--registry", registry.control_address,
         "--port", "0", "--policy", "least_loaded", "--drain-delay", "0.2",
         "--allow-upstream", LOOPBACK_ALLOW],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().decode()
        assert '"ready"' in ready, ready
        info = json.loads(ready)
        assert wait_until(lambda: info["id"] in registry.members(), VIEW_TIMEOUT_S)
        assert registry.members()[info["id"]].spec.role is Role.API_SERVER

        def served() -> bool:
            r = httpx.post(info["url"] + "/v1/completions",
                           json={"model": "tiny", "prompt": "cli", "max_tokens": 2})
            return r.status_code == 200
        assert wait_until(served, VIEW_TIMEOUT_S)
    finally:
        assert stop_process(proc, 20) == 0
    assert wait_until(lambda: info["id"] not in registry.members(), VIEW_TIMEOUT_S)


def test_sigterm_drains_the_router_before_it_stops(registry: RegistryServer,
                                                  engines: Engines) -> None:
    """Draining, not ready, still serving for --drain-delay; in-flight streams finish;
    then bye and exit 0."""
    engines.start({"role": "prefill"},
                  {"role": "decode", "extra_args": ["--sim-decode-delay", "0.05"]})
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "router", "--registry", registry.control_address,
         "--port", "0", "--drain-delay", "1.5", "--drain-timeout", "20",
         "--allow-upstream", LOOPBACK_ALLOW],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        url = info["url"]
        assert wait_until(lambda: httpx.get(url + "/ready").status_code == 200,
                          VIEW_TIMEOUT_S)
        body = {"model": "tiny", "prompt": "long", "max_tokens": 60, "ignore_eos": True,
                "stream": True}
        assert wait_until(lambda: httpx.post(url + "/v1/completions",
                                             json={**body, "stream": False,
                                                   "max_tokens": 1}).status_code == 200,
                          VIEW_TIMEOUT_S)
        result: dict[str, httpx.Response] = {}
        streaming = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(url + "/v1/completions", json=body, timeout=60)))
        streaming.start()  # 60 tokens at 50 ms: about 3 s, past the drain delay
        assert wait_until(lambda: _in_flight(url) > 0, 10)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(url + "/ready").status_code == 503, 5)
        assert httpx.get(url + "/health").status_code == 200  # alive
        assert wait_until(lambda: registry.members()[info["id"]].state is
                          MemberState.DRAINING, 5)
        # Still serving while load balancers notice.
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False,
                                                      "max_tokens": 1})
        assert r.status_code == 200
        assert proc.wait(30) == 0
        streaming.join(30)
        assert result["r"].status_code == 200 and result["r"].text.endswith(
            "data: [DONE]\n\n")
        assert info["id"] not in registry.members()  # said bye
    finally:
        stop_process(proc, 20)


def _in_flight(url: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("pdreg_router_in_flight{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
