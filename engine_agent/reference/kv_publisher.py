"""The reference engine's KV event publisher: vLLM's `ZmqEventPublisher` contract.

One IO thread owns a PUB socket (batches: `[topic, seq, payload]`, wire/kv_events.py)
and a ROUTER socket (replay: a DEALER sends `[b"", start_seq]`, gets every buffered
batch with seq >= start as `[b"", topic, seq, payload]`, then `[b"", b"", REPLAY_END, b""]`,
as vLLM 0.32 answers). The
engine's event loop hands batches over an inproc PUSH socket, so the thread sleeps in
`poll` until there is work: no timer, no idle CPU. seq counts from 0 per process, as in
vLLM, so a restarted engine is a new stream (routers see the new incarnation too).

Who can reach these ports sees the token ids of cached prompts (as with vLLM's, which
has no authentication either): bind them to loopback or a private network.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Final

import zmq

from wire.kv_events import (
    REPLAY_END,
    KVEvent,
    KVEventBatch,
    encode_batch,
    encode_seq,
)

__all__ = ["KvEventPublisher"]

logger = logging.getLogger(__name__)

BUFFER_STEPS: Final = 10_000  # batches kept for replay (vLLM's default)
PUB_HWM: Final = 100_000
_STOP: Final = b""


class KvEventPublisher:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, replay_port: int = 0, *,
                 topic: str = "", buffer_steps: int = BUFFER_STEPS) -> None:
        self.topic = topic.encode()
        self.replay_requests = self.bad_replay_requests = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(PUB_HWM)
        self._pub.bind(f"tcp://{host}:{port}")
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.bind(f"tcp://{host}:{replay_port}")
        self.port = _bound_port(self._pub)
        self.replay_port = _bound_port(self._replay)
        inproc = f"inproc://kv-events-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(inproc)
        self._push = self._ctx.socket(zmq.PUSH)  # used only by the publishing thread
        self._push.connect(inproc)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (one engine step's events); never blocks on subscribers."""
        if events and not self._closed:
            self._push.send(encode_batch(KVEventBatch(time.time(), list(events), 0)))

    def close(self) -> None:
        """Stop the thread and close the sockets; safe twice."""
        if self._closed:
            return
        self._closed = True
        self._push.send(_STOP)
        self._thread.join(timeout=5.0)
        self._push.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay in ready:
                    self._serve_replay()
                if self._pull in ready:
                    payload = self._pull.recv()
                    if payload == _STOP:
                        return
                    seq = next(self._seq)
                    self._pub.send_multipart((self.topic, encode_seq(seq), payload))
                    self._buffer.append((seq, payload))
        except Exception:  # an IO thread that dies must say so; the engine keeps serving
            logger.exception("[kv-events] publisher thread failed")
        finally:
            for sock in (self._pub, self._replay, self._pull):
                sock.close(linger=0)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_replay_requests += 1
            logger.warning("[kv-events] bad replay request (%d frames)", len(frames))
            return
        self.replay_requests += 1
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self.topic, encode_seq(seq),
                                             payload))
        self._replay.send_multipart((client, b"", b"", REPLAY_END, b""))


def _bound_port(sock: zmq.Socket) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return int(endpoint.rsplit(":", 1)[1])
