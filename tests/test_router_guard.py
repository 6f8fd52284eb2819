"""A router that cannot be turned against its network: every attack, over real sockets.

Who can attack: a client (any body, any header) and a registrant (any URL in its record).
What they must not get: traffic sent where --allow-upstream forbids (cloud metadata, by
default), handshake fields of their choosing on engine requests, a request loop, a
router stuck on an engine that never answers or answers without end, or an engine's
internal error text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from standins_engines import KV_REPLY, NIXL_REQUEST_PARAMS
from standins_fleet import Fleet, LoopThread, live_member

from registry.client import LiveMember
from router import relay
from router.config import Limits, Timeouts
from router.guard import LOOPBACK_ALLOW, UpstreamPolicy, strip_internal_fields
from router.relay import EventBuffer
from router.service import RouterConfig, RouterServer
from wire.protocol import Handshake, Role

P, D, X = Role.PREFILL, Role.DECODE, Role.MIXED
BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


def start_router(servers: list[RouterServer], fleet: Fleet, **config: Any) -> RouterServer:
    config.setdefault("allow_upstream", LOOPBACK_ALLOW)
    server = RouterServer(RouterConfig(port=0, **config), fleet.view).start()
    servers.append(server)
    return server


def metrics(server: RouterServer) -> str:
    return httpx.get(server.url + "/metrics").text


# --- engines that misbehave at the socket level ------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawEngine:
    """A TCP server on the test's loop that answers with whatever `handler` writes."""

    def __init__(self, loop_thread: LoopThread, handler: Handler) -> None:
        self.loop_thread = loop_thread
        self.tasks: set[asyncio.Task[None]] = set()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self.tasks.add(task)
            try:
                await _read_request(reader)
                await handler(reader, writer)
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()
                self.tasks.discard(task)

        async def start() -> asyncio.Server:
            return await asyncio.start_server(serve, "127.0.0.1", 0)
        self.server = loop_thread.run(start())
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.loop_thread.run(stop())


@pytest.fixture
def raw_engine(loop_thread: LoopThread) -> Iterator[Callable[[Handler], RawEngine]]:
    engines: list[RawEngine] = []

    def start(handler: Handler) -> RawEngine:
        engines.append(RawEngine(loop_thread, handler))
        return engines[-1]
    try:
        yield start
    finally:
        for engine in engines:
            engine.close()


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)


def mixed_fleet(loop_thread: LoopThread, *urls: str) -> Fleet:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.view.set({f"x{i}": live_member(f"x{i}", X, url) for i, url in enumerate(urls)})
    return fleet


# --- where traffic may go ------------------------------------------------------------------

@pytest.mark.parametrize(("allow", "address", "allowed"), [
    ("", "8.8.8.8", True),  # by default: public addresses only
    ("", "2001:4860::8888", True),
    ("", "127.0.0.1", False),  # a loopback-only service on the router's host
    ("", "::1", False),
    ("", "::ffff:127.0.0.1", False),
    ("", "10.1.2.3", False),  # private networks
    ("", "172.20.0.1", False),
    ("", "192.168.1.1", False),
    ("", "100.100.100.200", False),  # Alibaba Cloud metadata (CGNAT range)
    ("", "fd12::1", False),
    ("", "169.254.169.254", False),  # cloud metadata
    ("", "::ffff:169.254.169.254", False),  # the same, IPv4-mapped
    ("", "fe80::1", False),
    ("", "fd00:ec2::254", False),
    ("", "0.0.0.0", False),  # reaches the local host
    ("", "224.0.0.1", False),
    ("10.0.0.0/8", "10.9.9.9", True),  # names a denied range exactly: means it
    ("10.0.0.0/8", "192.168.1.1", False),
    ("10.0.0.0/8", "8.8.8.8", False),  # the only networks
    ("10.0.0.0/8", "169.254.169.254", False),
    (LOOPBACK_ALLOW, "127.0.0.1", True),
    (LOOPBACK_ALLOW, "::1", True),
    (LOOPBACK_ALLOW, "10.0.0.1", False),
    ("169.254.10.0/24", "169.254.10.7", True),  # more specific than the default deny
    ("169.254.10.0/24", "169.254.169.254", False),
    ("0.0.0.0/0", "169.254.169.254", False),  # less specific: the deny holds
    ("0.0.0.0/0", "127.0.0.1", False),
    ("", "not an address", False),
])
def test_upstream_policy(allow: str, address: str, allowed: bool) -> None:
    assert UpstreamPolicy.build(allow).allows(address) is allowed


