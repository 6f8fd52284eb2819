"""SGLang's handshake (`sglang`): the same body to P and D at once.

Both get bootstrap_host/port (the prefill's registered KV side) and a random
bootstrap_room; the client gets D's response, P's is drained; either leg failing
cancels both.
"""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time
from collections.abc import Iterator
from typing import Any, Final

import msgspec

from router.handshakes.exchange import Exchange
from router.handshakes.legs import (
    kv_endpoint,
    post_leg,
    read_all,
    reject_4xx,
    reported_cached_tokens_in,
)
from router.http.upstream import UpstreamPool
from router.table import Candidate, Pair
from wire.protocol import Handshake

__all__ = ["SGLANG_ROOM_LIMIT", "SglangHandshake"]

SGLANG_ROOM_LIMIT: Final = 2**63  # bootstrap_room is a random integer below this

_encode = msgspec.json.encode


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


class SglangHandshake:
    name = Handshake.SGLANG

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng: random.Random | _UrandomRooms = rng or _UrandomRooms()

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        bootstrap_host, _, bootstrap_port = await kv_endpoint(pool, pair.prefill)
        both_body = dict(body)
        both_body["bootstrap_host"] = bootstrap_host
        both_body["bootstrap_port"] = bootstrap_port or None  # None: the engine's default
        both_body["bootstrap_room"] = self._rng.randrange(SGLANG_ROOM_LIMIT)
        payload = _encode(both_body)
        started = time.monotonic()
        reported: list[int] = []  # the prompt tokens P says it found cached, if it says
        prefill = asyncio.ensure_future(_drain_leg(pool, pair.prefill, path, payload,
                                                   request_id, reported))
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
            response = await post_leg(pool, pair.decode, "decode", path, payload, request_id,
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
                exchange.prefill_cached_tokens = reported[0] if reported else None
        if prefill.done():
            prefill_done(prefill)
        else:
            prefill.add_done_callback(prefill_done)
        return exchange


async def _drain_leg(pool: UpstreamPool, member: Candidate, path: str,
                     payload: bytes, request_id: str, reported: list[int]) -> None:
    """P's leg, read to its end; the cached tokens its answer reports go in `reported`
    (a whole JSON answer only: a stream's usage is not looked for)."""
    response = await post_leg(pool, member, "prefill", path, payload, request_id)
    await reject_4xx(response, member, "prefill")
    cached = reported_cached_tokens_in(await read_all(response, member, "prefill"))
    if cached is not None:
        reported.append(cached)
