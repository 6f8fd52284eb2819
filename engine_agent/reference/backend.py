"""What the engine needs from a compute backend (torch or sim), and sampling parameters.

A backend computes; the engine decides what to compute. Its KV travels between engines as
named tensors: `TensorMeta` headers plus one raw buffer each (see `kv_transfer`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """How to read one raw buffer: `dtype` is a torch dtype name ("float32") or "bytes"."""

    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(slots=True)
class Prefilled:
    """The product of a prefill: the prompt's KV and the logits for the first new token.

    Carrying the logits (not a sampled token) lets a decode engine sample the first token
    with its own seeded generator, exactly as a mixed engine would.
    """

    num_tokens: int
    kv: Any  # backend-specific
    logits: Any  # backend-specific


class SequenceState(Protocol):
    """A running sequence: its KV cache and how many positions it holds."""

    length: int


class Backend(Protocol):
    name: str
    kv_bytes_per_token: int
    max_model_len: int  # prompt + generated tokens it takes (its context length)

    async def prefill(self, prompt: list[int]) -> Prefilled: ...

    async def prefill_cached(self, prompt: list[int], cached_tokens: int,
                             blocks: Sequence[Any]) -> Prefilled:
        """`prefill` reusing the first `cached_tokens`' KV (prefix-cache `blocks`)."""
        ...

    def block_payload(self, prefilled: Prefilled, index: int, block_size: int) -> Any:
        """What the prefix cache keeps of block `index` of a prefill's KV."""
        ...

    def sequence_block_payload(self, seq: SequenceState, index: int, block_size: int) -> Any:
        """What the prefix cache keeps of block `index` of a running sequence's KV (its
        prompt and the tokens generated so far: positions below `seq.length`)."""
        ...

    def start_sequence(self, prefilled: Prefilled, max_new_tokens: int) -> SequenceState: ...

    async def step(self, seq: SequenceState, token: int) -> Any:
        """Append `token` at position `seq.length`; return the logits for the next one."""
        ...

    def make_sampler(self, params: SamplingParams) -> Any: ...

    def sample(self, logits: Any, params: SamplingParams, sampler: Any) -> int: ...

    def pack(self, prefilled: Prefilled) -> tuple[list[TensorMeta], list[Any]]:
        """The tensors to send (metas, buffers); buffers support the buffer protocol."""
        ...

    def unpack(self, num_tokens: int, metas: Sequence[TensorMeta],
               buffers: Sequence[memoryview]) -> Prefilled:
        """Rebuild a `Prefilled` from received buffers; ValueError if they do not fit."""
        ...

    def close(self) -> None: ...


def prompt_digest(prompt: Sequence[int]) -> str:
    """A short fingerprint of a prompt, so a decode can refuse KV computed for another one."""
    data = b"".join(t.to_bytes(2, "little") for t in prompt)
    return hashlib.blake2b(data, digest_size=8).hexdigest()
