"""The router's block keys: a prompt block's identity by content, inside one router.

key_i = hash((key_{i-1}, tokens of block i as little-endian uint32 bytes[, salt])),
key_-1 = ROOT_KEY: two prompts share key_i exactly when they share their first (i+1) x
block_size tokens (and salt), as with the keys of engine_agent/reference/kv_blocks.py,
which the reference engine hashes its blocks with. The index (router/kv/index.py) keys
the blocks of every `BlockStored` this way, and the `kv` policy the prompts it routes;
both in the same process, so the keys never leave it and need not be stable across
processes.

Why not kv_blocks.py's BLAKE2b here: keying is the policy's main cost per request (a
2,000-token prompt is 125 blocks of 16), and Python's own hash of a (parent, bytes)
tuple costs about 40% of a BLAKE2b call (bench/RESULTS.md). It is SipHash over the
bytes, keyed per process (PYTHONHASHSEED), so a client cannot craft prompts whose
blocks collide with another's; 64 bits, as before. A router run with a fixed
PYTHONHASHSEED loses the keying, not correctness: a collision can only mislead a choice.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Final

__all__ = ["ROOT_KEY", "block_keys", "chain_key"]

ROOT_KEY: Final = 0  # the parent of a prompt's first block
_LITTLE: Final = array("I", [1]).tobytes() == b"\x01\x00\x00\x00"


def chain_key(parent: int, tokens: Sequence[int], salt: bytes = b"") -> int:
    """The key of a block holding `tokens` whose parent block has key `parent`. `salt`
    (LoRA, multimodal hashes, cache salt) makes otherwise equal blocks differ."""
    if salt:
        return hash((parent, _le(tokens), salt))
    return hash((parent, _le(tokens)))


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The keys of the full blocks of `token_ids` (a partial last block is never cached),
    the first one's parent being `parent`. Equal to chaining `chain_key` block by block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    data = _le(token_ids[:n * block_size])  # one conversion, then a slice per block
    width = 4 * block_size
    keys: list[int] = []
    append = keys.append
    for start in range(0, n * width, width):
        parent = hash((parent, data[start:start + width]))
        append(parent)
    return keys


def _le(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()
