"""The router's HTTP front against contract stand-ins with a static membership."""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Iterator

import httpx
import msgspec
import openai
import pytest
from standins_engines import tokens_for
from standins_fleet import Fleet, LoopThread, live_member

from pdreg.testing import wait_until
from router.adapters import default_adapters
from router.guard import LOOPBACK_ALLOW
from router.http import upstream
from router.service import RouterConfig, RouterServer
from wire.protocol import Handshake, MemberState, Role

P, D, X = Role.PREFILL, Role.DECODE, Role.MIXED
PROTOCOLS = tuple(Handshake)


@pytest.fixture(params=PROTOCOLS)
def fleet(loop_thread: LoopThread, request: pytest.FixtureRequest) -> Fleet:
    f = Fleet(loop_thread, request.param)
    f.add("p1", P)
    f.add("d1", D)
    return f


@pytest.fixture
def nixl(loop_thread: LoopThread) -> Fleet:
    return Fleet(loop_thread, Handshake.VLLM_NIXL)


class RouterFixture:
    def __init__(self) -> None:
        self.servers: list[RouterServer] = []

    def __call__(self, fleet: Fleet, **config: object) -> RouterServer:
        config.setdefault("port", 0)
        config.setdefault("allow_upstream", LOOPBACK_ALLOW)
        server = RouterServer(RouterConfig(**config), fleet.view).start()  # type: ignore[arg-type]
        self.servers.append(server)
        return server


@pytest.fixture
def router() -> Iterator[RouterFixture]:
    fixture = RouterFixture()
    try:
        yield fixture
    finally:
        for server in fixture.servers:
            server.close()


def client(server: RouterServer, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0,
                         timeout=30)


def expected(prompt: str, n: int) -> str:
    return "".join(tokens_for(prompt, n))


# --- the handshakes, end to end through the openai client -------------------------------------

def test_completion_matches_a_mixed_engine(fleet: Fleet, router: RouterFixture) -> None:
    server = router(fleet)
    got = client(server).completions.create(model="m", prompt="hello world", max_tokens=5)
    assert got.choices[0].text == expected("hello world", 5)
    p, d = fleet.engines["p1"], fleet.engines["d1"]
    assert len(p.requests) == 1 and len(d.requests) == 1
    assert not p.rejections and not d.rejections


def test_chat_stream_matches_a_mixed_engine(fleet: Fleet, router: RouterFixture) -> None:
    server = router(fleet)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chunks = client(server).chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=7, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected("be brief\nhi", 7)


def test_completion_stream_and_chat_plain(fleet: Fleet, router: RouterFixture) -> None:
    server = router(fleet)
    c = client(server)
    stream = c.completions.create(model="m", prompt="abc", max_tokens=4, stream=True)
    assert "".join(x.choices[0].text for x in stream) == expected("abc", 4)
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                     max_completion_tokens=3)
    assert chat.choices[0].message.content == expected("q", 3)


def test_mixed_member_serves_directly(loop_thread: LoopThread, router: RouterFixture) -> None:
    fleet = Fleet(loop_thread, Handshake.SGLANG)
    x = fleet.add("x1", X)
    server = router(fleet)
    got = client(server).completions.create(model="m", prompt="direct", max_tokens=3)
    assert got.choices[0].text == expected("direct", 3)
    assert not x.rejections and len(x.requests) == 1


def test_standins_reject_requests_off_contract(nixl: Fleet) -> None:
    p = nixl.add("p1", P)
    d = nixl.add("d1", D)
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    assert httpx.post(p.url + "/v1/completions", json=body).status_code == 400
    assert httpx.post(d.url + "/v1/completions", json=body).status_code == 400


# --- admission --------------------------------------------------------------------------------

def test_no_decode_is_503_fast(nixl: Fleet, router: RouterFixture) -> None:
    nixl.add("p1", P)
    server = router(nixl)
    started = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 503 and time.monotonic() - started < 1.0
    assert r.json()["error"]["code"] == "no_capacity"
    assert r.headers["Retry-After"] == "1"
    assert httpx.get(server.url + "/v1/models").json()["data"] == []


def test_models_health_metrics(fleet: Fleet, router: RouterFixture) -> None:
    server = router(fleet)
    assert [m.id for m in client(server).models.list()] == ["m"]
    assert httpx.get(server.url + "/health").status_code == 200
    client(server).completions.create(model="m", prompt="x", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    assert 'pdreg_router_requests_total{model="m",outcome="ok"} 1.0' in text
    assert 'pdreg_router_picks_total{member="p1",role="prefill"} 1.0' in text
    assert 'pdreg_router_in_flight{member="d1"} 0.0' in text


@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400), (b'{"prompt": "x"}', 400), (b"[1, 2]", 400),
    (b'{"model": "unknown", "prompt": "x"}', 404),
])
def test_bad_requests_get_clear_errors(nixl: Fleet, router: RouterFixture, body: bytes,
                                       status: int) -> None:
    nixl.add("p1", P)
    nixl.add("d1", D)
    server = router(nixl)
    r = httpx.post(server.url + "/v1/completions", content=body)
    assert r.status_code == status
    assert "message" in r.json()["error"]


