"""The sim backend: the same protocols with compute replaced by delays and a KV payload.

Cheap enough to run dozens of engines on two cores. Each token (a lower-case letter) is
a function of every token before it, through a CRC-32 of the whole sequence carried as
the sequence's state: prefill+decode output is identical to a mixed engine's, and a
generation continued from prompt + the tokens so far is identical to one that was not
interrupted (what request migration needs). Sampling parameters are accepted and
ignored. The KV payload has `kv_bytes_per_token` bytes per prompt token and really
travels between engines, with the CRC state beside it.
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
    crc: int  # CRC-32 of every token so far: the "logits" of the next one


def _crc(tokens: Sequence[int], crc: int = 0) -> int:
    return zlib.crc32(b"".join(t.to_bytes(2, "little") for t in tokens), crc)


def _letter(crc: int) -> int:
    return _FIRST_LETTER + crc % _LETTERS


def sim_answer(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The tokens the sim generates for `prompt` (EOS ignored), without running it: a
    benchmark's chat trace repeats each answer in the next turn, as a client does."""
    crc, out = _crc(prompt), []
    for _ in range(max_tokens):
        out.append(_letter(crc))
        crc = _crc((out[-1],), crc)
    return out


class SimBackend:
    name = "sim"
    max_model_len = 1 << 16

    def __init__(self, *, prefill_s_per_token: float = 0.0, decode_s_per_token: float = 0.0,
                 kv_bytes_per_token: int = 128) -> None:
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_per_token = decode_s_per_token
        self.kv_bytes_per_token = kv_bytes_per_token

    async def prefill(self, prompt: list[int]) -> Prefilled:
        if self.prefill_s_per_token > 0:
            await asyncio.sleep(self.prefill_s_per_token * len(prompt))
        payload = bytes(self.kv_bytes_per_token * len(prompt))
        return Prefilled(num_tokens=len(prompt), kv=payload, logits=_crc(prompt))

    async def prefill_cached(self, prompt: list[int], cached_tokens: int,
                             blocks: Sequence[Any]) -> Prefilled:
        """A prefix-cache hit: only the uncached tokens cost prefill time."""
        if self.prefill_s_per_token > 0:
            await asyncio.sleep(self.prefill_s_per_token * (len(prompt) - cached_tokens))
        payload = bytes(self.kv_bytes_per_token * len(prompt))
        return Prefilled(num_tokens=len(prompt), kv=payload, logits=_crc(prompt))

    def block_payload(self, prefilled: Prefilled, index: int, block_size: int) -> None:
        return None  # the sim's KV is zeros: nothing to keep

    def sequence_block_payload(self, seq: SimSequence, index: int, block_size: int) -> None:
        return None

    def start_sequence(self, prefilled: Prefilled, max_new_tokens: int) -> SimSequence:
        return SimSequence(length=prefilled.num_tokens, crc=int(prefilled.logits))

    async def step(self, seq: SimSequence, token: int) -> int:
        if self.decode_s_per_token > 0:
            await asyncio.sleep(self.decode_s_per_token)
        seq.crc = _crc((token,), seq.crc)
        seq.length += 1
        return seq.crc

    def make_sampler(self, params: SamplingParams) -> None:
        return None

    def sample(self, logits: Any, params: SamplingParams, sampler: Any) -> int:
        return _letter(int(logits))

    def pack(self, prefilled: Prefilled) -> tuple[list[TensorMeta], list[Any]]:
        first = int(prefilled.logits).to_bytes(4, "little")  # the CRC state
        return ([TensorMeta("kv", "bytes", [len(prefilled.kv)]),
                 TensorMeta("crc", "bytes", [4])],
                [prefilled.kv, first])

    def unpack(self, num_tokens: int, metas: Sequence[TensorMeta],
               buffers: Sequence[memoryview]) -> Prefilled:
        if [m.name for m in metas] != ["kv", "crc"] or len(buffers) != 2:
            raise ValueError(f"expected sim tensors [kv, crc], got "
                             f"{[m.name for m in metas]}")
        expected = self.kv_bytes_per_token * num_tokens
        if buffers[0].nbytes != expected:
            raise ValueError(f"sim KV is {buffers[0].nbytes} bytes, expected {expected} "
                             f"({num_tokens} tokens x {self.kv_bytes_per_token}; "
                             "engines disagree on --sim-kv-bytes-per-token?)")
        crc = int.from_bytes(bytes(buffers[1]), "little")
        return Prefilled(num_tokens=num_tokens, kv=buffers[0], logits=crc)

    def close(self) -> None:
        pass