def test_a_bad_cidr_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"10\.0\.0\.0/99"):
        UpstreamPolicy.build("10.0.0.0/8,10.0.0.0/99")


@pytest.mark.parametrize("url", ["http://169.254.169.254:80",
                                 "http://[::ffff:169.254.169.254]:80"])
def test_a_member_pointing_at_cloud_metadata_gets_nothing(
        loop_thread: LoopThread, routers: list[RouterServer], url: str) -> None:
    fleet = mixed_fleet(loop_thread, url)
    server = start_router(routers, fleet)
    started = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=BODY)
    # Refused before any connect (a connect there would take the 3 s timeout here).
    assert time.monotonic() - started < 1.0
    assert r.status_code == 502 and "169.254" not in r.text
    assert 'pdreg_router_quarantines_total{member="x0"} 1.0' in metrics(server)
    assert fleet.view.reports and fleet.view.reports[0][2] == "decode: forbidden"


def test_allow_upstream_is_checked_on_the_resolved_address(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    allowed = fleet.add("x1", X, host="127.0.0.2")
    named = fleet.add("x2", X)  # serves on 127.0.0.1, advertised as "localhost"
    members = dict(fleet.view.members())
    members["x2"] = live_member("x2", X, named.url.replace("127.0.0.1", "localhost"))
    fleet.view.set(members)
    server = start_router(routers, fleet, allow_upstream="127.0.0.2/32",
                          policy="round_robin")
    for _ in range(4):
        assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200
    assert len(allowed.requests) == 4 and named.requests == []  # localhost is 127.0.0.1
    assert 'pdreg_router_quarantines_total{member="x2"} 1.0' in metrics(server)


# --- what a client may set -----------------------------------------------------------------

SMUGGLED = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6",
                                   "remote_port": 1, "remote_engine_id": "evil",
                                   "remote_request_id": "x", "remote_block_ids": [0]},
            "bootstrap_host": "10.6.6.6", "bootstrap_port": 1, "bootstrap_room": 7,
            "bootstrap_pair_key": "x", "request_id": "victim-id", "rid": "victim-id"}


@pytest.mark.parametrize("protocol", [Handshake.VLLM_NIXL, Handshake.SGLANG])
def test_handshake_fields_from_a_client_never_reach_an_engine(
        loop_thread: LoopThread, routers: list[RouterServer], protocol: str) -> None:
    fleet = Fleet(loop_thread, protocol)
    p, d = fleet.add("p1", P), fleet.add("d1", D)
    server = start_router(routers, fleet)
    r = httpx.post(server.url + "/v1/completions", json={**BODY, **SMUGGLED})
    assert r.status_code == 200, r.text
    assert not p.rejections and not d.rejections
    (_, p_body, _), (_, d_body, _) = p.requests[0], d.requests[0]
    for body in (p_body, d_body):
        assert "request_id" not in body and "rid" not in body
        assert "bootstrap_pair_key" not in body
        assert body.get("bootstrap_host") != "10.6.6.6"
        assert body.get("bootstrap_room") != 7
    if protocol == Handshake.VLLM_NIXL:
        assert p_body["kv_transfer_params"] == NIXL_REQUEST_PARAMS
        assert d_body["kv_transfer_params"]["remote_engine_id"] != "evil"


def test_strip_internal_fields() -> None:
    body = {"model": "m", **SMUGGLED, "return_token_ids": True, "bootstrapper": 1}
    removed = strip_internal_fields(body)
    assert body == {"model": "m", "return_token_ids": True, "bootstrapper": 1}
    assert sorted(removed) == sorted(SMUGGLED)


# --- loops --------------------------------------------------------------------------------

@pytest.mark.parametrize("role", [D, P])
def test_a_member_whose_url_is_the_router_makes_no_loop(
        loop_thread: LoopThread, routers: list[RouterServer], role: Role) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D)
    server = start_router(routers, fleet)
    members = dict(fleet.view.members())
    member_id = "p1" if role is P else "d1"
    members[member_id] = live_member(member_id, role, server.url, kv_port=9)
    fleet.view.set(members)
    started = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=BODY)
    assert time.monotonic() - started < 5.0
    assert r.status_code == 502
    text = metrics(server)
    # Each looped request was refused at once, not forwarded again.
    assert 'outcome="ok"' not in text
    refused = httpx.post(server.url + "/v1/completions", json=BODY,
                         headers={"X-Pdreg-Hop": "1"})
    assert refused.status_code == 508
    assert refused.json()["error"]["code"] == "loop_detected"


