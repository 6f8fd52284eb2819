"""Moving prefilled KV from a prefill engine to a decode engine over ZeroMQ (pull).

The decode's DEALER asks the prefill's ROUTER for one key; the reply carries the tensors
as raw buffers, never pickled:

    request   frame 0: `FetchRequest` (msgpack)
    reply     frame 0: `FetchReply` (msgpack; `tensors` describes the frames that follow)
              frame 1..n: one raw buffer per tensor, sent zero-copy from the prefill's
              memory and read zero-copy into the decode's tensors

Replies are matched to requests by `id`, so one DEALER per peer carries many fetches.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from engine_agent.reference.backend import TensorMeta
from engine_agent.reference.kv_store import KvStore, KvUnavailable

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024  # fetch requests are small; refuse anything bigger unread
TRANSFER_MARGIN_S = 2.0  # beyond the prefill-side wait, for the bytes themselves


class FetchRequest(msgspec.Struct, frozen=True, array_like=True):
    id: int
    key: str  # "h:<handle>" or "r:<room>"
    engine_id: str  # the prefill engine the decode believes it is talking to; "" = any
    prompt_digest: str  # see backend.prompt_digest: refuse KV for another prompt
    num_tokens: int
    wait_s: float  # how long the prefill may wait for the key to appear (rooms)


class FetchReply(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    id: int
    ok: bool
    error: str = ""
    timed_out: bool = False
    tensors: list[TensorMeta] = []


class KvFetchError(Exception):
    """The KV could not be fetched. `status` is the HTTP status the decode should answer."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


_encoder = msgspec.msgpack.Encoder()


class KvServer:
    """The prefill side: serves `FetchRequest`s from its `KvStore` on a ROUTER socket."""

    def __init__(self, ctx: zmq.asyncio.Context, store: KvStore, engine_id: str,
                 host: str, port: int) -> None:
        self.store = store
        self.engine_id = engine_id
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.bind(f"tcp://{host}:{port}")
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._decoder = msgspec.msgpack.Decoder(FetchRequest)
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:
                logger.warning("[kv] drop malformed fetch: %d frames", len(frames))
                continue
            identity, header = frames
            try:
                request = self._decoder.decode(header)
            except msgspec.DecodeError as exc:
                logger.warning("[kv] drop undecodable fetch: %s", exc)
                continue
            # A room fetch may wait for its prefill, so each fetch runs as its own task.
            task = asyncio.create_task(self._answer(identity, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, identity: bytes, request: FetchRequest) -> None:
        if request.engine_id and request.engine_id != self.engine_id:
            await self._reply_error(identity, request, (
                f"remote_engine_id {request.engine_id!r} is not this engine "
                f"({self.engine_id!r}); the prefill restarted or the params are corrupt"))
            return
        try:
            entry = await self.store.take(request.key, request.wait_s)
        except KvUnavailable as exc:
            await self._reply_error(identity, request, str(exc), timed_out=exc.timed_out)
            return
        if (entry.prompt_digest, entry.num_tokens) != (request.prompt_digest,
                                                       request.num_tokens):
            await self._reply_error(identity, request, (
                f"KV for {request.key!r} holds {entry.num_tokens} tokens of another prompt; "
                f"the decode has {request.num_tokens} (freed; the request must be retried)"))
            return
        reply = FetchReply(id=request.id, ok=True, tensors=entry.metas)
        await self._socket.send_multipart([identity, _encoder.encode(reply), *entry.buffers],
                                          copy=False)

    async def _reply_error(self, identity: bytes, request: FetchRequest, error: str,
                           timed_out: bool = False) -> None:
        logger.info("[kv] refuse key=%s: %s", request.key, error)
        reply = FetchReply(id=request.id, ok=False, error=error, timed_out=timed_out)
        await self._socket.send_multipart([identity, _encoder.encode(reply)])

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._socket.close(linger=0)


@dataclass(slots=True)
class _Peer:
    socket: zmq.asyncio.Socket
    pending: dict[int, asyncio.Future[tuple[FetchReply, list[zmq.Frame]]]] = field(
        default_factory=dict)
    reader: asyncio.Task[None] | None = None


class KvClient:
    """The decode side: one DEALER per prefill KV server, many fetches in flight on each."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._ids = itertools.count(1)
        self._decoder = msgspec.msgpack.Decoder(FetchReply)

    def _peer(self, host: str, port: int) -> _Peer:
        peer = self._peers.get((host, port))
        if peer is None:
            socket = self._ctx.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://{host}:{port}")
            peer = _Peer(socket=socket)
            peer.reader = asyncio.create_task(self._read(peer))
            self._peers[(host, port)] = peer
        return peer

    async def _read(self, peer: _Peer) -> None:
        while True:
            frames = await peer.socket.recv_multipart(copy=False)
            try:
                reply = self._decoder.decode(frames[0].buffer)
            except msgspec.DecodeError as exc:
                logger.warning("[kv] drop undecodable reply: %s", exc)
                continue
            waiter = peer.pending.pop(reply.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result((reply, frames[1:]))

    async def fetch(self, host: str, port: int, *, key: str, engine_id: str,
                    prompt_digest: str, num_tokens: int,
                    wait_s: float) -> tuple[list[TensorMeta], list[memoryview]]:
        """Pull one key's tensors. Raises KvFetchError with the status to answer."""
        peer = self._peer(host, port)
        request = FetchRequest(id=next(self._ids), key=key, engine_id=engine_id,
                               prompt_digest=prompt_digest, num_tokens=num_tokens,
                               wait_s=wait_s)
        waiter: asyncio.Future[tuple[FetchReply, list[zmq.Frame]]] = (
            asyncio.get_running_loop().create_future())
        peer.pending[request.id] = waiter
        timeout_s = wait_s + TRANSFER_MARGIN_S
        try:
            await peer.socket.send(_encoder.encode(request))
            reply, frames = await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            # The peer is gone or wedged: drop its socket so queued fetches do not pile up.
            self._drop(host, port)
            raise KvFetchError(f"KV server {host}:{port} did not answer within {timeout_s:.1f}s"
                               " (prefill engine down?)", status=504) from None
        finally:
            peer.pending.pop(request.id, None)
        if not reply.ok:
            raise KvFetchError(f"prefill {host}:{port} refused KV {key!r}: {reply.error}",
                               status=504 if reply.timed_out else 502)
        if len(frames) != len(reply.tensors):
            raise KvFetchError(f"KV reply has {len(frames)} buffers for "
                               f"{len(reply.tensors)} tensors")
        return reply.tensors, [frame.buffer for frame in frames]

    def _drop(self, host: str, port: int) -> None:
        peer = self._peers.pop((host, port), None)
        if peer is None:
            return
        if peer.reader is not None:
            peer.reader.cancel()
        for waiter in peer.pending.values():
            if not waiter.done():
                waiter.set_exception(KvFetchError(f"KV server {host}:{port} dropped", 502))
        peer.socket.close(linger=0)

    def close(self) -> None:
        for host, port in list(self._peers):
            with contextlib.suppress(Exception):
                self._drop(host, port)
