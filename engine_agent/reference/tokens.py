"""Byte-level tokens: 256 byte values plus BOS and EOS. Nothing to download."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Final

BOS_ID: Final = 256
EOS_ID: Final = 257
VOCAB_SIZE: Final = 258
BYTES_TOKENIZER: Final = "pdreg:bytes"  # how a member names this tokenizer (KvEventsSpec)
MAX_UTF8_BYTES: Final = 4  # the longest UTF-8 sequence: a pending one is shorter


class PromptError(ValueError):
    """The prompt cannot be tokenized (the HTTP layer answers 400)."""


def encode(text: str) -> list[int]:
    """BOS followed by the UTF-8 bytes of `text`."""
    return [BOS_ID, *text.encode("utf-8")]


def check_token_ids(ids: Sequence[object]) -> list[int]:
    """Validate a prompt given as token ids (the `prompt: [int, ...]` form)."""
    out: list[int] = []
    for tok in ids:
        if type(tok) is not int or not 0 <= tok < VOCAB_SIZE:
            raise PromptError(f"token id {tok!r} is outside the vocabulary [0, {VOCAB_SIZE})")
        out.append(tok)
    if not out:
        raise PromptError("the prompt is empty")
    return out


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """A simple chat template: one `<|role|>` line per message, then the assistant cue."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


class Detokenizer:
    """Turns tokens into text incrementally: a multi-byte character split across tokens
    comes out whole once its last byte arrives; invalid bytes become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @classmethod
    def after(cls, prompt: Sequence[int]) -> Detokenizer:
        """A detokenizer that has read the prompt's last bytes (their text discarded), so
        a character begun in the prompt ends in the output whole: a generation continued
        from prompt + the ids generated so far writes the same text as one that was not
        interrupted (vLLM's detokenizer, too, starts from the prompt's last tokens)."""
        detok = cls()
        tail = [t for t in prompt[-MAX_UTF8_BYTES:] if t < 256]
        for token in tail:
            detok.push(token)
        return detok

    def push(self, token: int) -> str:
        if token >= 256:  # specials have no text
            return ""
        return self._decoder.decode(bytes((token,)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def decode(tokens: Sequence[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
