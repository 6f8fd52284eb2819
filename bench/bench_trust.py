"""What two hostile peers cost a router's memory, this tree against a baseline, side by side.

- `http`: a client pipelines requests and never reads the answers: 1 MB bodies whose
  404 quotes their 1 MB model name (as the router's `model_not_found` does), then
  requests for 1 MiB answers. The server (serving/http_server.py, in a child process
  of the tree under test) is measured by its resident memory once it stops growing.
- `kv`: a KV event publisher keeps a sequence gap open (its replay socket answers one
  empty batch per round) while it streams 1 MB batches behind the gap. A child process
  runs the tree's `KvFeed` following it; its resident memory is measured likewise.

    .venv/bin/python bench/bench_trust.py --baseline main

Each child prints `ready PORT` and runs until its stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parent.parent
CHILD = len(sys.argv) > 2 and sys.argv[1] == "--child"
if not CHILD:  # a child imports the tree under test (its PYTHONPATH), not this one
    sys.path.insert(0, str(REPO))
    from bench.procs import remove_tree, rss_bytes, source_tree
    from pdreg.testing import die_with_parent

MIB = 1024 * 1024
SETTLE_S = 1.5  # memory unchanged this long: the attack has done what it can
MAX_WAIT_S = 40.0


def _child(mode: str) -> None:
    """Run in the tree under test: a server (`http`) or a feed (`kv ENDPOINT REPLAY`)."""
    if mode == "http":
        from serving.http_messages import INVALID_REQUEST, Request, Response, openai_error
        from serving.http_server import HttpApp
        from serving.lifecycle import ServingThread

        async def generate(request: Request) -> Response:
            model = request.body[10:-2].decode()  # {"model":"...."}
            return openai_error(404, f"model {model!r} is not served", INVALID_REQUEST,
                                "model_not_found")

        async def big(request: Request) -> Response:
            return Response(200, b"x" * MIB)
        app = HttpApp()
        app.add("POST", "/v1/completions", generate)
        app.add("GET", "/big", big)
        serving = ServingThread(app, "127.0.0.1", 0, name="bench-http").start()
        print(f"ready {serving.port}", flush=True)
        sys.stdin.read()
        serving.close()
        return
    from router.kv.feed import FeedMember, KvFeed
    from router.kv.index import KvIndex
    from wire.protocol import KvEventsSpec
    feed = KvFeed(KvIndex(), replay_timeout_s=30.0)
    feed.update([FeedMember("p", 1, KvEventsSpec(sys.argv[3], sys.argv[4], block_size=4))])
    print("ready 0", flush=True)
    sys.stdin.read()
    feed.close()


def _start(tree: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args],
                            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            preexec_fn=die_with_parent)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().split()
    assert line and line[0] == "ready", line
    proc.port = int(line[1])  # type: ignore[attr-defined]
    return proc


def _settled_rss(pid: int) -> int:
    """The child's resident bytes once they stop growing (bounded)."""
    deadline = time.monotonic() + MAX_WAIT_S
    last, since = rss_bytes(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = rss_bytes(pid)
        if now > last + MIB:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > SETTLE_S:
            break
    return rss_bytes(pid)


def _http_attack(tree: str, requests: int) -> tuple[float, float]:
    """RSS growth (MiB) for unread 404 echoes, then for unread 1 MiB answers."""
    grown = []
    for request in (b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n'
                    % (MIB + 12) + b'{"model":"' + b"m" * MIB + b'"}',
                    b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n"):
        proc = _start(tree, "http")
        before = rss_bytes(proc.pid)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.connect(("127.0.0.1", proc.port))  # type: ignore[attr-defined]
        sender = threading.Thread(target=_send_quietly, args=(sock, request * requests),
                                  daemon=True)
        sender.start()
        grown.append((_settled_rss(proc.pid) - before) / MIB)
        sock.close()
        _stop(proc)
    return grown[0], grown[1]


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the bench closes it while the server holds off
        sock.sendall(data)


def _kv_attack(tree: str, batches: int) -> float:
    """RSS growth (MiB) of a feed while a publisher streams 1 MB batches behind a gap."""
    from wire.kv_events import REPLAY_END, BlockStored, KVEventBatch, encode_batch, encode_seq
    ctx = zmq.Context()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:0")
    replay.bind("tcp://127.0.0.1:0")
    endpoints = [s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in (pub, replay)]
    proc = _start(tree, "kv", *endpoints)
    empty = encode_batch(KVEventBatch(1.0, []))
    tokens = [70_000 + i % 1000 for i in range(150_000)]
    big = encode_batch(KVEventBatch(1.0, [BlockStored(
        list(range(10**6, 10**6 + len(tokens) // 4)), None, tokens, 4, None, "GPU", None)]))
    stop = threading.Event()

    def answer_replays() -> None:  # one empty batch per round: progress, the gap stays
        while not stop.is_set():
            if replay.poll(50):
                client, _, start = replay.recv_multipart()
                replay.send_multipart([client, b"", b"", start, empty])
                replay.send_multipart([client, b"", b"", REPLAY_END, b""])
    replier = threading.Thread(target=answer_replays, daemon=True)
    replier.start()
    time.sleep(1.0)  # the feed subscribes and asks its first replay
    before = rss_bytes(proc.pid)
    for k in range(batches):  # far ahead of anything the replays bring: a gap, held open
        pub.send_multipart([b"", encode_seq(1_000_000 + k), big])
    grown = (_settled_rss(proc.pid) - before) / MIB
    stop.set()
    replier.join()
    _stop(proc)
    pub.close(0)
    replay.close(0)
    ctx.term()
    return grown


def _stop(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(30)


def main() -> None:
    if CHILD:
        _child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="main", help="the commit to compare with")
    parser.add_argument("--requests", type=int, default=200, help="pipelined, unread")
    parser.add_argument("--batches", type=int, default=100, help="1 MB, behind a gap")
    args = parser.parse_args()
    base = source_tree(args.baseline)
    try:
        trees = {"this tree": os.getcwd(), f"baseline {args.baseline}": base}
        print(f"load average {os.getloadavg()[0]:.1f}")
        for name, tree in trees.items():
            echo, answers = _http_attack(tree, args.requests)
            kv = _kv_attack(tree, args.batches)
            print(f"{name}: http 404 echoes +{echo:.0f} MiB, unread 1 MiB answers "
                  f"+{answers:.0f} MiB; kv gap +{kv:.0f} MiB")
    finally:
        remove_tree(base)


if __name__ == "__main__":
    main()
