"""Block keys by token content, stable across processes: the reference engine's block hashes,
and what the real-engine checks compare stored blocks with. A router keys its own index the
same way by content, with a cheaper process-local hash (router/kv/keys.py).

A prompt's full blocks (`block_size` tokens each; a partial last block is never cached)
get chained keys: key_i = H(key_{i-1}, tokens of block i), key_{-1} = ROOT_KEY. Two
prompts share key_i exactly when they share their first (i+1) x block_size tokens.

Why our own key and not the engine's hash: vLLM's block hash is
`hash_fn((parent, tuple(tokens), extra_keys))` where `hash_fn` is chosen by
`--prefix-caching-hash-algo` (SHA-256 over a *pickle* by default, CBOR, or xxhash), the
root is `hash_fn(seed)` with the seed from PYTHONHASHSEED or random per process for
xxhash, and events may carry the low 64 bits only. Reproducing it bit for bit means
reproducing Python's pickle and guessing flags and seeds per engine (and SGLang has its
own). But every `BlockStored` carries the blocks' `token_ids` and parent hash, so a
consumer keys its index by content and maps the engine's hashes to its keys (for
`BlockRemoved`); it then needs only the prompt's token ids and the block size, whatever
the engine hashes with. The reference engine uses these keys as its own block hashes.

H is BLAKE2b (64-bit digest) over the parent key and the tokens as little-endian uint32:
stable across processes and languages, and 64 bits keep collisions out of reach for any
index a router holds (2^32 blocks before a 50% chance of one collision somewhere).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Final

__all__ = ["ROOT_KEY", "block_keys", "chain_key"]

ROOT_KEY: Final = 0  # the parent of a prompt's first block
_U64: Final = struct.Struct("<Q")


def chain_key(parent: int, tokens: Sequence[int], salt: bytes = b"") -> int:
    """The key of a block holding `tokens` whose parent block has key `parent`. `salt`
    (LoRA name, cache salt, multimodal hashes) makes otherwise equal blocks differ."""
    data = _U64.pack(parent) + _le(tokens)
    if salt:
        data += b"\xff" + salt
    return int.from_bytes(_blake2b(data, digest_size=8, person=_PERSON).digest(), "little")


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY,
               limit: int | None = None) -> list[int]:
    """The keys of the full blocks of `token_ids` (at most `limit` of them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    # One conversion of the whole prompt, then one BLAKE2b call per block over the
    # parent's 8 bytes + a slice of it: the same keys as chain_key, at about half the
    # cost (no per-block array, struct object or hasher updates).
    data = _le(token_ids[:n * block_size])
    width = 4 * block_size
    pack, blake2b, from_bytes = _U64.pack, _blake2b, int.from_bytes
    keys: list[int] = []
    for start in range(0, n * width, width):
        parent = from_bytes(blake2b(pack(parent) + data[start:start + width], digest_size=8,
                                    person=_PERSON).digest(), "little")
        keys.append(parent)
    return keys


_LITTLE: Final = array("I", [1]).tobytes() == b"\x01\x00\x00\x00"
_PERSON: Final = b"pdreg-kv"
_blake2b = hashlib.blake2b


def _le(tokens: Sequence[int]) -> bytes:
    """The tokens as little-endian uint32."""
    a = array("I", tokens)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()
