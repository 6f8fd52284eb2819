"""P/D handshakes, one per registered `protocol`: how a pair is driven for one request.

Each adapter turns (pair, path, body) into an `Exchange`: the decode worker's response
with its status and headers received, ready to be relayed to the client, and when the
prefill's part ended. Failures that a retry on another pair can fix raise `LegFailure`
naming the member at fault; a 4xx from a prefill (the client's own mistake) raises
`UpstreamRejected` to be relayed as is.

Contracts (each engine's documented request and response fields):
- vllm-nixl: P gets the body with max_tokens=1, stream=false and the request-side
  `kv_transfer_params`; P's response's top-level `kv_transfer_params` go to D, with
  the KV address (`remote_host`, `remote_port`) the prefill registered, not the one it
  wrote: a prefill's answer cannot send a decode to pull from elsewhere.
- sglang: the same body to P and D at once, plus bootstrap_host/port/room; the client
  gets D's response, P's is drained; either leg failing cancels both.
- vllm-p2p: the pair rides in `X-Request-Id`; P (max_tokens=1) first, then D.

Every KV address handed to an engine is checked by the pool (`kv_host_problem`): the
same --allow-upstream policy as HTTP traffic, canonical forms only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import struct
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import msgspec

from router.http.bounds import UpstreamError
from router.http.upstream import UpstreamPool, UpstreamResponse
from router.policies import Candidate, Pair
from wire.protocol import Handshake

__all__ = [
    "Adapter",
    "Adapters",
    "Exchange",
    "LegFailure",
    "UpstreamRejected",
    "adapter_for",
    "default_adapters",
    "leg_failure",
]

logger = logging.getLogger(__name__)

ERROR_BODY_CHARS: Final = 300  # how much of an upstream error body a log line keeps
ERROR_BODY_BYTES: Final = 64 * 1024  # how much of an upstream error body is read at all
REJECTION_BODY_BYTES: Final = 1024 * 1024  # a prefill's 4xx answer, relayed to the client
SGLANG_ROOM_LIMIT: Final = 2**63  # bootstrap_room is a random integer below this

# What vLLM's NixlConnector expects on the prefill request (request side of the handshake).
NIXL_PREFILL_PARAMS: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class LegFailure(Exception):
    """One leg failed in a way another pair may not: connection error, 5xx, bad reply.

    `kind`: "connect" (never reached the engine), "status" (it answered 5xx), "reply"
    (an answer the handshake cannot use), or an `UpstreamError` kind (reset, eof,
    first_byte_timeout, idle_timeout, too_large, forbidden...). `reason` is for logs
    only: it may hold engine text and addresses, which never go back to the client
    (`public` is what may). `quarantine`: whether the member itself is to blame (a
    decode's 5xx may be the prefill's fault, e.g. KV that could not be pulled, so it is
    retried, not quarantined).
    """

    def __init__(self, member: Candidate, role: str, reason: str, *, kind: str,
                 status: int = 0, quarantine: bool = True) -> None:
        super().__init__(f"{role} {member.id}: {reason}")
        self.member = member
        self.role = role
        self.reason = reason
        self.kind = kind
        self.status = status
        self.quarantine = quarantine

    @property
    def public(self) -> str:
        what = f"HTTP {self.status}" if self.status else self.kind.replace("_", " ")
        return f"the {self.role} failed ({what})"


def leg_failure(member: Candidate, role: str, exc: OSError, stage: str) -> LegFailure:
    """A LegFailure for an OSError met while connecting to or reading from `member`."""
    kind = str(exc.kind) if isinstance(exc, UpstreamError) else "connect"
    return LegFailure(member, role, f"{stage}: {type(exc).__name__}: {exc}", kind=kind)


class UpstreamRejected(Exception):
    """A prefill answered 4xx: the request itself is at fault; relay the answer."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream rejected the request with {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


