"""Hostile clients against the router's own HTTP/1.1 server (serving/http_server.py), over
real sockets: a client that pipelines and never reads holds one answer's memory, error
answers quote little of the input, the head cap holds however the head arrives, many
pipelined requests are not a big head, and an oversized body gets its 413."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_http_server import Served, _read_answer

from pdreg.testing import wait_until
from serving import http_server
from serving.http_limits import HeadBudget
from serving.http_messages import MAX_ERROR_MESSAGE_CHARS, Request, Response
from serving.http_server import HttpApp, Limits
from serving.lifecycle import ServingThread

BIG = 1024 * 1024  # one answer of /big
SMALL_BUFFER = 16 * 1024


class Counting(Served):
    handled: int = 0


@pytest.fixture
def serve() -> Iterator[Any]:
    threads: list[ServingThread] = []

    def start(limits: Limits | None = None) -> Counting:
        served = Counting(0)
        app = HttpApp(limits=limits or Limits(), count=served.counted.append)

        async def big(request: Request) -> Response:
            served.handled += 1
            return Response(200, b"x" * BIG, content_type="application/octet-stream")

        async def small(request: Request) -> Response:
            served.handled += 1
            return Response(200, b"{}")

        async def sink(request: Request) -> Response:
            return Response(200, b"{}")
        app.add("GET", "/big", big)
        app.add("GET", "/small", small)
        app.add("POST", "/sink", sink)
        serving = ServingThread(app, "127.0.0.1", 0, name="test-http").start()
        threads.append(serving)
        served.port = serving.port
        return served
    yield start
    for serving in threads:
        serving.close()


def test_a_client_that_pipelines_and_never_reads_is_served_no_further(
        serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 pipelined requests for 1 MiB answers, none read: once the connection's write
    buffer is over its high-water mark the server answers no more and reads no more, so
    it holds a few answers, not 200 MiB. Read, every answer comes, in order."""
    paused: list[bool] = []
    pause = http_server.ClientConnection.pause_writing

    def record_pause(self: Any) -> None:
        paused.append(True)
        pause(self)
    monkeypatch.setattr(http_server.ClientConnection, "pause_writing", record_pause)
    served = serve()
    count = 200
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.connect(("127.0.0.1", served.port))
    with sock:
        requests = b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * count
        sender = threading.Thread(target=sock.sendall, args=(requests,), daemon=True)
        sender.start()
        assert wait_until(lambda: paused, 30)
        # Not reading: the server must not go on to answer the rest into its buffer.
        assert not wait_until(lambda: served.handled > 4, 1.0)
        sock.settimeout(30)
        f = sock.makefile("rb")
        for _ in range(count):
            status, _, body = _read_answer(f)
            assert status == 200 and len(body) == BIG
        sender.join(30)
    assert served.handled == count


def test_an_error_quotes_little_of_the_input(serve: Any) -> None:
    served = serve()
    path = "/" + "m" * 60_000
    answer = httpx.get(f"http://127.0.0.1:{served.port}{path}")
    assert answer.status_code == 404
    assert len(answer.json()["error"]["message"]) <= MAX_ERROR_MESSAGE_CHARS + 3
    assert len(answer.content) < 1024


def test_a_head_over_the_cap_in_one_read_is_431(serve: Any) -> None:
    served = serve()
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 900) for i in range(100))  # ~90 KB
    with served.connect() as sock:
        sock.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        assert _read_answer(sock.makefile("rb"))[0] == 431
    assert served.counted == ["head_too_large"] and served.handled == 0


def test_many_pipelined_requests_are_not_one_big_head(serve: Any) -> None:
    """5,000 small pipelined requests (~160 KB, many in each read) are 5,000 answers."""
    served = serve()
    count = 5000
    with served.connect() as sock:
        sender = threading.Thread(
            target=sock.sendall,
            args=(b"GET /small HTTP/1.1\r\nHost: x\r\nX-Pad: 0123456789\r\n\r\n" * count,),
            daemon=True)
        sender.start()
        f = sock.makefile("rb")
        statuses = [_read_answer(f)[0] for _ in range(count)]
        sender.join(30)
    assert statuses == [200] * count and served.counted == []


def test_a_body_over_the_cap_gets_its_413_not_a_reset(serve: Any) -> None:
    """17 MB with Content-Length: the server answers 413 at the head and drops what the
    client still sends, so the client finishes sending and reads the answer."""
    served = serve()
    answer = httpx.post(f"http://127.0.0.1:{served.port}/sink", content=b"a" * 17_000_000,
                        timeout=30)
    assert answer.status_code == 413
    assert json.loads(answer.content)["error"]["code"] == "body_too_large"
    assert served.counted == ["body_too_large"]


@pytest.mark.parametrize(("reads", "over"), [
    # (events of each read: ("parsed", n) a part handed over, "complete" a request ended,
    #  ("unfinished", n) the read of n bytes ended inside a head), whether it is refused
    ([[("parsed", 60), ("parsed", 40)]], False),
    ([[("parsed", 60), ("parsed", 41)]], True),  # one read, a whole head over 100
    ([[("unfinished", 101)]], True),  # one read, an unfinished head over 100
    ([[("unfinished", 60)], [("unfinished", 41)]], True),  # spanning reads
    # many pipelined requests before an unfinished head, all in one read: not its bytes
    ([["complete"] * 50 + [("unfinished", 5000)]], False),
    ([["complete", ("unfinished", 5000)], [("unfinished", 101)]], True),
])
def test_the_head_budget(reads: list[list[Any]], over: bool) -> None:
    budget = HeadBudget(100)
    refused = False
    for read in reads:
        budget.reading()
        for event in read:
            if event == "complete":
                budget.completed()
                budget.begin()
            elif event[0] == "parsed":
                refused |= budget.parsed(event[1])
            else:
                refused |= budget.unfinished(event[1])
    assert refused is over
