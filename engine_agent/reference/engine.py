"""One request's life in the reference engine, for each P/D handshake.

    plain           prefill here, decode here
    hold (P side)   prefill here, keep the KV for a decode to pull, return one token
                    vLLM: key = a fresh handle, named in the response's kv_transfer_params
                    SGLang: key = the router's bootstrap_room
    fetch (D side)  pull the prompt's KV from the prefill's KV server, then decode here

Admission, prefill and KV fetch happen in `Engine.start`, before any response byte is
sent, so their failures become proper HTTP errors. Decoding happens as the caller
iterates `Generation.tokens()`; `Generation.close()` releases the slot and KV.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_agent.reference.backend import Backend, SamplingParams, prompt_digest
from engine_agent.reference.bootstrap import RouteResolver
from engine_agent.reference.kv_store import HeldKv, KvStore
from engine_agent.reference.kv_transfer import KvClient, KvFetchError
from engine_agent.reference.prefix_cache import PLAIN, CacheScope, PrefixCache
from engine_agent.reference.scheduler import Scheduler
from engine_agent.reference.tokens import EOS_ID
from wire.figures import PREFIX_CACHE_HIT_RATE
from wire.kv_events import KVEvent

logger = logging.getLogger(__name__)

BLOCK_SIZE_TOKENS = 16  # only to shape vLLM-style remote_block_ids


class EngineError(Exception):
    """A request the engine cannot serve; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class HoldKv:
    """Prefill side: keep the KV under `key` (vLLM when `vllm_handle` is set, else a room)."""

    key: str
    vllm_handle: str = ""


@dataclass(frozen=True, slots=True)
class FetchKv:
    """Decode side: where the prompt's KV is. `bootstrap` set = resolve host/port first."""

    host: str
    port: int
    key: str
    engine_id: str = ""
    bootstrap: bool = False
    expected_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: list[int]
    params: SamplingParams
    hold: HoldKv | None = None
    fetch: FetchKv | None = None
    scope: CacheScope = PLAIN  # its LoRA adapter and cache salt: part of its block keys


class Generation:
    """A started request: iterate `tokens()`; always close().

    Like vLLM, the token that ends a generation is part of it: an EOS comes out with
    finish reason "stop" (and counts as a completion token), the last of `max_tokens`
    with "length".
    """

    def __init__(self, engine: Engine, request: GenerationRequest, stack: contextlib.AsyncExitStack,
                 first_logits: Any, sequence: Any,
                 kv_transfer_params: dict[str, Any] | None) -> None:
        self._engine = engine
        self._request = request
        self._stack = stack
        self._first_logits = first_logits
        self._sequence = sequence
        self.kv_transfer_params = kv_transfer_params
        # Prompt tokens the prefix cache already held (vLLM's usage
        # `prompt_tokens_details.cached_tokens`): routers check it against their index.
        self.cached_tokens = 0
        self.finish_reason = "length"
        self.completion_tokens = 0
        self._decoded_kv_tokens = 0  # KV positions added by decode steps, freed on close
        self._generated: list[int] = []  # every token sampled so far
        stack.callback(self._free_decoded_kv)
        if sequence is not None:  # runs first on close (LIFO), while the KV is held
            stack.callback(lambda: engine.keep_generated(request, sequence, self._generated))

    def _free_decoded_kv(self) -> None:
        self._engine.scheduler.free_kv(self._decoded_kv_tokens)
        self._decoded_kv_tokens = 0

    async def tokens(self) -> AsyncIterator[tuple[int, str | None]]:
        """(token, finish reason): None until the last token."""
        backend = self._engine.backend
        params = self._request.params
        sampler = backend.make_sampler(params)
        logits = self._first_logits
        limit = 1 if self._request.hold is not None else params.max_tokens
        token = -1
        for index in range(limit):
            if index > 0:
                logits = await backend.step(self._sequence, token)
                self._engine.scheduler.add_kv(1)
                self._decoded_kv_tokens += 1
            token = backend.sample(logits, params, sampler)
            self._generated.append(token)
            self.completion_tokens += 1
            if token == EOS_ID and not params.ignore_eos:
                self.finish_reason = "stop"
                yield token, "stop"
                return
            yield token, "length" if index == limit - 1 else None
        self.finish_reason = "length"

    async def close(self) -> None:
        """Release the slot and KV; safe twice."""
        await self._stack.aclose()