@dataclass(slots=True)
class Exchange:
    """D's response (headers in) plus any leg still running beside it (SGLang's P).

    `prefill_s`: how long the prefill's part took (None: a mixed member, or SGLang's P
    still running); set by the adapter, read for latency-aware pairing and TTFT.
    `prefill_started`, `decode_started`: when each leg's request went out (monotonic).
    """

    response: UpstreamResponse
    companion: asyncio.Task[None] | None = None
    prefill_s: float | None = None
    prefill_started: float = 0.0
    decode_started: float = 0.0
    _closed: bool = field(default=False, repr=False)
    _reader: asyncio.Future[None] | None = field(default=None, repr=False)

    def companion_failure(self) -> LegFailure | None:
        task = self.companion
        if task is None or not task.done() or task.cancelled():
            return None
        exc = task.exception()
        return exc if isinstance(exc, LegFailure) else None

    async def finish(self, timeout_s: float) -> LegFailure | None:
        """After D is done: let the companion leg end (bounded), report its failure."""
        task = self.companion
        if task is not None and not task.done():
            # Only the timeout is quiet: a cancel (the client left) must reach the handler.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
        return self.companion_failure()

    def finish_later(self, reader: asyncio.Future[None]) -> None:
        """`reader` goes on reading D's answer to its end after this request is done:
        `close()` waits for it before pooling or dropping the connection."""
        self._reader = reader

    def close(self) -> None:
        """Give the connection back to the pool if D's answer was read to the end, else
        drop it (that is how an engine learns to stop generating); cancel the companion
        leg if still running. Safe twice."""
        if self._closed:
            return
        self._closed = True
        reader = self._reader
        if reader is not None and not reader.done():
            reader.add_done_callback(lambda _: self.response.release())
        else:
            self.response.release()  # closes instead when the body is not at its end
        if self.companion is not None and not self.companion.done():
            self.companion.cancel()


class Adapter(Protocol):
    name: str

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange: ...


Adapters = Mapping[str, Adapter]


# --- shared leg helpers -----------------------------------------------------------------


async def _post(pool: UpstreamPool, member: Candidate, role: str, path: str,
                payload: bytes, request_id: str, *,
                quarantine_on_5xx: bool = True) -> UpstreamResponse:
    """POST and wait for the status line. Connection errors and 5xx become LegFailure."""
    try:  # OSError covers refused, dropped (UpstreamError) and connect timeouts
        response = await pool.post(member.http, path, payload, request_id)
    except OSError as exc:
        raise leg_failure(member, role, exc, "post") from None
    if response.status >= 500:
        text = await _read_quietly(response)
        raise LegFailure(member, role, f"HTTP {response.status}: {text[:ERROR_BODY_CHARS]}",
                         kind="status", status=response.status, quarantine=quarantine_on_5xx)
    return response


async def _read_quietly(response: UpstreamResponse) -> str:
    try:
        return (await response.read(ERROR_BODY_BYTES)).decode(errors="replace")
    except OSError:
        return ""
    finally:
        response.release()


async def _read_all(response: UpstreamResponse, member: Candidate, role: str,
                    max_bytes: int | None = None) -> bytes:
    try:
        return await response.read(max_bytes)
    except OSError as exc:
        raise leg_failure(member, role, exc, "read") from None
    finally:
        response.release()


async def _reject_4xx(response: UpstreamResponse, member: Candidate, role: str) -> None:
    if response.status >= 400:
        body = await _read_all(response, member, role, REJECTION_BODY_BYTES)
        raise UpstreamRejected(response.status, body, response.content_type)


async def _prefill_json(pool: UpstreamPool, member: Candidate, path: str,
                        payload: bytes, request_id: str) -> Any:
    response = await _post(pool, member, "prefill", path, payload, request_id)
    await _reject_4xx(response, member, "prefill")
    raw = await _read_all(response, member, "prefill")
    try:
        return _decode(raw)
    except msgspec.DecodeError:
        raise LegFailure(member, "prefill", "response is not JSON", kind="reply") from None


