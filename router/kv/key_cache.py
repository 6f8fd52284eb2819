"""A prompt's block keys, reusing the keys of the prefixes recent prompts shared.

Keying is the `kv` policy's main cost per request (router/kv/keys.py: one hash per
block, 125 blocks for a 2,000-token prompt in blocks of 16), and most prompts repeat a
prefix an earlier one keyed: a system prompt, a conversation's history. So the cache
holds the keys of fixed chunks of CHUNK_BLOCKS blocks, each under (block size, the key
of the block before it, the chunk's token ids as bytes); a prompt walks its chunks from
its first block and keys block by block only from the first chunk not held.

Exact, not approximate: a dict compares the whole (parent, bytes) on a hit, so a chunk
is reused only where the same tokens follow the same parent key, and the answer always
equals `block_keys(token_ids, block_size)` (tests/test_kv_key_cache.py checks it with
Hypothesis, evictions included). Looking a chunk up hashes its bytes in C, once: about
a tenth of keying its 16 blocks one by one in Python.

Memory is bounded (`max_bytes`, counted as the chunk's bytes plus its keys); the oldest
chunk goes first and a hit makes a chunk the newest, so a popular prefix stays. Any
thread may call `keys` (long prompts are keyed in worker threads): one lock, held for
dict operations only, not while keying.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from typing import Final

from router.kv.keys import ROOT_KEY, block_keys

__all__ = ["CHUNK_BLOCKS", "DEFAULT_MAX_BYTES", "PrefixKeyCache"]

CHUNK_BLOCKS: Final = 16  # 256 tokens at vLLM's GPU block size: a lookup per 256 tokens
DEFAULT_MAX_BYTES: Final = 32 * 1024 * 1024  # ~4M tokens of prefixes at 16-token blocks
_ENTRY_OVERHEAD_BYTES: Final = 200  # the dict slot, the tuples, the ints: roughly
_KEY_BYTES: Final = 36  # one key in the chunk's tuple: a pointer and a small int object

_Chunk = tuple[int, int, bytes]  # (block size, parent key, the chunk's tokens as bytes)


class PrefixKeyCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES,
                 chunk_blocks: int = CHUNK_BLOCKS) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        self.max_bytes = max_bytes
        self.chunk_blocks = chunk_blocks
        self._chunks: dict[_Chunk, tuple[int, ...]] = {}  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # chunks reused / keyed (a torn read is one off)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def keys(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """`block_keys(token_ids, block_size)`, from held chunks where it can."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        chunk_tokens = self.chunk_blocks * block_size
        whole = len(token_ids) // chunk_tokens  # chunks a prompt can share
        if not whole:
            return block_keys(token_ids, block_size)
        data = array("I", token_ids[:whole * chunk_tokens]).tobytes()  # any exact encoding
        width = 4 * chunk_tokens
        keys: list[int] = []
        parent = ROOT_KEY
        start = 0  # the first chunk not held
        chunks = self._chunks
        with self._lock:
            while start < whole:
                name = (block_size, parent, data[start * width:(start + 1) * width])
                held = chunks.pop(name, None)
                if held is None:
                    break
                chunks[name] = held  # the newest now
                keys += held
                parent = held[-1]
                start += 1
        self.hits += start
        rest = block_keys(token_ids[start * chunk_tokens:], block_size, parent)
        if start < whole:
            self._add(data, block_size, start, whole, parent, rest)
        keys += rest
        return keys

    def _add(self, data: bytes, block_size: int, start: int, whole: int, parent: int,
             rest: list[int]) -> None:
        """Hold the chunks `start`..`whole`-1 just keyed (their keys lead `rest`)."""
        width = 4 * self.chunk_blocks * block_size
        per_chunk = width + self.chunk_blocks * _KEY_BYTES + _ENTRY_OVERHEAD_BYTES
        n = self.chunk_blocks
        self.misses += whole - start
        with self._lock:
            for i in range(start, whole):
                own = tuple(rest[(i - start) * n:(i - start + 1) * n])
                name = (block_size, parent, data[i * width:(i + 1) * width])
                if name not in self._chunks:
                    self._bytes += per_chunk
                self._chunks[name] = own
                parent = own[-1]
            while self._bytes > self.max_bytes and self._chunks:
                oldest = next(iter(self._chunks))
                del self._chunks[oldest]
                self._bytes -= len(oldest[2]) + self.chunk_blocks * _KEY_BYTES \
                    + _ENTRY_OVERHEAD_BYTES
