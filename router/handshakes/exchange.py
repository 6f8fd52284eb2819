"""The vocabulary every handshake shares: how a leg fails, and what a pair's handshake
hands back.

    LegFailure        a leg failed in a way another pair may not (connection error, 5xx,
                      an answer the handshake cannot use), naming the member at fault
    UpstreamRejected  a prefill answered 4xx: the client's request is at fault; relayed
    Exchange          the decode's answer (headers in), plus a leg still running beside it
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from router.http.bounds import UpstreamError
from router.http.response import UpstreamResponse
from router.table import Candidate

__all__ = ["Exchange", "LegFailure", "UpstreamRejected", "leg_failure"]


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
    still running); set by the handshake, read for latency-aware pairing and TTFT.
    `prefill_started`, `decode_started`: when each leg's request went out (monotonic).
    `prefill_cached_tokens`: the prompt tokens the prefill's engine says it found cached
    (None: it did not say).
    """

    response: UpstreamResponse
    companion: asyncio.Task[None] | None = None
    prefill_s: float | None = None
    prefill_started: float = 0.0
    decode_started: float = 0.0
    prefill_cached_tokens: int | None = None
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