async def _kv_endpoint(pool: UpstreamPool, member: Candidate, role: str = "prefill"
                       ) -> tuple[str, int, int]:
    """(host, kv_port, bootstrap_port) the member registered for its KV side, the host
    checked by the pool's policy. LegFailure (forbidden) if it may not be used."""
    endpoints = member.member.record.spec.endpoints if member.member else None
    host = (endpoints.kv_host if endpoints else "") or _http_host(member.http)
    problem = await pool.kv_host_problem(host)
    if problem is not None:
        raise LegFailure(member, role, problem, kind="forbidden")
    if endpoints is None:
        return host, 0, 0
    return host, endpoints.kv_port, endpoints.bootstrap_port


async def _kv_address(pool: UpstreamPool, member: Candidate, role: str) -> str:
    host, port, _ = await _kv_endpoint(pool, member, role)
    return f"{host}:{port}"


def _registered_kv_params(params: dict[str, Any], prefill: Candidate, host: str,
                          port: int) -> dict[str, Any]:
    """P's `kv_transfer_params` with the KV address P registered. vLLM's side channel
    is one port per data-parallel rank from the registered one up, so a reported port in
    that range is kept; any other is replaced."""
    if not port:
        raise LegFailure(prefill, "prefill", "no KV port registered (endpoints.kv_port)",
                         kind="reply")
    dp_size = prefill.member.record.spec.parallel.dp_size if prefill.member else 1
    reported = params.get("remote_port")
    in_range = (isinstance(reported, int) and not isinstance(reported, bool)
                and port <= reported < port + max(1, dp_size))
    return {**params, "remote_host": host, "remote_port": reported if in_range else port}


def _http_host(url: str) -> str:
    return urlsplit(url).hostname or ""


# --- adapters -----------------------------------------------------------------------------


class DirectAdapter:
    """A mixed member serving both phases: the request goes through unchanged."""

    name = "direct"

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        started = time.monotonic()
        return Exchange(await _post(pool, pair.decode, "decode", path, _encode(body),
                                    request_id), decode_started=started)


class VllmNixlAdapter:
    name = Handshake.VLLM_NIXL

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        prefill_body = dict(body)
        prefill_body["max_tokens"] = 1
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)  # vLLM refuses it when stream is false
        prefill_body["kv_transfer_params"] = NIXL_PREFILL_PARAMS
        # Checked before any work: a prefill whose KV address may not be used does none.
        kv_host, kv_port, _ = await _kv_endpoint(pool, pair.prefill)
        started = time.monotonic()
        reply = await _prefill_json(pool, pair.prefill, path, _encode(prefill_body),
                                    request_id)
        prefill_s = time.monotonic() - started
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not isinstance(params, dict):
            raise LegFailure(pair.prefill, "prefill",
                             "response has no kv_transfer_params (is a kv_producer "
                             "connector configured?)", kind="reply")
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = _registered_kv_params(params, pair.prefill,
                                                                  kv_host, kv_port)
        # The decode's 5xx may be the prefill's fault (KV gone): retry, quarantine neither.
        decode_started = time.monotonic()
        return Exchange(await _post(pool, pair.decode, "decode", path, _encode(decode_body),
                                    request_id, quarantine_on_5xx=False), prefill_s=prefill_s,
                        prefill_started=started, decode_started=decode_started)


class _UrandomRooms:
    """Unpredictable bootstrap rooms from the OS, one system call per 512 rooms
    (`random.SystemRandom` makes one per room: about 2 µs of every SGLang request)."""

    _BATCH_BYTES: Final = 4096

    def __init__(self) -> None:
        self._rooms: Iterator[tuple[int]] = iter(())

    def randrange(self, limit: int) -> int:
        room = next(self._rooms, None)
        if room is None:
            self._rooms = struct.iter_unpack("<Q", os.urandom(self._BATCH_BYTES))
            room = next(self._rooms)
        return room[0] % limit  # limit divides 2**64 (SGLANG_ROOM_LIMIT): no bias


