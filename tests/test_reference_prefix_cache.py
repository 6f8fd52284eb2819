"""The reference engine's prefix cache: hits skip compute (identically), LRU within
capacity, and the KV events it publishes (real ZeroMQ sockets) rebuild it exactly."""

from __future__ import annotations

import asyncio
import json
import random
import warnings

import httpx
import msgspec
import pytest
import zmq
from reference_helpers import HTTP_TIMEOUT_S, metrics, start_engine

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from engine_agent.reference.kv_blocks import block_keys  # noqa: E402
from engine_agent.reference.kv_publisher import KvEventPublisher  # noqa: E402
from engine_agent.reference.prefix_cache import PrefixCache  # noqa: E402
from engine_agent.reference.sim import SimBackend  # noqa: E402
from engine_agent.reference.tokens import encode  # noqa: E402
from engine_agent.reference.torch_backend import TorchBackend  # noqa: E402
from router.kv.index import IndexState, MemberIndex  # noqa: E402
from router.kv.keys import block_keys as router_keys  # noqa: E402
from wire.kv_events import (  # noqa: E402
    REPLAY_END,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
)

RECV_TIMEOUT_MS = 10_000


def test_hits_stop_before_the_last_token_and_lru_evicts():
    cache = PrefixCache(block_size=4, capacity_blocks=3)
    prompt = list(range(12))  # three full blocks
    hit = cache.lookup(prompt)
    assert hit.cached_blocks == 0 and len(hit.keys) == 3
    (stored,) = cache.store(prompt, hit.keys, lambda i: i)
    assert stored.block_hashes == hit.keys and stored.parent_block_hash is None
    assert stored.token_ids == prompt
    assert cache.lookup(prompt).cached_blocks == 2  # the last token is always computed
    assert cache.lookup([*prompt, 99]).cached_blocks == 3
    other = [7] * 8
    events = cache.store(other, cache.keys_of(other), lambda i: i)
    # Each new block evicts the least recently used one first, in the order it happened.
    assert [type(e) for e in events] == [BlockRemoved, BlockStored, BlockRemoved, BlockStored]
    assert events[0].block_hashes == [stored.block_hashes[0]]
    assert len(cache) == 3


def test_published_events_rebuild_the_cache_in_a_router_index():
    """Random traffic through a small cache: the index fed its events holds exactly the
    cache's blocks, and answers lookups as the cache does."""
    rng = random.Random(7)
    cache = PrefixCache(block_size=4, capacity_blocks=20)
    index = MemberIndex("p", 1)
    index.start_sync()
    index.replay_done(complete=True)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    for seq in range(300):
        prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 9))]
        hit = cache.lookup(prompt)
        events = cache.store(prompt, hit.keys, lambda i: None)
        index.apply(seq, KVEventBatch(0.0, events, 0))
        assert index.state is IndexState.LIVE
        assert set(index.blocks) == set(cache._blocks)
        probe = rng.choice(prefixes) + [0] * 4
        assert index.cached_blocks(router_keys(probe, 4)) >= cache.lookup(probe).cached_blocks


def test_torch_hit_skips_compute_and_is_identical():
    async def scenario() -> None:
        backend = TorchBackend("tiny")
        try:
            prompt = encode("a shared system prompt, long enough for blocks. " * 3)
            full = await backend.prefill(prompt)
            cache = PrefixCache(16, 64)
            hit = cache.lookup(prompt)
            cache.store(prompt, hit.keys, lambda i: backend.block_payload(full, i, 16))
            again = [*prompt[:-5], *encode(" other end")[1:]]
            hit = cache.lookup(again)
            assert hit.cached_blocks >= 4
            reused = await backend.prefill_cached(again, hit.cached_blocks * 16, hit.payloads)
            fresh = await backend.prefill(again)
            assert bool((reused.kv == fresh.kv).all())
            assert bool((reused.logits == fresh.logits).all())
        finally:
            backend.close()

    asyncio.run(scenario())


def test_sim_prefill_time_counts_only_uncached_tokens():
    async def timed(cached: int) -> float:
        backend = SimBackend(prefill_s_per_token=0.001)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await backend.prefill_cached(list(range(300)), cached, [])
        return loop.time() - start

    # Not a timing assertion on the machine's speed: 300 ms of sleep against 0 ms.
    assert asyncio.run(timed(300)) < asyncio.run(timed(0))


