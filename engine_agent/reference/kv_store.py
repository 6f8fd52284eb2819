"""Prefilled KV held for a decode engine to pull, each entry under a lease.

Keys are `h:<handle>` (vLLM-style: the prefill named the handle in its response) or
`r:<room>` (SGLang-style: the router named the room before either side started). A
decode may ask for a room before the prefill has produced it, so `take` can wait.
An entry leaves the store when it is taken (the transfer) or when its lease ends; either
way its tokens stop counting toward KV usage. Event-loop thread only: no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine_agent.reference.backend import TensorMeta
from engine_agent.reference.scheduler import Scheduler

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_MAX_S = 1.0


class KvUnavailable(Exception):
    """The KV asked for is not here (unknown, expired, failed, or never came)."""

    def __init__(self, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


@dataclass(slots=True)
class HeldKv:
    prompt_digest: str
    num_tokens: int
    metas: list[TensorMeta]
    buffers: list[Any]
    expires_at: float = 0.0  # time.monotonic()


@dataclass(slots=True)
class _Failure:
    reason: str
    expires_at: float


@dataclass(slots=True)
class KvStore:
    scheduler: Scheduler
    lease_s: float
    held: dict[str, HeldKv] = field(default_factory=dict)
    transferred_total: int = 0
    expired_total: int = 0
    _failures: dict[str, _Failure] = field(default_factory=dict)
    _waiters: dict[str, asyncio.Future[HeldKv]] = field(default_factory=dict)

    @property
    def held_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.held.values())

    def put(self, key: str, entry: HeldKv) -> None:
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            self.transferred_total += 1
            waiter.set_result(entry)  # a decode is already waiting: hand it over directly
            return
        old = self.held.pop(key, None)
        if old is not None:  # a router reused a room: the newer prefill wins
            logger.warning("[kv] replace key=%s", key)
            self.scheduler.free_kv(old.num_tokens)
        entry.expires_at = time.monotonic() + self.lease_s
        self.held[key] = entry
        self.scheduler.add_kv(entry.num_tokens)

    def fail(self, key: str, reason: str) -> None:
        """The prefill for `key` failed: a waiting (or later) decode learns why at once."""
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(KvUnavailable(f"prefill failed: {reason}"))
            return
        self._failures[key] = _Failure(reason, time.monotonic() + self.lease_s)

    async def take(self, key: str, wait_s: float) -> HeldKv:
        """Remove and return the entry; wait up to `wait_s` for it to appear."""
        entry = self.held.pop(key, None)
        if entry is not None:
            self.scheduler.free_kv(entry.num_tokens)
            self.transferred_total += 1
            return entry
        failure = self._failures.pop(key, None)
        if failure is not None:
            raise KvUnavailable(f"prefill failed: {failure.reason}")
        if wait_s <= 0:
            raise KvUnavailable(f"no KV held for {key!r} (unknown, expired or already taken)")
        if key in self._waiters:
            raise KvUnavailable(f"KV for {key!r} is already awaited by another decode")
        waiter: asyncio.Future[HeldKv] = asyncio.get_running_loop().create_future()
        self._waiters[key] = waiter
        try:
            return await asyncio.wait_for(waiter, wait_s)
        except TimeoutError:
            raise KvUnavailable(f"no prefill produced KV for {key!r} within {wait_s:.1f}s",
                                timed_out=True) from None
        finally:
            if self._waiters.get(key) is waiter:
                del self._waiters[key]

    def sweep(self, now: float | None = None) -> int:
        """Free every entry whose lease has ended; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [key for key, entry in self.held.items() if entry.expires_at <= now]
        for key in expired:
            entry = self.held.pop(key)
            self.scheduler.free_kv(entry.num_tokens)
            logger.info("[kv] expire key=%s tokens=%d (lease %.1fs, never pulled)",
                        key, entry.num_tokens, self.lease_s)
        self.expired_total += len(expired)
        for key in [k for k, f in self._failures.items() if f.expires_at <= now]:
            del self._failures[key]
        return len(expired)

    async def run_sweeper(self) -> None:
        interval_s = min(SWEEP_INTERVAL_MAX_S, self.lease_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()
