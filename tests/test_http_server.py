"""The router's HTTP/1.1 server (serving/http_server.py) at its edges, over real sockets:
malformed and oversized requests, chunked bodies, pipelining, a client leaving
mid-stream, a client reading slower than the handler writes."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from pdreg.testing import wait_until
from serving import http_server
from serving.http_messages import Request, Response, StreamResponse
from serving.http_server import HttpApp, Limits
from serving.lifecycle import ServingThread

CHUNK = 64 * 1024
SMALL_BUFFER = 16 * 1024  # a socket buffer set explicitly (the kernel doubles it)
HELD_BACK_CHUNKS = 8  # 2 x 2 x SMALL_BUFFER + 64 KiB + one chunk, rounded up


@dataclass
class Served:
    port: int
    counted: list[str] = field(default_factory=list)  # the server's refusals, by reason
    written: int = 0  # chunks /stream has written
    finished: bool = False
    cancelled: bool = False

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)


def _app(served: Served, limits: Limits) -> HttpApp:
    app = HttpApp(limits=limits, count=served.counted.append)

    async def echo(request: Request) -> Response:
        return Response(200, json.dumps({"body": request.body.decode(),
                                         "query": request.query,
                                         "client": request.client}).encode())

    async def stream(request: Request) -> StreamResponse:
        chunks = int(request.query or 0)  # 0: for ever
        answer = StreamResponse(content_type="application/octet-stream")
        await answer.prepare(request)
        try:
            while chunks == 0 or served.written < chunks:
                await answer.write(b"x" * CHUNK)
                served.written += 1
                if chunks == 0:
                    await asyncio.sleep(0.01)
            await answer.write_eof()
            served.finished = True
        except asyncio.CancelledError:
            served.cancelled = True
            raise
        return answer

    app.add("POST", "/echo", echo)
    app.add("GET", "/stream", stream)
    return app


@pytest.fixture
def serve() -> Iterator[Any]:
    threads: list[ServingThread] = []

    def start(limits: Limits | None = None) -> Served:
        served = Served(0)
        serving = ServingThread(_app(served, limits or Limits()), "127.0.0.1", 0,
                                name="test-http").start()
        threads.append(serving)
        served.port = serving.port
        return served
    yield start
    for serving in threads:
        serving.close()


def _read_answer(f: Any) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer from a socket's file: status, headers, body."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, f.read(int(headers["content-length"]))
    body = b""
    while size := int(f.readline().strip(), 16):
        body += f.read(size)
        f.readline()
    f.readline()
    return status, headers, body


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def _post(body: bytes, query: str = "", extra: bytes = b"") -> bytes:
    return (f"POST /echo?{query} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            .encode() + extra + b"\r\n" + body)


def test_a_malformed_request_is_a_400_and_closes_only_its_connection(serve: Any) -> None:
    served = serve()
    with served.connect() as good, served.connect() as bad:
        good_file = good.makefile("rb")
        good.sendall(_post(b"one"))
        assert _read_answer(good_file)[0] == 200
        bad.sendall(b"GARBAGE\r\n\r\n")
        status, headers, body = _read_answer(bad.makefile("rb"))
        assert status == 400 and headers["connection"] == "close"
        assert "malformed" in json.loads(body)["error"]["message"]
        assert _closed(bad)
        good.sendall(_post(b"two"))  # the other connection, kept alive, still served
        assert json.loads(_read_answer(good_file)[2])["body"] == "two"
    assert served.counted == ["malformed_http"]


def test_oversized_headers_get_431(serve: Any) -> None:
    served = serve(Limits(max_head_bytes=4096))
    with served.connect() as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n")
        assert _read_answer(sock.makefile("rb"))[0] == 431
        assert _closed(sock)
    assert served.counted == ["head_too_large"]


def test_a_chunked_body_reaches_the_handler_whole(serve: Any) -> None:
    served = serve()
    with served.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n")
        sock.sendall(b"6\r\n world\r\n0\r\n\r\n")
        status, _, body = _read_answer(sock.makefile("rb"))
    assert status == 200 and json.loads(body)["body"] == "hello world"


def test_the_handler_knows_the_client_address(serve: Any) -> None:
    """What per-client limits key on (the `kv` policy's long prompts)."""
    served = serve()
    with served.connect() as sock:
        sock.sendall(_post(b"hi"))
        status, _, body = _read_answer(sock.makefile("rb"))
    assert status == 200 and json.loads(body)["client"] == "127.0.0.1"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_cap_is_413(serve: Any, chunked: bool) -> None:
    served = serve(Limits(max_body_bytes=1024))
    with served.connect() as sock:
        if chunked:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"800\r\n" + b"a" * 2048 + b"\r\n")
        else:
            sock.sendall(_post(b"a" * 2048))
        assert _read_answer(sock.makefile("rb"))[0] == 413
        assert _closed(sock)
    assert served.counted == ["body_too_large"]


