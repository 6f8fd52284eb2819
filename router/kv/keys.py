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

Exact where the engine is exact: vLLM's block hash also takes extra keys (the LoRA
adapter's name on every block, `cache_salt` on the first, multimodal hashes), so equal
tokens under another adapter or salt are another block. `BlockStored` says which
(`lora_name`/`lora_id`, per-block `extra_keys`; SGLang's `cache_salt`), and `block_salt`
turns that into the salt of each block's key; `request_keys` salts a request's blocks
the same way from its adapter and `cache_salt`, as vLLM would publish them
(wire/kv_events.vllm_extra_keys). A prompt with images cannot be keyed (the engine hashes
the pixels): it goes as `peak_ewma` chooses (router/kv/routing.py, why `multimodal`).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from wire.kv_events import vllm_extra_keys

__all__ = ["ROOT_KEY", "block_keys", "block_salt", "chain_key", "multimodal", "request_keys"]

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


def block_salt(lora: str | int | None, extra_keys: Any, cache_salt: str | None) -> bytes:
    """The salt of one stored block's key, from what its `BlockStored` says: the adapter
    (`lora_name`, else `lora_id`), the block's entry of `extra_keys`, and SGLang's
    `cache_salt`. b"" for a plain block."""
    if lora is None and extra_keys is None and cache_salt is None:
        return b""
    return _salt_encoder.encode((lora, extra_keys, cache_salt))


def request_keys(token_ids: Sequence[int], block_size: int, lora_name: str | None = None,
                 cache_salt: str | None = None) -> list[int]:
    """A request's block keys: `block_keys`, salted as the index salts the blocks a vLLM
    engine (or the reference engine) publishes for the same adapter and cache salt."""
    if lora_name is None and not cache_salt:
        return block_keys(token_ids, block_size)
    keys: list[int] = []
    parent = ROOT_KEY
    for i in range(len(token_ids) // block_size):
        salt = block_salt(lora_name, vllm_extra_keys(lora_name, cache_salt, i), None)
        parent = chain_key(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        keys.append(parent)
    return keys


def multimodal(body: Mapping[str, Any]) -> bool:
    """The request carries inputs other than text (images, audio, video, embeddings):
    the engine's block hashes take their hashes, which a router cannot compute."""
    if any(k in body for k in ("multi_modal_data", "prompt_embeds")):
        return True
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return True
    return False


_salt_encoder = msgspec.msgpack.Encoder()


def _le(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()
