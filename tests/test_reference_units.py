"""The reference engine's parts in-process: tokens, model, scheduler, KV store, KV wire."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import zmq.asyncio

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402

from engine_agent.reference import tokens  # noqa: E402
from engine_agent.reference.backend import TensorMeta, prompt_digest  # noqa: E402
from engine_agent.reference.kv_store import HeldKv, KvStore, KvUnavailable  # noqa: E402
from engine_agent.reference.kv_transfer import KvClient, KvFetchError, KvServer  # noqa: E402
from engine_agent.reference.model import ModelConfig, TinyTransformer, seed_for  # noqa: E402
from engine_agent.reference.scheduler import Scheduler  # noqa: E402
from engine_agent.reference.sim import SimBackend  # noqa: E402
from engine_agent.reference.torch_backend import TorchBackend  # noqa: E402

SMALL = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, max_positions=256)


def test_tokens_round_trip_and_multibyte_streaming() -> None:
    text = "héllo ✓ 日本"
    ids = tokens.encode(text)
    assert ids[0] == tokens.BOS_ID and tokens.decode(ids) == text
    detok = tokens.Detokenizer()
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert "" in pieces  # a split character waited for its last byte
    assert tokens.Detokenizer().push(tokens.EOS_ID) == ""
    with pytest.raises(tokens.PromptError):
        tokens.check_token_ids([1, tokens.VOCAB_SIZE])


def test_weights_come_from_the_model_name_stably() -> None:
    assert seed_for("tiny") == 3572440632994932804  # sha256-based: stable across processes
    a, b = TinyTransformer("m", SMALL), TinyTransformer("m", SMALL)
    assert torch.equal(a.layers[0].w_qkv, b.layers[0].w_qkv)
    assert not torch.equal(a.w_head, TinyTransformer("other", SMALL).w_head)


def test_decode_steps_agree_with_a_full_prefill() -> None:
    model = TinyTransformer("m", SMALL)
    prompt = tokens.encode("consistency check")
    kv, logits = model.prefill(prompt)
    cache = model.new_cache(kv, len(prompt) + 4)
    extra = [int(logits.argmax())]
    for i in range(3):
        extra.append(int(model.step(cache, len(prompt) + i, extra[-1]).argmax()))
    full_kv, _ = model.prefill(prompt + extra[:3])
    torch.testing.assert_close(cache[:, :, :, : len(prompt) + 3], full_kv,
                               rtol=1e-4, atol=1e-4)


def test_scheduler_queues_fifo_and_counts() -> None:
    async def scenario() -> list[int]:
        scheduler = Scheduler(max_running=2, kv_capacity_tokens=100)
        order: list[int] = []
        gate = asyncio.Event()

        async def job(i: int) -> None:
            async with scheduler.slot():
                order.append(i)
                await gate.wait()

        tasks = [asyncio.create_task(job(i)) for i in range(5)]
        while scheduler.waiting < 3:
            await asyncio.sleep(0)
        assert (scheduler.running, scheduler.waiting) == (2, 3)
        tasks[3].cancel()  # a queued request that goes away leaves the queue
        await asyncio.sleep(0)
        assert scheduler.waiting == 2
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert (scheduler.running, scheduler.waiting) == (0, 0)
        scheduler.add_kv(50)
        assert scheduler.kv_usage == 0.5
        return order

    assert asyncio.run(scenario()) == [0, 1, 2, 4]


def _held(n: int = 4) -> HeldKv:
    return HeldKv(prompt_digest="d", num_tokens=n, metas=[], buffers=[])


def test_kv_store_take_wait_fail_and_expire() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(1, 100)
        store = KvStore(scheduler, lease_s=10.0)
        store.put("h:a", _held())
        assert scheduler.kv_tokens == 4
        assert (await store.take("h:a", 0)).num_tokens == 4
        assert scheduler.kv_tokens == 0
        with pytest.raises(KvUnavailable, match="already taken"):
            await store.take("h:a", 0)
        waiter = asyncio.create_task(store.take("r:1", 5))  # the decode asks first
        await asyncio.sleep(0)
        store.put("r:1", _held(7))
        assert (await waiter).num_tokens == 7 and scheduler.kv_tokens == 0
        store.fail("r:2", "prompt too long")
        with pytest.raises(KvUnavailable, match="prompt too long"):
            await store.take("r:2", 5)
        with pytest.raises(KvUnavailable) as timeout:
            await store.take("r:3", 0.01)
        assert timeout.value.timed_out
        store.put("h:b", _held())
        assert store.sweep(now=store.held["h:b"].expires_at + 0.1) == 1
        assert (store.held, scheduler.kv_tokens, store.expired_total) == ({}, 0, 1)

    asyncio.run(scenario())


def test_kv_travels_over_zeromq_bit_exact() -> None:
    threads = torch.get_num_threads()  # the backend sets 1 process-wide; restore it
    backend = TorchBackend("m", config=SMALL)
    prompt = tokens.encode("over the wire")

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        store = KvStore(Scheduler(1, 1000), lease_s=10.0)
        server = KvServer(ctx, store, "engine-1", "127.0.0.1", 0)
        serving = asyncio.create_task(server.serve())
        client = KvClient(ctx)
        try:
            prefilled = await backend.prefill(prompt)
            metas, buffers = backend.pack(prefilled)
            store.put("h:x", HeldKv(prompt_digest(prompt), len(prompt), metas, buffers))
            got_metas, got_buffers = await client.fetch(
                "127.0.0.1", server.port, key="h:x", engine_id="engine-1",
                prompt_digest=prompt_digest(prompt), num_tokens=len(prompt), wait_s=0)
            received = backend.unpack(len(prompt), got_metas, got_buffers)
            assert torch.equal(received.kv, prefilled.kv)
            assert torch.equal(received.logits, prefilled.logits)
            assert not store.held  # freed by the transfer
            with pytest.raises(KvFetchError, match="no KV held"):
                await client.fetch("127.0.0.1", server.port, key="h:x", engine_id="",
                                   prompt_digest="", num_tokens=1, wait_s=0)
            with pytest.raises(ValueError, match="expected"):
                backend.unpack(len(prompt) + 1, got_metas, got_buffers)
        finally:
            serving.cancel()
            client.close()
            server.close()
            ctx.term()

    try:
        asyncio.run(scenario())
    finally:
        backend.close()
        torch.set_num_threads(threads)


def test_sim_refuses_a_payload_of_the_wrong_size() -> None:
    backend = SimBackend(kv_bytes_per_token=8)
    prefilled = asyncio.run(backend.prefill([1, 2, 3]))
    metas, buffers = backend.pack(prefilled)
    assert [m.name for m in metas] == ["kv", "crc"] and len(buffers[0]) == 24
    views = [memoryview(b) for b in buffers]
    assert backend.unpack(3, metas, views).logits == prefilled.logits
    with pytest.raises(ValueError, match="sim-kv-bytes-per-token"):
        SimBackend(kv_bytes_per_token=16).unpack(3, metas, views)
    with pytest.raises(ValueError):
        backend.unpack(3, [TensorMeta("kv", "bytes", [24])], views[:1])