class SglangAdapter:
    name = Handshake.SGLANG

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng: random.Random | _UrandomRooms = rng or _UrandomRooms()

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        bootstrap_host, _, bootstrap_port = await _kv_endpoint(pool, pair.prefill)
        both_body = dict(body)
        both_body["bootstrap_host"] = bootstrap_host
        both_body["bootstrap_port"] = bootstrap_port or None  # None: the engine's default
        both_body["bootstrap_room"] = self._rng.randrange(SGLANG_ROOM_LIMIT)
        payload = _encode(both_body)
        started = time.monotonic()
        prefill = asyncio.ensure_future(_drain_leg(pool, pair.prefill, path, payload,
                                                   request_id))
        # D's leg runs in this task (one task and no asyncio.wait per request): a prefill
        # that fails before D's headers are in cancels it, and the prefill's failure is
        # what this raises, so the request is retried on another pair.
        me = asyncio.current_task()
        decode_in = False

        def abort_decode(task: asyncio.Future[None]) -> None:
            if (not decode_in and me is not None and not task.cancelled()
                    and task.exception() is not None):
                me.cancel()
        prefill.add_done_callback(abort_decode)
        try:
            response = await _post(pool, pair.decode, "decode", path, payload, request_id,
                                   quarantine_on_5xx=False)
        except BaseException as exc:
            # Either leg failing (or the client leaving) abandons both.
            prefill.remove_done_callback(abort_decode)
            prefill.cancel()
            failure = (prefill.exception() if prefill.done() and not prefill.cancelled()
                       else None)
            if (isinstance(exc, asyncio.CancelledError) and failure is not None
                    and me is not None and me.uncancel() == 0):
                raise failure from None  # only the prefill's cancel: not the client's
            raise
        decode_in = True
        prefill.remove_done_callback(abort_decode)
        exchange = Exchange(response, companion=prefill, prefill_started=started,
                            decode_started=started)

        def prefill_done(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                return
            if task.exception() is not None:
                response.close()  # abort D's answer, so the client hears of it at once
            else:
                exchange.prefill_s = time.monotonic() - started
        if prefill.done():
            prefill_done(prefill)
        else:
            prefill.add_done_callback(prefill_done)
        return exchange


async def _drain_leg(pool: UpstreamPool, member: Candidate, path: str,
                     payload: bytes, request_id: str) -> None:
    response = await _post(pool, member, "prefill", path, payload, request_id)
    await _reject_4xx(response, member, "prefill")
    await _read_all(response, member, "prefill")


class VllmP2pAdapter:
    name = Handshake.VLLM_P2P

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        pair_id = (f"___prefill_addr_{await _kv_address(pool, pair.prefill, 'prefill')}"
                   f"___decode_addr_{await _kv_address(pool, pair.decode, 'decode')}_"
                   f"{uuid.uuid4().hex}")
        prefill_body = dict(body)
        prefill_body["max_tokens"] = 1
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        started = time.monotonic()
        response = await _post(pool, pair.prefill, "prefill", path, _encode(prefill_body),
                               pair_id)
        await _reject_4xx(response, pair.prefill, "prefill")
        await _read_all(response, pair.prefill, "prefill")
        decode_started = time.monotonic()
        prefill_s = decode_started - started
        return Exchange(await _post(pool, pair.decode, "decode", path, _encode(body),
                                    pair_id, quarantine_on_5xx=False), prefill_s=prefill_s,
                        prefill_started=started, decode_started=decode_started)


DIRECT: Final = DirectAdapter()


def default_adapters(rng: random.Random | None = None) -> dict[str, Adapter]:
    """One adapter per handshake this router speaks. `rng` seeds SGLang's bootstrap_room
    (tests pass a seeded one; by default the system's randomness)."""
    return {a.name: a for a in (VllmNixlAdapter(), SglangAdapter(rng), VllmP2pAdapter())}


def adapter_for(adapters: Adapters, pair: Pair) -> Adapter:
    """The handshake for a pair: direct for one mixed member, else the pair's protocol."""
    if pair.direct:
        return DIRECT
    adapter = adapters.get(pair.prefill.protocol)
    if adapter is None:  # the pairing table leaves such members out; this is a guard
        raise LegFailure(pair.prefill, "prefill", f"no adapter for protocol "
                         f"{pair.prefill.protocol!r}", kind="reply", quarantine=False)
    return adapter