class Engine:
    def __init__(self, backend: Backend, scheduler: Scheduler, *, engine_id: str,
                 store: KvStore | None, kv_client: KvClient, resolver: RouteResolver,
                 kv_host: str = "", kv_port: int = 0, fetch_timeout_s: float = 30.0,
                 prefix_cache: PrefixCache | None = None,
                 publish: Callable[[Sequence[KVEvent]], None] | None = None) -> None:
        self.backend = backend
        self.scheduler = scheduler
        self.engine_id = engine_id
        self.store = store
        self.kv_client = kv_client
        self.resolver = resolver
        self.kv_host = kv_host
        self.kv_port = kv_port
        self.fetch_timeout_s = fetch_timeout_s
        self.active = 0  # admitted or queued requests not yet closed
        self.requests_total = 0
        self.external_kv_tokens_total = 0  # prompt tokens whose KV came from a prefill
        self.prefix_cache = prefix_cache  # None: every prefill computes the whole prompt
        self.publish = publish  # KV events out (kv_publisher), or None
        self.prompt_tokens_total = 0  # prompt tokens prefilled here
        self.prefix_cache_hit_tokens_total = 0  # of which the prefix cache already held
        self.pulled_tokens_total = 0  # prompt tokens whose KV was pulled from a prefill
        self.pulled_hit_tokens_total = 0  # of which this engine's prefix cache held already
        if prefix_cache is not None:
            scheduler.figures = self.cache_figures

    def cache_figures(self) -> dict[str, float]:
        """The prefix cache's hit rate so far (its own counters: prompt tokens found
        cached / prompt tokens prefilled), a load figure the registry shows; none before
        the first request. Read from the agent's thread: two ints, no lock needed."""
        prompt, hits = self.prompt_tokens_total, self.prefix_cache_hit_tokens_total
        return {PREFIX_CACHE_HIT_RATE: round(hits / prompt, 3)} if prompt else {}

    @property
    def in_flight(self) -> int:
        """What a drain waits for: requests here plus KV still waiting to be pulled."""
        return self.active + (len(self.store.held) if self.store is not None else 0)

    def _check(self, request: GenerationRequest) -> None:
        total = len(request.prompt) + request.params.max_tokens
        if total > self.backend.max_model_len:
            raise EngineError(f"prompt ({len(request.prompt)} tokens) + max_tokens "
                              f"({request.params.max_tokens}) exceeds the model's "
                              f"{self.backend.max_model_len}-token context")
        if request.hold is not None and self.store is None:
            raise EngineError("this engine is not a prefill engine: it cannot hold KV for "
                              "a remote decode (start it with --role prefill)")

    async def start(self, request: GenerationRequest) -> Generation:
        """Admit, then prefill (or fetch) the prompt. Raises EngineError with a status."""
        try:
            self._check(request)
        except EngineError as exc:
            if request.hold is not None and self.store is not None:
                self.store.fail(request.hold.key, str(exc))
            raise
        stack = contextlib.AsyncExitStack()
        self.active += 1
        self.requests_total += 1
        stack.callback(self._leave)
        try:
            await stack.enter_async_context(self.scheduler.slot())
            return await self._start_admitted(request, stack)
        except BaseException as exc:
            if request.hold is not None and self.store is not None:
                self.store.fail(request.hold.key, str(exc) or type(exc).__name__)
            await stack.aclose()
            raise

    def _leave(self) -> None:
        self.active -= 1

    async def _start_admitted(self, request: GenerationRequest,
                              stack: contextlib.AsyncExitStack) -> Generation:
        cached_tokens = 0
        if request.fetch is not None:
            prefilled = await self._fetch(request.prompt, request.fetch)
            self.external_kv_tokens_total += prefilled.num_tokens
            self._keep_pulled(request.prompt, prefilled, request.scope)
        else:
            prefilled, cached_tokens = await self._prefill(request.prompt, request.scope)
        if request.hold is not None:
            generation = self._hold(request, prefilled, stack)
        else:
            sequence = self.backend.start_sequence(prefilled, request.params.max_tokens)
            self.scheduler.add_kv(prefilled.num_tokens)
            stack.callback(self.scheduler.free_kv, prefilled.num_tokens)
            generation = Generation(self, request, stack, prefilled.logits, sequence, None)
        generation.cached_tokens = cached_tokens
        return generation

    async def _prefill(self, prompt: list[int], scope: CacheScope = PLAIN) -> tuple[Any, int]:
        """Prefill, computing only what the prefix cache does not hold; cache the new
        full blocks and publish what changed. Answers the prefill and the prompt tokens
        the cache held."""
        self.prompt_tokens_total += len(prompt)
        cache = self.prefix_cache
        if cache is None:
            return await self.backend.prefill(prompt), 0
        hit = cache.lookup(prompt, scope)
        cached_tokens = hit.cached_blocks * cache.block_size
        self.prefix_cache_hit_tokens_total += cached_tokens
        prefilled = await self.backend.prefill_cached(prompt, cached_tokens, hit.payloads)
        events = cache.store(prompt, hit.keys, lambda i: self.backend.block_payload(
            prefilled, i, cache.block_size), scope)
        if events and self.publish is not None:
            self.publish(events)
        return prefilled, cached_tokens

    def _keep_pulled(self, prompt: list[int], prefilled: Any, scope: CacheScope) -> None:
        """A decode keeps the prompt blocks it pulled in its prefix cache and publishes
        them, as vLLM's decode does: the next turn of the conversation finds them here,
        so a router may send it to this decode alone (conditional disaggregation). The
        lookup is counted as vLLM's decode scheduler counts it (`vllm:prefix_cache_*`):
        the prompt queried, the leading blocks held already. The whole prompt was pulled
        all the same (vLLM pulls only the rest; the reference transfer is all or none)."""
        cache = self.prefix_cache
        if cache is None:
            return
        hit = cache.lookup(prompt, scope)
        self.pulled_tokens_total += len(prompt)
        self.pulled_hit_tokens_total += hit.cached_blocks * cache.block_size
        events = cache.store(prompt, hit.keys, lambda i: self.backend.block_payload(
            prefilled, i, cache.block_size), scope)
        if events and self.publish is not None:
            self.publish(events)

    def keep_generated(self, request: GenerationRequest, sequence: Any,
                       generated: Sequence[int]) -> None:
        """Cache the full blocks the generation added (prompt + the tokens whose KV was
        computed: all but the last sampled) and publish them, as vLLM caches a block once
        its KV is computed, generated tokens' included: a chat's next turn repeats this
        answer, so the engine that wrote it (a decode under conditional disaggregation)
        computes only the new message."""
        cache = self.prefix_cache
        prompt = request.prompt
        with_kv = min(len(generated), sequence.length - len(prompt))
        if cache is None or (len(prompt) + with_kv) // cache.block_size <= \
                len(prompt) // cache.block_size:
            return  # no new full block
        tokens = [*prompt, *generated[:with_kv]]
        events = cache.store(tokens, cache.keys_of(tokens, request.scope),
                             lambda i: self.backend.sequence_block_payload(
                                 sequence, i, cache.block_size), request.scope)
        if events and self.publish is not None:
            self.publish(events)

    def _hold(self, request: GenerationRequest, prefilled: Any,
              stack: contextlib.AsyncExitStack) -> Generation:
        assert self.store is not None and request.hold is not None
        metas, buffers = self.backend.pack(prefilled)
        self.store.put(request.hold.key, HeldKv(
            prompt_digest=prompt_digest(request.prompt), num_tokens=prefilled.num_tokens,
            metas=metas, buffers=buffers))
        params = None
        if request.hold.vllm_handle:
            n = prefilled.num_tokens
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": request.hold.vllm_handle,
                "remote_host": self.kv_host,
                "remote_port": self.kv_port,
                "remote_block_ids": list(range(math.ceil(n / BLOCK_SIZE_TOKENS))),
                "remote_num_tokens": n,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "transfer_mode": "pull",
            }
        return Generation(self, request, stack, prefilled.logits, None, params)

    async def _fetch(self, prompt: list[int], source: FetchKv) -> Any:
        if source.expected_tokens is not None and source.expected_tokens != len(prompt):
            raise EngineError(f"kv_transfer_params.remote_num_tokens={source.expected_tokens}"
                              f" but this prompt has {len(prompt)} tokens")
        host, port, engine_id = source.host, source.port, source.engine_id
        if source.bootstrap:
            try:
                route = await self.resolver.resolve(host, port)
            except Exception as exc:
                raise EngineError(f"bootstrap server {host}:{port} unreachable: {exc}",
                                  status=502) from None
            host, port, engine_id = route.kv_host or host, route.kv_port, route.engine_id
        try:
            metas, buffers = await self.kv_client.fetch(
                host, port, key=source.key, engine_id=engine_id,
                prompt_digest=prompt_digest(prompt), num_tokens=len(prompt),
                # A vLLM handle exists once the prefill has answered: no waiting. A room
                # may be fetched before its prefill ran (both legs start at once).
                wait_s=self.fetch_timeout_s if source.bootstrap else 0.0)
        except KvFetchError as exc:
            if source.bootstrap:
                self.resolver.forget(source.host, source.port)
            raise EngineError(str(exc), status=exc.status) from None
        try:
            return self.backend.unpack(len(prompt), metas, buffers)
        except ValueError as exc:
            raise EngineError(f"KV from {host}:{port} does not fit this engine: {exc}",
                              status=502) from None


def new_handle() -> str:
    return uuid.uuid4().hex