def test_api_key(nixl: Fleet, router: RouterFixture) -> None:
    nixl.add("p1", P)
    nixl.add("d1", D)
    server = router(nixl, api_key="sekrit")
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").completions.create(model="m", prompt="x", max_tokens=1)
    got = client(server, "sekrit").completions.create(model="m", prompt="x", max_tokens=1)
    assert got.choices[0].text == expected("x", 1)


def test_prefill_4xx_is_relayed_not_retried(nixl: Fleet, router: RouterFixture) -> None:
    p = nixl.add("p1", P)
    nixl.add("d1", D)
    p.faults.status = 422
    server = router(nixl)
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 422 and len(p.requests) == 1
    assert nixl.view.reports == []


# --- failures -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["status", "drop"])
def test_failing_prefill_is_quarantined_reported_and_retried(
        fleet: Fleet, router: RouterFixture, fault: str) -> None:
    bad = fleet.engines["p1"]
    fleet.add("p2", P)
    if fault == "status":
        bad.faults.status = 503
    else:
        bad.faults.drop = True
    server = router(fleet, policy="round_robin")
    c = client(server)
    for i in range(4):
        got = c.completions.create(model="m", prompt=f"q{i}", max_tokens=2)
        assert got.choices[0].text == expected(f"q{i}", 2)
    assert len(bad.requests) == 1  # quarantined after its first failure
    assert wait_until(lambda: [r[0] for r in fleet.view.reports] == ["p1"], 10)
    text = httpx.get(server.url + "/metrics").text
    assert 'pdreg_router_retries_total{reason="prefill_failed"} 1.0' in text
    assert 'pdreg_router_quarantines_total{member="p1"} 1.0' in text


def test_decode_failure_before_first_byte_is_retried(nixl: Fleet, router: RouterFixture
                                                     ) -> None:
    nixl.add("p1", P)
    bad = nixl.add("d1", D)
    nixl.add("d2", D)
    bad.faults.drop = True
    server = router(nixl, policy="round_robin")
    c = client(server)
    for i in range(3):
        chunks = c.completions.create(model="m", prompt=f"s{i}", max_tokens=3, stream=True)
        assert "".join(x.choices[0].text for x in chunks) == expected(f"s{i}", 3)
    assert len(bad.requests) == 1


def test_all_pairs_failing_is_502(nixl: Fleet, router: RouterFixture) -> None:
    p = nixl.add("p1", P)
    nixl.add("d1", D)
    p.faults.status = 500
    server = router(nixl)
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed"
    # Quarantined now: the next request is refused at admission, fast.
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 503