def test_pipelined_requests_are_answered_in_order(serve: Any) -> None:
    served = serve()
    with served.connect() as sock:
        sock.sendall(b"".join(_post(str(i).encode(), f"n={i}") for i in range(5)))
        f = sock.makefile("rb")
        answers = [json.loads(_read_answer(f)[2]) for _ in range(5)]
    assert [a["body"] for a in answers] == ["0", "1", "2", "3", "4"]


def test_unknown_paths_and_methods(serve: Any) -> None:
    served = serve()
    url = f"http://127.0.0.1:{served.port}"
    assert httpx.get(url + "/nope").status_code == 404
    answer = httpx.get(url + "/echo")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"


def test_a_client_leaving_mid_stream_cancels_its_handler(serve: Any) -> None:
    served = serve()
    with served.connect() as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")  # endless
        with sock.makefile("rb") as f:  # the socket closes when its file does too
            assert f.readline().startswith(b"HTTP/1.1 200")
            assert wait_until(lambda: served.written >= 2, 10)
    assert wait_until(lambda: served.cancelled, 10)
    assert not served.finished
    url = f"http://127.0.0.1:{served.port}"
    assert httpx.post(url + "/echo", content=b"after").json()["body"] == "after"


def test_a_slow_reader_holds_the_writer_back(serve: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler waits for a client that does not read: the server holds back what it
    has not sent (the transport pauses it) instead of buffering the whole answer.

    Both sockets' kernel buffers are set explicitly (the client's receive buffer, the
    server's send buffer), so how far the handler gets before the pause depends on this
    test, not on the machine's TCP autotuning."""
    paused: list[bool] = []
    pause = http_server.ClientConnection.pause_writing
    made = http_server.ClientConnection.connection_made

    def record_pause(self: Any) -> None:
        paused.append(True)
        pause(self)

    def small_send_buffer(self: Any, transport: Any) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                      SMALL_BUFFER)
        made(self, transport)
    monkeypatch.setattr(http_server.ClientConnection, "pause_writing", record_pause)
    monkeypatch.setattr(http_server.ClientConnection, "connection_made", small_send_buffer)
    served = serve()
    chunks = 256  # 16 MiB
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.connect(("127.0.0.1", served.port))
    with sock:
        sock.sendall(f"GET /stream?{chunks} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        # Not reading: the server's socket backs up, the transport pauses the writer and
        # the handler waits in its write. What it wrote by then fits the two kernel
        # buffers (the kernel doubles each setting), the transport's high-water mark
        # (64 KiB) and the chunk in hand: a few chunks, nowhere near the whole answer.
        assert wait_until(lambda: paused, 30)
        assert served.written <= HELD_BACK_CHUNKS and not served.finished
        sock.settimeout(30)
        status, _, body = _read_answer(sock.makefile("rb"))
    assert status == 200 and len(body) == chunks * CHUNK
    assert served.finished


def test_an_http_10_stream_ends_with_the_connection(serve: Any) -> None:
    served = serve()
    with served.connect() as sock:
        sock.sendall(b"GET /stream?2 HTTP/1.0\r\n\r\n")
        with sock.makefile("rb") as f:
            head = f.readline()
            headers = []
            while (line := f.readline()) not in (b"\r\n", b""):
                headers.append(line.lower())
            body = f.read()  # to the close: no chunked framing on HTTP/1.0
    assert head.startswith(b"HTTP/1.1 200")
    assert b"connection: close\r\n" in headers
    assert not any(h.startswith(b"transfer-encoding") for h in headers)
    assert body == b"x" * (2 * CHUNK)
