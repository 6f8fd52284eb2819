"""Relaying one decode's SSE answer into the client's stream, and how the leg ended.

A client stream may be fed by several legs (a decode failed and the request migrated);
`ClientStream` is the client's side of it, prepared once, on the first event any leg
forwards. `relay_leg` forwards whole SSE events only (an error event never lands inside
a cut one), through the `TokenTap`, and returns a `LegEnd`: done, or the failure and its
reason. Writes to a departed client raise `ConnectionError` to the caller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from router.continuation import DONE_EVENT, EVENT_END, Reshaper, TokenTap
from router.handshakes.exchange import Exchange, LegFailure, leg_failure
from router.http.response import UpstreamResponse
from router.table import Candidate
from serving.http_messages import Request, StreamResponse

__all__ = ["ClientStream", "EventBuffer", "LegEnd", "relay_leg"]

# One SSE event larger than this (no blank line in sight) is not an engine's token.
MAX_EVENT_BYTES: Final = 4 * 1024 * 1024
# After data: [DONE], the answer's end (its last chunk) is read for this long, so the
# connection can be pooled; a silent engine past it just costs the connection.
TRAILER_WAIT_S: Final = 1.0
_SSE_HEADERS: Final = {"Cache-Control": "no-cache"}
_encode = msgspec.json.encode


class EventBuffer:
    """Whole SSE events out of a stream's reads, in time linear in its bytes.

    Bytes after the last complete event wait here. Each read is searched only where it
    landed (plus one byte before it, for a blank line cut in two), so an engine that
    trickles a huge event a byte at a time costs a constant per byte, never a re-scan
    of what is pending. `scanned` counts the bytes searched, for tests to check that.
    """

    __slots__ = ("_pending", "scanned")

    def __init__(self) -> None:
        self._pending = bytearray()
        self.scanned = 0

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, chunk: bytes) -> bytes:
        """The complete events now available (b"" if none)."""
        pending = self._pending
        if not pending:  # the common case: a read that starts at an event's start
            self.scanned += len(chunk)
            cut = chunk.rfind(EVENT_END)
            if cut >= 0 and cut + 2 == len(chunk):
                return chunk
            pending += chunk
            if cut < 0:
                return b""
        else:
            start = len(pending) - 1
            pending += chunk
            self.scanned += len(chunk) + 1
            cut = pending.rfind(EVENT_END, start)
            if cut < 0:
                return b""
        events = bytes(pending[:cut + 2])
        del pending[:cut + 2]
        return events


class ClientStream:
    """The client's SSE response: prepared on the first write, ended once."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.response: StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def write(self, data: bytes) -> None:
        if self.response is None:
            self.response = StreamResponse(headers=_SSE_HEADERS)
            await self.response.prepare(self.request)
        await self.response.write(data)

    async def end(self) -> None:
        if self.response is not None:
            await self.response.write_eof()

    async def fail(self, message: str) -> None:
        """An SSE error event, [DONE], and the end (today's answer to an unmigratable
        failure). The client may be gone too: then nothing happens."""
        event = {"error": {"message": message, "type": "upstream_error",
                           "code": "upstream_failed"}}
        try:
            await self.write(b"data: " + _encode(event) + EVENT_END + DONE_EVENT)
            await self.end()
        except (ConnectionError, RuntimeError):
            pass


@dataclass(slots=True)
class LegEnd:
    """How one decode leg ended. `failure` None = the stream is complete."""

    failure: LegFailure | None = None
    forwarded: bool = False  # this leg put at least one event into the client's stream
    first_read_at: float = 0.0
    last_read_at: float = 0.0
    reads: int = 0

    def per_read_s(self) -> float | None:
        """Mean gap between reads: the decode's time per token, as the router saw it."""
        if self.reads < 2:
            return None
        return (self.last_read_at - self.first_read_at) / (self.reads - 1)


async def relay_leg(exchange: Exchange, decode: Candidate, client: ClientStream,
                    tap: TokenTap, reshaper: Reshaper | None,
                    observe_gap: Callable[[float], Any],
                    on_first_read: Callable[[float], Any]) -> LegEnd:
    """Forward one decode's stream until it ends or fails."""
    upstream = exchange.response
    end = LegEnd()
    events_of = EventBuffer()
    while True:
        try:
            chunk = await upstream.readany()
        except OSError as exc:
            end.failure = exchange.companion_failure() or leg_failure(
                decode, "decode", exc, "stream")
            return end
        now = time.monotonic()
        if not chunk:
            if tap.finished:  # finished, only [DONE] missing: the stream is whole
                await client.write(DONE_EVENT)
                end.forwarded = True
                return end
            end.failure = LegFailure(decode, "decode", "the answer ended before data: "
                                     "[DONE]", kind="eof", quarantine=False)
            return end
        if end.reads:
            observe_gap(now - end.last_read_at)
        else:
            end.first_read_at = now
            on_first_read(now)
        end.reads += 1
        end.last_read_at = now
        events = events_of.push(chunk)
        if not events:
            if len(events_of) > MAX_EVENT_BYTES:
                end.failure = LegFailure(decode, "decode", f"an SSE event over "
                                         f"{MAX_EVENT_BYTES} bytes", kind="too_large")
                return end
            continue
        fed = tap.feed(events)
        data = fed.forward if reshaper is None else reshaper.reshape(fed.forward)
        if data:
            await client.write(data)
            end.forwarded = True
        if fed.error:
            # The engine failed this request (vLLM: an error event, then [DONE]). Not
            # necessarily the engine's fault: retried elsewhere, not quarantined.
            end.failure = LegFailure(decode, "decode", "error event mid-stream",
                                     kind="error_event", quarantine=False)
            return end
        if fed.done:
            _read_trailer(exchange)
            return end


_trailers: set[asyncio.Future[None]] = set()  # reads of answers' ends still going on


def _read_trailer(exchange: Exchange) -> None:
    """Read the answer to its end after [DONE] (bounded) so that its connection is
    pooled, beside the request rather than in it: the client gets the end of its stream
    at once, and a client that hangs up right after [DONE] (many do), cancelling this
    request's handler, does not cost the decode connection."""
    response = exchange.response
    if response.complete:  # the usual case: the end came with [DONE]
        return
    response.idle_timeout_s = TRAILER_WAIT_S
    trailer = asyncio.ensure_future(_drain(response))
    _trailers.add(trailer)
    trailer.add_done_callback(_trailers.discard)
    exchange.finish_later(trailer)


async def _drain(response: UpstreamResponse) -> None:
    try:
        while await response.readany():
            pass
    except OSError:
        pass  # the connection is closed instead of pooled; the client has its answer