def test_mid_stream_failure_without_migration_ends_with_an_sse_error(
        nixl: Fleet, router: RouterFixture) -> None:
    nixl.add("p1", P)
    d = nixl.add("d1", D)
    d.faults.cut_after_chunks = 2
    server = router(nixl, max_migrations=0)
    body = {"model": "m", "prompt": "x", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert len(events) == 4, events
    assert all("choices" in e for e in events[:2])
    assert "error" in msgspec.json.decode(events[2][6:])
    assert events[3] == "data: [DONE]"
    text = httpx.get(server.url + "/metrics").text
    assert 'outcome="failed_midstream"} 1.0' in text


def test_client_disconnect_cancels_the_decode(fleet: Fleet, router: RouterFixture) -> None:
    d = fleet.engines["d1"]
    d.faults.token_delay_s = 0.05
    server = router(fleet)
    body = {"model": "m", "prompt": "long", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then hang up
    assert wait_until(lambda: d.cancelled == 1, 10)
    assert wait_until(lambda: server.router.in_flight.counts == {}, 10)
    assert fleet.view.reports == []  # the client left; no engine is to blame
    assert server.router.quarantine.active(time.monotonic()) == {}


def test_sglang_prefill_failure_cancels_both_and_retries(loop_thread: LoopThread,
                                                         router: RouterFixture) -> None:
    fleet = Fleet(loop_thread, Handshake.SGLANG)
    bad = fleet.add("p1", P)
    fleet.add("p2", P)
    d = fleet.add("d1", D)
    bad.faults.status = 500
    server = router(fleet, policy="round_robin")
    got = client(server).completions.create(model="m", prompt="room", max_tokens=2)
    assert got.choices[0].text == expected("room", 2)
    # The first decode leg was abandoned when its prefill failed, the second served.
    assert len(d.requests) == 2
    rooms = {r[1]["bootstrap_room"] for r in d.requests}
    assert len(rooms) == 2  # a new room for the new pair


def test_bootstrap_rooms_come_from_the_adapters_rng(loop_thread: LoopThread) -> None:
    rooms = []
    for _ in range(2):
        fleet = Fleet(loop_thread, Handshake.SGLANG)
        fleet.add("p1", P)
        d = fleet.add("d1", D)
        with RouterServer(RouterConfig(port=0, allow_upstream=LOOPBACK_ALLOW), fleet.view,
                          adapters=default_adapters(random.Random(7))) as server:
            client(server).completions.create(model="m", prompt="x", max_tokens=1)
        rooms.append(d.requests[0][1]["bootstrap_room"])
    assert rooms[0] == rooms[1] == random.Random(7).randrange(2**63)


def test_draining_member_gets_nothing_new(nixl: Fleet, router: RouterFixture) -> None:
    p1 = nixl.add("p1", P)
    p2 = nixl.add("p2", P)
    nixl.add("d1", D)
    server = router(nixl)
    members = dict(nixl.view.members())
    members["p1"] = live_member("p1", P, p1.url, kv_port=p1.kv_port, state=MemberState.DRAINING)
    nixl.view.set(members)
    c = client(server)
    for i in range(5):
        c.completions.create(model="m", prompt=str(i), max_tokens=1)
    assert len(p1.requests) == 0 and len(p2.requests) == 5


def test_client_leaving_after_done_is_a_quiet_cancel(
        loop_thread: LoopThread, router: RouterFixture, caplog: pytest.LogCaptureFixture
        ) -> None:
    # SGLang: D has streamed [DONE] while P's leg still runs; the client hangs up then.
    fleet = Fleet(loop_thread, Handshake.SGLANG)
    p = fleet.add("p1", P)
    fleet.add("d1", D)
    p.faults.answer_delay_s = 1.0
    server = router(fleet)
    body = {"model": "m", "prompt": "bye", "max_tokens": 3, "stream": True}
    with caplog.at_level(logging.ERROR), httpx.stream(
            "POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break  # hang up before the chunked stream's end
    metrics_text = lambda: httpx.get(server.url + "/metrics").text  # noqa: E731
    assert wait_until(lambda: 'outcome="cancelled"} 1.0' in metrics_text(), 10)
    assert wait_until(lambda: server.router.in_flight.counts == {}, 10)
    assert 'outcome="ok"' not in metrics_text()
    assert [rec for rec in caplog.records if rec.levelno >= logging.ERROR] == []
    assert fleet.view.reports == []  # nobody is to blame


# --- the upstream connection pool ---------------------------------------------------------------

def test_engine_legs_reuse_keep_alive_connections(fleet: Fleet, router: RouterFixture) -> None:
    server = router(fleet)
    c = client(server)
    for i in range(6):
        got = c.completions.create(model="m", prompt=f"k{i}", max_tokens=2)
        assert got.choices[0].text == expected(f"k{i}", 2)
        chunks = c.completions.create(model="m", prompt=f"s{i}", max_tokens=2, stream=True)
        assert "".join(x.choices[0].text for x in chunks) == expected(f"s{i}", 2)
    for engine in fleet.engines.values():
        # One, used 12 times; a second only while a stream's end (after [DONE]) is still
        # being read beside the request that follows (router/relay.py).
        assert len(engine.connections) <= 2, (engine.role, engine.connections)


def test_a_pooled_connection_the_engine_closed_is_not_reused(nixl: Fleet,
                                                             router: RouterFixture) -> None:
    p = nixl.add("p1", P)
    d = nixl.add("d1", D)
    server = router(nixl, warm_connections=0)  # only the connections requests opened
    c = client(server)
    c.completions.create(model="m", prompt="a", max_tokens=1)

    async def close_idle() -> None:  # as an engine's keep-alive timeout does
        for engine in (p, d):
            for transport in engine.connections.values():
                transport.close()
    nixl.loop.run(close_idle())
    pool = server.router.upstream()
    assert wait_until(lambda: not any(conn.usable for idle in pool._idle.values()
                                      for conn in idle), 10)
    got = c.completions.create(model="m", prompt="b", max_tokens=2)
    assert got.choices[0].text == expected("b", 2)
    assert len(p.connections) == 2 and len(d.connections) == 2
    assert "pdreg_router_retries_total{" not in httpx.get(server.url + "/metrics").text


def test_a_slow_reader_gets_a_long_stream_whole(nixl: Fleet, router: RouterFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A stream far over the pool's read high-water mark, to a client with a tiny receive
    # window that sleeps: reading the engine pauses and resumes; nothing lost or reordered.
    pauses = []
    pause = upstream._Connection.pause_reading
    monkeypatch.setattr(upstream._Connection, "pause_reading",
                        lambda self: (pauses.append(1), pause(self)))
    monkeypatch.setattr(upstream, "READ_HIGH_WATER_BYTES", 64 * 1024)
    nixl.add("p1", P)
    nixl.add("d1", D)
    server = router(nixl)
    n = 40_000  # ~7 MB of SSE events: more than the kernel's socket buffers hold
    payload = msgspec.json.encode({"model": "m", "prompt": "long", "max_tokens": n,
                                   "stream": True})
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", server.port))
        # HTTP/1.0: the body is not chunked and ends when the router closes.
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        received = [sock.recv(4096)]
        assert wait_until(lambda: bool(pauses), 10)  # the router stopped reading the engine
        while chunk := sock.recv(1 << 16):
            received.append(chunk)
    _, _, stream = b"".join(received).partition(b"\r\n\r\n")
    events = [e for e in stream.split(b"\n\n") if e.startswith(b"data: {")]
    text = "".join(msgspec.json.decode(e[6:])["choices"][0]["text"] for e in events)
    assert text == expected("long", n)


def test_connections_idle_past_keepalive_are_not_reused(nixl: Fleet,
                                                        router: RouterFixture) -> None:
    p = nixl.add("p1", P)
    nixl.add("d1", D)
    server = router(nixl)
    server.router.upstream().keepalive_s = 0.0  # every idle connection is too old at once
    c = client(server)
    for i in range(2):
        c.completions.create(model="m", prompt=str(i), max_tokens=1)
    assert len(p.connections) == 2


def test_models_nobody_serves_share_one_metrics_label(fleet: Fleet,
                                                      router: RouterFixture) -> None:
    server = router(fleet)
    for name in ("typo-1", "typo-2", "scan-3"):
        r = httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": "x"})
        assert r.status_code == 404
    text = httpx.get(server.url + "/metrics").text
    assert 'pdreg_router_requests_total{model="unknown",outcome="model_not_found"} 3.0' in text
    assert "typo-1" not in text


def test_session_policy_keeps_a_conversation_on_one_pair(nixl: Fleet,
                                                         router: RouterFixture) -> None:
    for i in range(3):
        nixl.add(f"p{i}", P)
        nixl.add(f"d{i}", D)
    server = router(nixl, policy="session")
    turns = 6
    for turn in range(turns):
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": "m", "prompt": f"turn {turn}", "max_tokens": 1},
                       headers={"X-Session-Id": "conversation-42"})
        assert r.status_code == 200
    picks = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
             if line.startswith("pdreg_router_picks_total{")]
    # One prefill and one decode took every turn, whatever the prompt.
    assert sorted(float(line.rsplit(" ", 1)[1]) for line in picks) == [turns, turns]


def test_a_member_gets_warm_connections_when_it_becomes_routable(
        nixl: Fleet, router: RouterFixture) -> None:
    """The pool holds idle connections to every routable member before any request, and
    to one that joins later, within moments of its joining."""
    nixl.add("p1", P)
    nixl.add("d1", D)
    server = router(nixl, warm_connections=3)
    pool = server.router.upstream()

    def idle_to(url: str) -> int:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return sum(c.usable for c in pool._idle.get((host, int(port)), ()))
    assert wait_until(lambda: all(idle_to(e.url) == 3 for e in nixl.engines.values()), 10)
    late = nixl.add("d2", D)
    assert wait_until(lambda: idle_to(late.url) == 3, 10)
    c = client(server)
    assert c.completions.create(model="m", prompt="x", max_tokens=2).choices[0].text


def test_default_bootstrap_rooms_are_distinct_and_in_range_across_batches() -> None:
    adapter = default_adapters()[Handshake.SGLANG]
    rooms = [adapter._rng.randrange(2**63) for _ in range(1500)]  # three urandom batches
    assert len(set(rooms)) == 1500 and all(0 <= room < 2**63 for room in rooms)


def test_a_client_hanging_up_right_after_done_keeps_the_decode_connection(
        nixl: Fleet, router: RouterFixture) -> None:
    """Many clients close as soon as they read [DONE], before the stream's end: the
    router still reads the decode's answer to its end and pools that connection."""
    nixl.add("p1", P)
    d = nixl.add("d1", D)
    d.faults.end_delay_s = 0.3  # the stream's end comes well after its [DONE]
    server = router(nixl, warm_connections=0)
    pool = server.router.upstream()
    body = msgspec.json.encode({"model": "m", "prompt": "bye", "max_tokens": 3, "stream": True})
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: [DONE]" not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    assert wait_until(lambda: sum(c.usable for c in pool._idle.get((host, int(port)), ())) == 1,
                      10)
    assert [t.is_closing() for t in d.connections.values()] == [False]