# --- engines that hang or flood -------------------------------------------------------------

def test_an_engine_that_never_answers_is_given_up_on(
        loop_thread: LoopThread, routers: list[RouterServer],
        raw_engine: Callable[[Handler], RawEngine]) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)
    engine = raw_engine(silent)
    server = start_router(routers, mixed_fleet(loop_thread, engine.url),
                          upstream=Timeouts(first_byte_s=0.3))
    started = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 502 and time.monotonic() - started < 3.0
    assert "first byte timeout" in r.json()["error"]["message"]


def test_an_endless_answer_is_cut_at_the_byte_cap(
        loop_thread: LoopThread, routers: list[RouterServer],
        raw_engine: Callable[[Handler], RawEngine]) -> None:
    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000000\r\n\r\n")
        while True:
            writer.write(b"x" * 65536)
            await writer.drain()
    engine = raw_engine(flood)
    server = start_router(routers, mixed_fleet(loop_thread, engine.url))
    pool = server.router.upstream()
    pool.max_body_bytes = 1024 * 1024
    r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 502 and "too large" in r.json()["error"]["message"]


def test_an_endless_sse_event_is_cut_at_the_event_cap(
        loop_thread: LoopThread, routers: list[RouterServer],
        monkeypatch: pytest.MonkeyPatch,
        raw_engine: Callable[[Handler], RawEngine]) -> None:
    monkeypatch.setattr(relay, "MAX_EVENT_BYTES", 256 * 1024)

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        while True:  # one "data:" line that never ends
            writer.write(b"10000\r\n" + b"y" * 65536 + b"\r\n")
            await writer.drain()
    engine = raw_engine(flood)
    server = start_router(routers, mixed_fleet(loop_thread, engine.url))
    r = httpx.post(server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
    assert r.status_code == 502 and "too large" in r.json()["error"]["message"]


# --- what a client learns of an engine's errors ---------------------------------------------

SECRET = "Traceback at /srv/secret/engine.py, peer 10.7.7.7:5600"


def test_a_502_never_echoes_upstream_error_text(loop_thread: LoopThread,
                                                routers: list[RouterServer],
        raw_engine: Callable[[Handler], RawEngine]) -> None:
    async def crash(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = msgspec.json.encode({"error": {"message": SECRET}})
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
    engine = raw_engine(crash)
    server = start_router(routers, mixed_fleet(loop_thread, engine.url))
    r = httpx.post(server.url + "/v1/completions", json=BODY)
    assert r.status_code == 502
    assert "secret" not in r.text.lower() and "10.7.7.7" not in r.text
    assert r.json()["error"]["message"].endswith("(HTTP 500)")


def test_an_error_event_is_not_echoed_either(loop_thread: LoopThread,
                                             routers: list[RouterServer],
        raw_engine: Callable[[Handler], RawEngine]) -> None:
    async def fail_midstream(reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        events = (b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"a"}]}\n\n'
                  + b'data: {"error": {"message": "%s"}}\n\n' % SECRET.encode()
                  + b"data: [DONE]\n\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(events), events))
        await writer.drain()
    engine = raw_engine(fail_midstream)
    server = start_router(routers, mixed_fleet(loop_thread, engine.url))
    r = httpx.post(server.url + "/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200 and '"text":"a"' in r.text
    assert "error" in r.text and "secret" not in r.text.lower()


# --- where traffic may go, by default ---------------------------------------------------------

def test_by_default_a_member_on_loopback_gets_no_traffic(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    """An insider registers http://127.0.0.1:PORT, a loopback-only service: the router
    never connects to it unless --allow-upstream says so."""
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    secret = fleet.add("x0", X)  # stands for a service that trusts loopback callers
    server = start_router(routers, fleet, allow_upstream="")
    r = httpx.post(server.url + "/v1/completions", json=BODY)
    assert r.status_code == 502 and secret.requests == []
    assert 'pdreg_router_quarantines_total{member="x0"} 1.0' in metrics(server)
    allowed = start_router(routers, fleet, allow_upstream=LOOPBACK_ALLOW)
    assert httpx.post(allowed.url + "/v1/completions", json=BODY).status_code == 200
    assert len(secret.requests) == 1


# --- KV addresses ----------------------------------------------------------------------------

def _with_kv_host(member: LiveMember, kv_host: str) -> LiveMember:
    spec = member.record.spec
    spec = msgspec.structs.replace(
        spec, endpoints=msgspec.structs.replace(spec.endpoints, kv_host=kv_host))
    record = msgspec.structs.replace(member.record, spec=spec)
    return msgspec.structs.replace(member, record=record)


def test_a_prefill_cannot_send_the_decode_to_pull_from_elsewhere(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    """vLLM's decode pulls KV from the remote_host/remote_port in the prefill's answer: a
    rogue prefill writes a metadata address there. The decode gets the prefill's
    registered KV address instead, and the request is served."""
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    p, d = fleet.add("p1", P), fleet.add("d1", D)
    honest = p._check_vllm_nixl

    async def rogue(request: Any, body: dict[str, Any], prompt: tuple[int, ...]) -> Any:
        result = await honest(request, body, prompt)
        request[KV_REPLY].update(remote_host="169.254.169.254", remote_port=80)
        return result
    p._check_vllm_nixl = rogue  # type: ignore[method-assign]
    server = start_router(routers, fleet)
    r = httpx.post(server.url + "/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    params = d.requests[0][1]["kv_transfer_params"]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.kv_port)


@pytest.mark.parametrize("kv_host", ["2130706433", "0x7f000001", "0177.0.0.1", "127.1",
                                     "2852039166", "0xa9fea9fe", "169.254.169.254",
                                     "[::ffff:127.0.0.1]"])
@pytest.mark.parametrize("protocol", [Handshake.SGLANG, Handshake.VLLM_NIXL])
def test_a_kv_address_in_disguise_is_never_handed_to_an_engine(
        loop_thread: LoopThread, routers: list[RouterServer], protocol: str,
        kv_host: str) -> None:
    """glibc reads 2130706433, 0x7f000001 and 0177.0.0.1 as 127.0.0.1 (and 2852039166 as
    169.254.169.254): only canonical, allowed addresses pass. The honest prefill serves
    every request; the one registered with a disguised address gets none."""
    fleet = Fleet(loop_thread, protocol)
    bad, good, d = fleet.add("p0", P), fleet.add("p1", P), fleet.add("d1", D)
    members = dict(fleet.view.members())
    members["p0"] = _with_kv_host(members["p0"], kv_host)
    fleet.view.set(members)
    server = start_router(routers, fleet, policy="round_robin")
    for _ in range(4):
        r = httpx.post(server.url + "/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
    assert bad.requests == [] and len(good.requests) == 4
    hosts = {body.get("bootstrap_host") or body["kv_transfer_params"]["remote_host"]
             for _, body, _ in d.requests}
    assert hosts == {"127.0.0.1"}
    assert 'pdreg_router_quarantines_total{member="p0"} 1.0' in metrics(server)


# --- fields vLLM reads from nested places ------------------------------------------------------

def test_vllm_xargs_cannot_carry_handshake_fields(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    """vLLM copies vllm_xargs into the connector's view when the request has no
    kv_transfer_params of its own: stripped there too; the client's other extra args
    stay."""
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    p, d = fleet.add("p1", P), fleet.add("d1", D)
    server = start_router(routers, fleet)
    xargs = {"kv_transfer_params": SMUGGLED["kv_transfer_params"], "request_id": "victim",
             "bootstrap_host": "10.6.6.6", "my_logits_processor_arg": 3}
    r = httpx.post(server.url + "/v1/completions", json={**BODY, "vllm_xargs": xargs})
    assert r.status_code == 200, r.text
    for engine in (p, d):
        assert engine.requests[0][1]["vllm_xargs"] == {"my_logits_processor_arg": 3}
    assert d.requests[0][1]["kv_transfer_params"]["remote_engine_id"] != "evil"


# --- a rogue engine's stream -------------------------------------------------------------------

@pytest.mark.parametrize(("reads", "events"), [
    ([b"d"], []),  # one byte is not an event
    ([b"data: a\n\n"], [b"data: a\n\n"]),
    ([b"data: a\n", b"\ndata: b\n\n"], [b"data: a\n\n", b"data: b\n\n"]),
    ([b"data: a\n\nda", b"ta: b\n\n"], [b"data: a\n\n", b"data: b\n\n"]),
    ([b"\n", b"\n"], [b"\n\n"]),
])
def test_event_buffer_cuts_whole_events(reads: list[bytes], events: list[bytes]) -> None:
    buffer = EventBuffer()
    out = [piece for read in reads if (piece := buffer.push(read))]
    assert b"".join(out) == b"".join(events)


def test_event_buffer_scans_each_byte_a_bounded_number_of_times() -> None:
    """3 MB of one event, then a byte at a time: the work is linear in the bytes."""
    buffer = EventBuffer()
    total = 0
    assert buffer.push(b"data: " + b"x" * 3_000_000) == b""
    total += 3_000_006
    for _ in range(20_000):
        assert buffer.push(b"y") == b""
    total += 20_000
    out = buffer.push(b"\n")
    assert out == b""
    out = buffer.push(b"\ndata: next")  # the blank line cut in two is still found
    total += 12
    assert out.endswith(b"y\n\n") and len(out) == total - 10 and len(buffer) == 10
    assert buffer.scanned <= 2 * total


def test_a_stream_trickled_a_byte_at_a_time_still_arrives_whole(
        loop_thread: LoopThread, routers: list[RouterServer],
        raw_engine: Callable[[Handler], RawEngine]) -> None:
    big = b'data: {"id":"c","choices":[{"index":0,"text":"' + b"z" * 200_000 + b'"}]}'

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(big) - 100, big[:-100]))
        for byte in big[-100:] + b"\n\ndata: [DONE]\n\n":
            writer.write(b"1\r\n%c\r\n" % byte)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    engine = raw_engine(trickle)
    server = start_router(routers, mixed_fleet(loop_thread, engine.url))
    r = httpx.post(server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
    assert r.status_code == 200
    assert r.text.count("z") == 200_000 and r.text.endswith("data: [DONE]\n\n")


# --- slow and strange clients -------------------------------------------------------------------

def _open_trickling(url: str, count: int) -> list[Any]:
    import socket
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    socks = []
    for _ in range(count):
        sock = socket.create_connection((parts.hostname, parts.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
        socks.append(sock)
    return socks


def _closed_by_peer(sock: Any, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_slowloris_headers_are_cut_off_and_real_clients_served(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D)
    server = start_router(routers, fleet, clients=Limits(header_timeout_s=1.0))
    socks = _open_trickling(server.url, 200)
    try:
        for sock in socks[:50]:  # trickling keeps nothing alive
            sock.sendall(b"X-A: 1\r\n")
        r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 200
        assert all(_closed_by_peer(sock, 30.0) for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def test_a_body_that_never_arrives_gets_408(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = mixed_fleet(loop_thread)
    # A body timeout far shorter than the header timeout armed at connect: the 408 comes
    # at the body's deadline, within the client's 30 s, not at the header's hour.
    server = start_router(routers, fleet,
                          clients=Limits(body_timeout_s=1.0, header_timeout_s=3600.0))
    import socket
    from urllib.parse import urlsplit
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        sock.settimeout(30)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408")
    assert 'pdreg_router_refused_total{reason="body_timeout"} 1.0' in metrics(server)


def test_malformed_http_is_a_400_counted_and_the_router_serves_on(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    import socket
    from urllib.parse import urlsplit
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D)
    server = start_router(routers, fleet)
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(b"\x16\x03\x01\x02\x00 a TLS hello to a plain port\r\n\r\n")
        sock.settimeout(30)
        answer = b""
        while chunk := sock.recv(4096):  # the router closes it
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400")
    assert 'pdreg_router_refused_total{reason="malformed_http"} 1.0' in metrics(server)
    assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200


@pytest.mark.parametrize("depth", [1_000, 5_000, 100_000])
def test_deeply_nested_json_is_a_400_without_a_traceback(
        loop_thread: LoopThread, routers: list[RouterServer],
        caplog: pytest.LogCaptureFixture, depth: int) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D)
    server = start_router(routers, fleet)
    body = b'{"model":"m","prompt":' + b"[" * depth + b"]" * depth + b"}"
    with caplog.at_level("ERROR"):
        r = httpx.post(server.url + "/v1/completions", content=body,
                       headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.exc_info]
    assert 'pdreg_router_refused_total{reason="too_deep"} 1.0' in metrics(server)
    assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200
