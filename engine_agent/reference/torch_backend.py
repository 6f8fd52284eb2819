"""The torch backend: real compute on one CPU thread, off the event loop."""

from __future__ import annotations

import asyncio
import ctypes
import random
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine_agent.reference.backend import Prefilled, SamplingParams, TensorMeta
from engine_agent.reference.model import ModelConfig, TinyTransformer


@dataclass(slots=True)
class TorchSequence:
    cache: torch.Tensor  # (L, 2, H, capacity, Dh)
    length: int


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (no numpy needed).

    The view keeps the tensor alive through the ctypes array it wraps.
    """
    if not tensor.is_contiguous():
        raise ValueError("tensor_buffer needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array.owner = tensor  # type: ignore[attr-defined]  # ctypes arrays accept attributes
    return memoryview(array)


class TorchBackend:
    name = "torch"

    def __init__(self, model_name: str, *, threads: int = 1,
                 config: ModelConfig | None = None) -> None:
        # One compute thread per engine: many engines share two cores, and a single
        # executor thread serialises steps the way one GPU stream would.
        torch.set_num_threads(threads)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.model = TinyTransformer(model_name, config)
        self.config = self.model.config
        self.kv_bytes_per_token = self.config.kv_bytes_per_token
        self.max_model_len = self.config.max_positions

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def prefill(self, prompt: list[int]) -> Prefilled:
        kv, logits = await self._run(self.model.prefill, prompt)
        return Prefilled(num_tokens=len(prompt), kv=kv, logits=logits)

    async def prefill_cached(self, prompt: list[int], cached_tokens: int,
                             blocks: Sequence[torch.Tensor]) -> Prefilled:
        """Prefill reusing the KV of the prompt's first `cached_tokens` (a prefix-cache
        hit, `blocks` in order): only the rest is computed, with identical results."""
        if not cached_tokens:
            return await self.prefill(prompt)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            return self.model.prefill(prompt, torch.cat(list(blocks), dim=3))

        kv, logits = await self._run(run)
        return Prefilled(num_tokens=len(prompt), kv=kv, logits=logits)

    def block_payload(self, prefilled: Prefilled, index: int, block_size: int) -> torch.Tensor:
        """Block `index` of a prefill's KV, copied: the cache outlives the request."""
        kv: torch.Tensor = prefilled.kv
        return kv[:, :, :, index * block_size:(index + 1) * block_size].clone()

    def sequence_block_payload(self, seq: TorchSequence, index: int,
                               block_size: int) -> torch.Tensor:
        """Block `index` of a running sequence's KV (prompt or generated), copied."""
        return seq.cache[:, :, :, index * block_size:(index + 1) * block_size].clone()

    def start_sequence(self, prefilled: Prefilled, max_new_tokens: int) -> TorchSequence:
        cache = self.model.new_cache(prefilled.kv, prefilled.num_tokens + max_new_tokens)
        return TorchSequence(cache=cache, length=prefilled.num_tokens)

    async def step(self, seq: TorchSequence, token: int) -> torch.Tensor:
        logits = await self._run(self.model.step, seq.cache, seq.length, token)
        seq.length += 1
        return logits

    def make_sampler(self, params: SamplingParams) -> torch.Generator | None:
        if params.temperature <= 0:
            return None
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: SamplingParams,
               sampler: torch.Generator | None) -> int:
        if sampler is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=sampler))

    def pack(self, prefilled: Prefilled) -> tuple[list[TensorMeta], list[memoryview]]:
        kv: torch.Tensor = prefilled.kv
        logits: torch.Tensor = prefilled.logits.contiguous()
        metas = [TensorMeta("kv", "float32", list(kv.shape)),
                 TensorMeta("logits", "float32", list(logits.shape))]
        return metas, [tensor_buffer(kv), tensor_buffer(logits)]

    def _expected_shapes(self, num_tokens: int) -> dict[str, list[int]]:
        c = self.config
        return {"kv": [c.n_layers, 2, c.n_heads, num_tokens, c.head_dim],
                "logits": [c.vocab_size]}

    def unpack(self, num_tokens: int, metas: Sequence[TensorMeta],
               buffers: Sequence[memoryview]) -> Prefilled:
        expected = self._expected_shapes(num_tokens)
        if [m.name for m in metas] != list(expected) or len(buffers) != len(metas):
            raise ValueError(f"expected tensors {list(expected)}, got {[m.name for m in metas]}"
                             f" with {len(buffers)} buffers")
        tensors: dict[str, torch.Tensor] = {}
        for meta, buf in zip(metas, buffers, strict=True):
            if meta.dtype != "float32" or meta.shape != expected[meta.name]:
                raise ValueError(f"tensor {meta.name}: got {meta.dtype}{meta.shape}, expected "
                                 f"float32{expected[meta.name]} (another model or layout?)")
            count = 1
            for dim in meta.shape:
                count *= dim
            if buf.nbytes != count * 4:
                raise ValueError(f"tensor {meta.name}: {buf.nbytes} bytes for {count} floats")
            with warnings.catch_warnings():
                # The received frame is read-only; the tensor is only ever read (the cache
                # copies it), so the "non-writable buffer" warning does not apply.
                warnings.simplefilter("ignore", UserWarning)
                tensors[meta.name] = torch.frombuffer(buf, dtype=torch.float32).view(meta.shape)
        return Prefilled(num_tokens=num_tokens, kv=tensors["kv"], logits=tensors["logits"])

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
