"""A test-owned KV event publisher over real ZeroMQ sockets: a PUB and a replay ROUTER
the test drives (which seqs go out, which are lost, whether replays are answered)."""

from __future__ import annotations

import zmq

from router.kv.keys import block_keys
from wire.kv_events import REPLAY_END, BlockStored, KVEventBatch, encode_batch, encode_seq
from wire.protocol import KvEventsSpec

BLOCK = 4


class FakeEngine:
    """PUB + replay ROUTER, driven by the test: `publish(seq, ...)` numbers as told."""

    def __init__(self, ctx: zmq.Context, replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        if self.router is not None:
            self.router.bind("tcp://127.0.0.1:0")
        self.buffer: dict[int, bytes] = {}
        self.answer_replays = True

    def spec(self) -> KvEventsSpec:
        replay = self.router.getsockopt(zmq.LAST_ENDPOINT).decode() if self.router else ""
        return KvEventsSpec(self.pub.getsockopt(zmq.LAST_ENDPOINT).decode(), replay,
                            block_size=BLOCK)

    def batch(self, seq: int, tokens: list[int], parent: int | None = None) -> bytes:
        keys = block_keys(tokens, BLOCK)
        payload = encode_batch(KVEventBatch(1.0, [BlockStored(
            [k + 1 for k in keys], parent, tokens, BLOCK, None, "GPU", None)]))
        self.buffer[seq] = payload
        return payload

    def publish(self, seq: int, tokens: list[int], *, lose: bool = False) -> None:
        payload = self.batch(seq, tokens)
        if not lose:
            self.pub.send_multipart([b"", encode_seq(seq), payload])

    def serve_replays(self, keep_from: int = 0) -> None:
        """Answer every waiting replay request from the buffer (seq >= keep_from)."""
        assert self.router is not None
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            if not self.answer_replays:
                continue
            first = int.from_bytes(start, "big")
            for seq in sorted(self.buffer):
                if seq >= max(first, keep_from):
                    self.router.send_multipart([client, b"", b"", encode_seq(seq),
                                                self.buffer[seq]])
            self.router.send_multipart([client, b"", b"", REPLAY_END, b""])

    def close(self) -> None:
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