def test_publisher_speaks_vllms_pub_and_replay_contract():
    publisher = KvEventPublisher("127.0.0.1", topic="kv")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.connect(f"tcp://127.0.0.1:{publisher.port}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(f"tcp://127.0.0.1:{publisher.replay_port}")
    try:
        stored = BlockStored([11], None, [1, 2], 2, None, "GPU", None)
        # A SUB joins late (slow joiner): publish until one arrives, as a router would
        # then ask the replay for what it missed.
        got = None
        for _ in range(100):
            publisher.publish([stored])
            try:
                got = sub.recv_multipart(flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                zmq.select([sub], [], [], 0.1)
        assert got is not None
        topic, seq, payload = got
        assert topic == b"kv" and decode_batch(payload).events == [stored]
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            empty, *rest = dealer.recv_multipart()
            assert empty == b""
            if rest[-2] == REPLAY_END:
                break
            frames.append(rest)
        assert [decode_seq(f[1]) for f in frames] == list(range(len(frames)))
        assert frames[0][0] == b"kv" and decode_seq(seq) < len(frames)
        dealer.send_multipart([b"", b"bad"])  # a bad request is refused, the thread lives
        dealer.send_multipart([b"", (10**6).to_bytes(8, "big")])
        assert dealer.recv_multipart()[-2] == REPLAY_END
        assert publisher.bad_replay_requests == 1
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        publisher.close()
        publisher.close()


def test_engine_reports_hits_and_publishes_the_prompts_blocks():
    with start_engine(role="mixed", backend="sim") as engine:  # KV events: the default
        ready_line_endpoint = f"tcp://{engine.host}"
        prompt = "You are a helpful assistant who answers in haiku. " * 2
        body = {"model": "tiny", "prompt": prompt + "First?", "max_tokens": 2}
        shared = (len(encode(prompt)) // 16) * 16
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            first_answer = client.post(engine.url + "/v1/completions", json=body)
            body["prompt"] = prompt + "Second?"
            second_answer = client.post(engine.url + "/v1/completions", json=body)
            # Per request, as vLLM reports it: the prompt tokens the cache held.
            for response, cached in ((first_answer, 0), (second_answer, shared)):
                assert response.status_code == 200
                usage = response.json()["usage"]
                assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
            streamed = client.post(engine.url + "/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}})
            usage_event = [line for line in streamed.text.splitlines()
                           if '"usage"' in line][-1]
            assert json.loads(usage_event.removeprefix("data: "))["usage"][
                "prompt_tokens_details"] == {"cached_tokens": shared}
        m = metrics(engine.url)
        ids = encode(prompt + "Second?")
        assert m["pdreg:engine_prompt_tokens_total"] == len(encode(prompt + "First?")) \
            + 2 * len(ids)
        assert m["pdreg:engine_prefix_cache_hit_tokens_total"] == 2 * shared
        # Replay from 0: the stores name exactly the prompt's blocks by token content.
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        replay = engine.kv_events_replay
        assert replay.startswith(ready_line_endpoint)
        dealer.connect(replay)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            stored: list[int] = []
            while True:
                *_, seq, payload = dealer.recv_multipart()
                if seq == REPLAY_END:
                    break
                for event in msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events:
                    stored += event.block_hashes
        finally:
            dealer.close(0)
            ctx.term()
        first = block_keys(encode(prompt + "First?"), 16)
        second = block_keys(ids, 16)
        assert stored == first + [k for k in second if k not in first]


@pytest.mark.parametrize("backend", ["sim", "torch"])
def test_the_answer_is_cached_for_the_next_turn(backend: str) -> None:
    """As vLLM caches a block once its KV is computed, generated tokens' too: a next turn
    that repeats the answer finds it cached, and (torch) answers as a full prefill does
    (the same prompt under a `cache_salt` shares no block)."""
    with start_engine(role="mixed", backend=backend) as engine, \
            httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        def complete(prompt: list[int], max_tokens: int, **extra: str) -> tuple[list[int], int]:
            r = client.post(engine.url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "return_token_ids": True, **extra})
            assert r.status_code == 200, r.text
            body = r.json()
            return body["choices"][0]["token_ids"], \
                body["usage"]["prompt_tokens_details"]["cached_tokens"]

        prompt = encode("The question, asked once: what is a block? ")
        answer, _ = complete(prompt, 48)
        turn = [*prompt, *answer, *encode(" And a chain?")[1:]]
        ids, cached = complete(turn, 8)
        # Every full block of the prompt and of the answer's first 47 tokens (the last
        # sampled token has no KV yet).
        assert cached == (len(prompt) + 47) // 16 * 16 > len(prompt)
        assert ids == complete(turn, 8, cache_salt="fresh")[0]
