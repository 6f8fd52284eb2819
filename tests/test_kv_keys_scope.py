"""Exact where the engine is exact: a request's LoRA adapter and cache salt are part of
its block keys, on the engine (the reference engine's prefix cache and the events it
publishes, shaped as vLLM's) and in the router (its request keys and its index of those
events), so the router claims a block only for a request the engine would hit it for."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from raw_member import member_spec
from test_kv_policy import publishing
from test_policies import view

from engine_agent.reference.prefix_cache import PLAIN, CacheScope, PrefixCache
from router.choice import NO_AFFINITY
from router.kv.index import MemberIndex
from router.kv.keys import block_keys, multimodal, request_keys
from router.kv.routing import KvOptions, KvRouting
from router.metrics import RouterMetrics
from wire.kv_events import BlockStored, KVEventBatch, decode_batch, encode_batch
from wire.protocol import Register, control_decoder, make_encoder
from wire.validation import validate_spec

BLOCK = 4
SCOPES = [PLAIN, CacheScope("sql-lora", 1), CacheScope("chat-lora", 2),
          CacheScope(cache_salt="tenant-a"), CacheScope(cache_salt="tenant-b"),
          CacheScope("sql-lora", 1, "tenant-a")]


def engine_then_router(prompt: list[int], stored: CacheScope) -> MemberIndex:
    """The reference engine caches `prompt` under `stored`; the router's index of one
    member reads the events it published, through the wire encoding."""
    cache = PrefixCache(BLOCK, 1000)
    events = cache.store(prompt, cache.keys_of(prompt, stored), lambda _: None, stored)
    index = MemberIndex("p", 1)
    index.start_sync()
    index.replay_done(complete=True)
    index.apply(0, decode_batch(encode_batch(KVEventBatch(0.0, events))))
    return index


@given(st.lists(st.integers(0, 300), min_size=BLOCK, max_size=8 * BLOCK),
       st.sampled_from(SCOPES), st.sampled_from(SCOPES))
def test_the_router_claims_a_block_only_under_the_engines_scope(
        prompt: list[int], stored: CacheScope, asked: CacheScope) -> None:
    index = engine_then_router(prompt, stored)
    keys = request_keys(prompt, BLOCK, asked.lora_name, asked.cache_salt)
    full = len(prompt) // BLOCK
    # The engine's own lookup: what a request in `asked` scope would hit there.
    engine = PrefixCache(BLOCK, 1000)
    engine.store(prompt, engine.keys_of(prompt, stored), lambda _: None, stored)
    engine_hits = engine.peek(engine.keys_of(prompt, asked))
    assert index.cached_blocks(keys) == engine_hits == (full if asked == stored else 0)


def test_scoped_keys_differ_from_plain_ones_and_from_each_other() -> None:
    prompt = list(range(4 * BLOCK))
    keyed = {(s.lora_name, s.cache_salt): request_keys(prompt, BLOCK, s.lora_name, s.cache_salt)
             for s in SCOPES}
    assert keyed[(None, None)] == block_keys(prompt, BLOCK)
    firsts = [keys[0] for keys in keyed.values()]
    assert len(set(firsts)) == len(SCOPES)  # every block differs, from the first on


def test_events_say_the_scope_as_vllm_does() -> None:
    """vLLM's BlockStored: `lora_id`, `lora_name`, and per block the extra keys its hash
    took (the adapter's name on every block, the salt on the first only)."""
    cache = PrefixCache(BLOCK, 1000)
    scope = CacheScope("sql-lora", 1, "tenant-a")
    prompt = list(range(3 * BLOCK))
    [event] = cache.store(prompt, cache.keys_of(prompt, scope), lambda _: None, scope)
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name) == (1, "sql-lora")
    assert event.extra_keys == [["sql-lora", "tenant-a"], ["sql-lora"], ["sql-lora"]]
    plain = PrefixCache(BLOCK, 1000)
    [event] = plain.store(prompt, plain.keys_of(prompt), lambda _: None)
    wire = msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, [event])))
    assert "extra_keys" not in wire[1][0]  # a plain block says nothing more than before


def test_requests_with_images_cannot_be_keyed() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = {"type": "text", "text": "What is in it?"}
    assert multimodal({"messages": [{"role": "user", "content": [text, image]}]})
    assert multimodal({"prompt": "x", "multi_modal_data": {}})
    assert not multimodal({"messages": [{"role": "user", "content": [text]}]})
    assert not multimodal({"messages": [{"role": "user", "content": "plain"}]})


SPEC = member_spec()


def test_adapters_travel_in_the_spec_and_old_members_are_unchanged() -> None:
    assert b"adapters" not in msgspec.msgpack.encode(SPEC)
    with_adapters = msgspec.structs.replace(SPEC, adapters=("sql-lora", "chat-lora"))
    assert validate_spec(with_adapters) is None
    register = Register(with_adapters, b"n" * 16)
    assert control_decoder().decode(make_encoder().encode(register)) == register


@pytest.mark.parametrize(("adapters", "why"), [
    (("tiny",), "base model"),  # its own model's name
    (("",), "printable"),
    (("bad\nname",), "printable"),
])
def test_bad_adapters_are_refused(adapters: tuple[str, ...], why: str) -> None:
    problem = validate_spec(msgspec.structs.replace(SPEC, adapters=adapters))
    assert problem is not None and why in problem


def test_too_many_adapters_do_not_decode() -> None:
    too_many = msgspec.structs.replace(SPEC, adapters=tuple(f"a{i}" for i in range(65)))
    with pytest.raises(msgspec.ValidationError):
        control_decoder().decode(make_encoder().encode(Register(too_many, b"n" * 16)))


def test_a_multimodal_request_falls_back_and_is_counted() -> None:
    """The engine hashes the image into its block keys, which the router cannot: the
    prefill is chosen as peak_ewma chooses it, and the metric says why."""
    metrics = RouterMetrics()
    kv = KvRouting(metrics, KvOptions(), allows=lambda a: True)
    try:
        kv.on_members(view(publishing("p")))
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        body = {"model": "m", "messages": [{"role": "user", "content": [image]}]}
        assert asyncio.run(kv.affinity(body, "m")) is NO_AFFINITY
        text = metrics.render().decode()
        assert 'pdreg_router_kv_inexact_requests_total{model="m",why="multimodal"} 1.0' in text
    finally:
        kv.close()
