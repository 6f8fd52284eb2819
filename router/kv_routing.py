"""Everything the `kv` policy adds to a router, behind one object the router calls at
three seams: membership changed (`on_members`), a request is admitted (`affinity`), a
pair was chosen (`picked`). Built only with `--policy kv`.

- `on_members`: follow the ready members that publish KV events (router/kv_feed.py) and
  note, per model, its tokenizer (`--tokenizer MODEL=PATH`, else what members register)
  and its block sizes.
- `affinity`: the prompt's exact token ids (the client's, else tokenized: off the event
  loop when long) and its block keys per block size -> a `KvAffinity`. A model or
  request we cannot match exactly gets the `prefix` policy's int key instead, counted in
  `pdreg_router_kv_inexact_requests{why}` and shown in `pdreg_router_kv_exact{model}`.
- `picked`: count routed and predicted-cached prompt tokens per model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from registry.client import LiveMember
from registry.kv_blocks import block_keys
from registry.protocol import MemberState, Role
from router.kv_feed import FeedMember, KvFeed
from router.kv_index import KvIndex
from router.kv_metrics import KvCollector
from router.kv_policy import KvAffinity, KvPairer, make_kv_pairer
from router.metrics import RouterMetrics
from router.policies import DEFAULT_STALE_LOAD_S, Affinity, prompt_key
from router.table import Pair
from router.tokenizer import PromptTokenizer, TokenizerSet, prompt_ids

__all__ = ["KvRouting"]

logger = logging.getLogger(__name__)

# Prompts longer than this (characters, or token ids) are tokenized and keyed in a worker
# thread: a 100k-token prompt takes milliseconds the event loop must not stall for.
OFF_LOOP_CHARS: Final = 8192


@dataclass(frozen=True, slots=True)
class ModelKv:
    tokenizer_source: str  # "" = none registered
    block_sizes: tuple[int, ...]  # as registered; empty: learnt from the events
    members: tuple[str, ...]  # its members that publish KV events


class KvRouting:
    def __init__(self, metrics: RouterMetrics, *, allows: Callable[[str], bool],
                 tokenizers: Mapping[str, str] | None = None,
                 disagg_min_uncached_tokens: int = 0,
                 stale_after_s: float = DEFAULT_STALE_LOAD_S,
                 tokenizer_set: TokenizerSet | None = None) -> None:
        self.metrics = metrics
        self.index = KvIndex()
        self.feed = KvFeed(self.index, allows=allows)
        self.pairer: KvPairer = make_kv_pairer(
            self.index, stale_after_s=stale_after_s,
            disagg_min_uncached_tokens=disagg_min_uncached_tokens)
        self.pairer.on_pick = self.picked
        self.tokenizers = tokenizer_set or TokenizerSet(tokenizers)
        self._models: dict[str, ModelKv] = {}
        metrics.registry.register(KvCollector(self.index, self.feed))

    def close(self) -> None:
        self.feed.close()

    # --- seams --------------------------------------------------------------------------

    def on_members(self, members: Mapping[str, LiveMember]) -> None:
        follow: list[FeedMember] = []
        sources: dict[str, str] = {}
        sizes: dict[str, set[int]] = {}
        ids: dict[str, list[str]] = {}
        for member in members.values():
            spec = member.record.spec
            if spec.role is Role.API_SERVER or spec.kv_events is None:
                continue  # decodes that publish are followed too (conditional disagg.)
            kv = spec.kv_events
            ids.setdefault(spec.model, []).append(spec.id)
            if kv.tokenizer:
                sources.setdefault(spec.model, kv.tokenizer)
            if kv.block_size:
                sizes.setdefault(spec.model, set()).add(kv.block_size)
            if member.record.state is MemberState.READY:
                follow.append(FeedMember(spec.id, spec.incarnation, kv))
        self._models = {m: ModelKv(sources.get(m, ""), tuple(sorted(sizes.get(m, ()))),
                                   tuple(member_ids)) for m, member_ids in ids.items()}
        self.feed.update(follow)

    async def affinity(self, body: Mapping[str, Any], model: str) -> Affinity:
        info = self._models.get(model)
        fallback = prompt_key("", body)
        if info is None:  # client-named models label metrics only when the fleet serves them
            return self._inexact("unknown", fallback, "no_block_size")
        block_sizes = info.block_sizes or self._learnt_block_sizes(info)
        if not block_sizes:
            return self._inexact(model, fallback, "no_block_size")
        tokenizer = self.tokenizers.get(model, info.tokenizer_source)
        started = time.perf_counter()
        try:
            if _long(body):
                loop = asyncio.get_running_loop()
                keyed = await loop.run_in_executor(None, _key, tokenizer, body, block_sizes)
            else:
                keyed = _key(tokenizer, body, block_sizes)
        except Exception:  # a tokenizer that fails on odd input must not fail the request
            logger.exception("[kv] tokenizing a %s prompt failed; approximate affinity", model)
            return self._inexact(model, fallback, "tokenizer_error")
        self.metrics.tokenize_seconds.labels(model).observe(time.perf_counter() - started)
        if keyed is None:
            return self._inexact(model, fallback,
                                 "no_tokenizer" if tokenizer is None else "not_tokenized")
        n, keys = keyed
        self.metrics.kv_exact.labels(model).set(1 if tokenizer is not None else 0)
        return KvAffinity(key=fallback, prompt_tokens=n, keys=keys)

    def picked(self, model: str, key: KvAffinity, pair: Pair) -> None:
        self.metrics.prompt_tokens.labels(model).inc(key.prompt_tokens)
        self.metrics.prompt_tokens_cached.labels(model).inc(self.pairer.cached_tokens_of(pair))

    def status(self, now_wall: float) -> list[dict[str, Any]]:
        """Per member: index state, blocks, event lag; for /kv and `pdreg status`."""
        out = []
        for member_id, index in sorted(self.index.members.items()):
            s = index.stats()
            out.append({"id": member_id, "incarnation": index.incarnation,
                        "state": s.state.value, "blocks": s.blocks, "next_seq": s.next_seq,
                        "lag_s": round(max(0.0, now_wall - s.last_batch_ts), 3)
                        if s.last_batch_ts else None,
                        "gaps": s.gaps, "replays": s.replays, "unknown": s.losses})
        return out

    def _learnt_block_sizes(self, info: ModelKv) -> tuple[int, ...]:
        """Block sizes the members' events showed (a spec that did not say)."""
        indexes = self.index.members
        return tuple(sorted({indexes[m].block_size for m in info.members
                             if m in indexes and indexes[m].block_size}))

    def _inexact(self, model: str, fallback: int, why: str) -> Affinity:
        self.metrics.kv_exact.labels(model).set(0)
        self.metrics.kv_inexact_requests.labels(model, why).inc()
        return Affinity(fallback)


def _long(body: Mapping[str, Any]) -> bool:
    prompt = body.get("prompt")
    if isinstance(prompt, str | list):
        return len(prompt) > OFF_LOOP_CHARS
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) \
            > OFF_LOOP_CHARS
    return False


def _key(tokenizer: PromptTokenizer | None, body: Mapping[str, Any],
         block_sizes: tuple[int, ...]) -> tuple[int, dict[int, list[int]]] | None:
    ids = prompt_ids(tokenizer, body)
    if ids is None:
        return None
    return len(ids), {size: block_keys(ids, size) for size in block_sizes}
