"""Bounded concurrency with a FIFO waiting queue, and the load figures it implies.

`running`, `waiting` and `kv_usage` mean what vLLM's `num_requests_running`,
`num_requests_waiting` and `kv_cache_usage_perc` mean: requests holding a compute slot,
requests queued for one, and KV tokens held / KV capacity in tokens (running sequences
plus KV held for peers to pull). Used only from the event loop thread: no locks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from wire.protocol import Load


class Scheduler:
    def __init__(self, max_running: int, kv_capacity_tokens: int) -> None:
        if max_running < 1:
            raise ValueError("--max-running must be at least 1")
        if kv_capacity_tokens < 1:
            raise ValueError("--kv-capacity-tokens must be at least 1")
        self.max_running = max_running
        self.kv_capacity_tokens = kv_capacity_tokens
        self.running = 0
        self.kv_tokens = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        # Engine figures beyond the three (Load.extra), e.g. the prefix cache's hit rate;
        # the engine sets it once it exists (registration starts before the model loads).
        self.figures: Callable[[], dict[str, float]] = dict

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_tokens / self.kv_capacity_tokens)

    def load(self) -> Load:
        return Load(running=self.running, waiting=self.waiting, kv_usage=self.kv_usage,
                    extra=self.figures())

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of `max_running` slots; wait in FIFO order when all are taken."""
        if self.running >= self.max_running or self._queue:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._queue.append(waiter)
            try:
                await waiter  # the releaser already counted us as running
            except BaseException:
                if waiter in self._queue:
                    self._queue.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._release()  # granted and cancelled at once: pass the slot on
                raise
        else:
            self.running += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        # Hand the slot straight to the next waiter, so `running` never dips in between.
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1

    def add_kv(self, tokens: int) -> None:
        self.kv_tokens += tokens

    def free_kv(self, tokens: int) -> None:
        self.kv_tokens = max(0, self.kv_tokens - tokens)
