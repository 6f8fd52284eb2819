"""The reference engine's prefix cache: full blocks of prompt KV, reused across requests.

Blocks are keyed by the content chain of kv_blocks.py (the same keys a router's index
uses), and the key doubles as the block hash the engine publishes. Pure: no
sockets, no clock; it answers lookups and returns the KV events each change makes, in
the order they happened, for the publisher.

Rules, as in vLLM's prefix caching:
- only full blocks are cached; a partial last block is recomputed every time;
- a hit never covers the whole prompt: the last token is always computed, because its
  logits start the generation (so at most (len - 1) // block_size blocks hit);
- least recently used blocks are evicted when the cache is over `capacity_blocks`;
  a lookup or a store makes a block the most recent;
- blocks are stored in prompt order, so a stored block's parent is held at that moment
  (the router's index relies on it); if the capacity cannot hold the chain, storing
  stops at the first block that would evict its own ancestors;
- a request's LoRA adapter and `cache_salt` (its `CacheScope`) are part of every block's
  key, as vLLM's block hash takes them as extra keys: the same tokens under another
  adapter or salt are other blocks. Events say so as vLLM's do (`lora_id`, `lora_name`,
  per-block `extra_keys`), so a router keys them the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from engine_agent.reference.kv_blocks import ROOT_KEY, block_keys, chain_key
from wire.kv_events import BlockRemoved, BlockStored, vllm_extra_keys

__all__ = ["PLAIN", "CacheScope", "Hit", "PrefixCache"]

MEDIUM = "GPU"  # what vLLM reports for its device tier; routers index only that tier
_salt_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class CacheScope:
    """What besides its tokens makes a request's blocks its own: the LoRA adapter it
    names (`lora_id` counts from 1, as vLLM's) and its `cache_salt`."""

    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None

    @property
    def plain(self) -> bool:
        return self.lora_name is None and not self.cache_salt

    def extra_keys(self, index: int) -> list[str] | None:
        """Block `index`'s extra keys, as vLLM publishes them."""
        return vllm_extra_keys(self.lora_name, self.cache_salt, index)

    def salt(self, index: int) -> bytes:
        """What block `index`'s key takes besides its tokens (b"" for a plain request)."""
        extra = self.extra_keys(index)
        return _salt_encoder.encode(extra) if extra is not None else b""


PLAIN = CacheScope()


@dataclass(frozen=True, slots=True)
class Hit:
    keys: list[int]  # every full block's key (all of them, cached or not)
    cached_blocks: int  # how many leading blocks are cached
    payloads: list[Any]  # the cached blocks' KV, in order (backend-specific)


@dataclass(slots=True)
class _Block:
    payload: Any  # the block's KV (torch: a (L, 2, H, block_size, Dh) tensor; sim: None)


class PrefixCache:
    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 0:
            raise ValueError("block_size must be >= 1 and capacity_blocks >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._blocks)

    def keys_of(self, prompt: Sequence[int], scope: CacheScope = PLAIN) -> list[int]:
        if scope.plain:
            return block_keys(prompt, self.block_size)
        size, parent, keys = self.block_size, ROOT_KEY, []
        for i in range(len(prompt) // size):
            parent = chain_key(parent, prompt[i * size:(i + 1) * size], scope.salt(i))
            keys.append(parent)
        return keys

    def lookup(self, prompt: Sequence[int], scope: CacheScope = PLAIN) -> Hit:
        """The prompt's leading cached blocks (touched: most recently used)."""
        keys = self.keys_of(prompt, scope)
        limit = max(0, (len(prompt) - 1) // self.block_size)
        payloads: list[Any] = []
        for key in keys[:limit]:
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            payloads.append(block.payload)
        return Hit(keys, len(payloads), payloads)

    def peek(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` are cached, touching nothing."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def store(self, prompt: Sequence[int], keys: Sequence[int],
              payload_of: Callable[[int], Any],
              scope: CacheScope = PLAIN) -> list[BlockStored | BlockRemoved]:
        """Cache every full block of `prompt` not yet held (`payload_of(i)` gives block
        i's KV; `keys` are `keys_of(prompt, scope)`). Returns the events, in order:
        evictions and stores as they happened."""
        events: list[BlockStored | BlockRemoved] = []
        run: list[int] = []  # indices of consecutive new blocks: one BlockStored
        protected = set(keys)  # this prompt's chain is never evicted to store itself
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
                self._flush(run, keys, prompt, events, scope)
                continue
            if not self._make_room(protected, run, keys, prompt, events, scope):
                break  # the chain does not fit: stop here (its parent stays held)
            self._blocks[key] = _Block(payload_of(i))
            run.append(i)
        self._flush(run, keys, prompt, events, scope)
        return events

    def clear(self) -> int:
        n = len(self._blocks)
        self._blocks.clear()
        return n

    def _make_room(self, protected: set[int], run: list[int], keys: Sequence[int],
                   prompt: Sequence[int], events: list[BlockStored | BlockRemoved],
                   scope: CacheScope) -> bool:
        while len(self._blocks) >= self.capacity_blocks:
            victim = next((k for k in self._blocks if k not in protected), None)
            if victim is None:
                return False
            self._flush(run, keys, prompt, events, scope)  # published order = the real order
            del self._blocks[victim]
            events.append(BlockRemoved([victim], MEDIUM))
        return True

    def _flush(self, run: list[int], keys: Sequence[int], prompt: Sequence[int],
               events: list[BlockStored | BlockRemoved], scope: CacheScope) -> None:
        if not run:
            return
        first, size = run[0], self.block_size
        parent = keys[first - 1] if first else None
        tokens = list(prompt[first * size:(run[-1] + 1) * size])
        extra = None if scope.plain else [scope.extra_keys(i) for i in run]
        events.append(BlockStored([keys[i] for i in run], parent, tokens, size, scope.lora_id,
                                  MEDIUM, scope.lora_name, extra_keys=extra))
        run.clear()
