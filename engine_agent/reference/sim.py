"""The sim backend: the same protocols with compute replaced by delays and a KV payload.

Cheap enough to run dozens of engines on two cores. Tokens are a deterministic function
of the prompt and position (lower-case letters), so prefill+decode output is identical
to a mixed engine's; sampling parameters are accepted and ignored. The KV payload has
`kv_bytes_per_token` bytes per prompt token and really travels between engines.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_agent.reference.backend import Prefilled, SamplingParams, TensorMeta

_FIRST_LETTER = ord("a")
_LETTERS = 26


@dataclass(slots=True)
class SimSequence:
    length: int


def _first_token(prompt: list[int]) -> int:
    data = b"".join(t.to_bytes(2, "little") for t in prompt)
    return _FIRST_LETTER + zlib.crc32(data) % _LETTERS


def _next_token(token: int, position: int) -> int:
    return _FIRST_LETTER + (token * 31 + position * 7) % _LETTERS


class SimBackend:
    name = "sim"
    max_model_len = 1 << 20

    def __init__(self, *, prefill_s_per_token: float = 0.0, decode_s_per_token: float = 0.0,
                 kv_bytes_per_token: int = 128) -> None:
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_per_token = decode_s_per_token
        self.kv_bytes_per_token = kv_bytes_per_token

    async def prefill(self, prompt: list[int]) -> Prefilled:
        if self.prefill_s_per_token > 0:
            await asyncio.sleep(self.prefill_s_per_token * len(prompt))
        payload = bytes(self.kv_bytes_per_token * len(prompt))
        return Prefilled(num_tokens=len(prompt), kv=payload, logits=_first_token(prompt))

    def start_sequence(self, prefilled: Prefilled, max_new_tokens: int) -> SimSequence:
        return SimSequence(length=prefilled.num_tokens)

    async def step(self, seq: SimSequence, token: int) -> int:
        if self.decode_s_per_token > 0:
            await asyncio.sleep(self.decode_s_per_token)
        next_token = _next_token(token, seq.length)
        seq.length += 1
        return next_token

    def make_sampler(self, params: SamplingParams) -> None:
        return None

    def sample(self, logits: Any, params: SamplingParams, sampler: Any) -> int:
        return int(logits)

    def pack(self, prefilled: Prefilled) -> tuple[list[TensorMeta], list[Any]]:
        first = int(prefilled.logits).to_bytes(4, "little")
        return ([TensorMeta("kv", "bytes", [len(prefilled.kv)]),
                 TensorMeta("first_token", "bytes", [4])],
                [prefilled.kv, first])

    def unpack(self, num_tokens: int, metas: Sequence[TensorMeta],
               buffers: Sequence[memoryview]) -> Prefilled:
        if [m.name for m in metas] != ["kv", "first_token"] or len(buffers) != 2:
            raise ValueError(f"expected sim tensors [kv, first_token], got "
                             f"{[m.name for m in metas]}")
        expected = self.kv_bytes_per_token * num_tokens
        if buffers[0].nbytes != expected:
            raise ValueError(f"sim KV is {buffers[0].nbytes} bytes, expected {expected} "
                             f"({num_tokens} tokens x {self.kv_bytes_per_token}; "
                             "engines disagree on --sim-kv-bytes-per-token?)")
        first = int.from_bytes(bytes(buffers[1]), "little")
        return Prefilled(num_tokens=num_tokens, kv=buffers[0], logits=first)

    def close(self) -> None:
        pass
