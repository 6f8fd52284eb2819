"""Refuse a prompt that surely cannot fit in its model's context, before paying for it.

An engine refuses a prompt longer than its context (vLLM: 400 when the prompt's tokens
exceed max_model_len), after the router has decoded the body, tokenized the prompt,
re-encoded and forwarded it, and the engine has decoded, rendered and tokenized it
again: for a 4 MB prompt, tens of milliseconds of two event loops (bench/RESULTS.md).
The router answers that 400 itself when it is sure, without decoding the body into
objects, rendering a template or tokenizing:

- a model's context is the longest its engine members register (`MemberSpec.
  max_model_len`); unknown, and nothing is refused, if one of them does not say;
- a text of N characters needs at least N / L tokens, L what one token of the model's
  tokenizer covers at most (router/kv/token_bound.py; unknown for some tokenizers:
  nothing is refused);
- the body's bytes bound its prompt's characters from above: a body no longer than the
  smallest limit (context x L) of any model is not looked at;
- a longer body is decoded once into its prompt fields only (`_Shape`: no dicts, no
  other fields), and refused when its `prompt` (text, or token ids against the context
  itself) or its chat's messages are surely too long. A chat counts the text of its
  non-assistant messages, stripped (templates may trim a message, or drop an assistant
  turn's reasoning); its template's own text only adds tokens.

A body that is not a well-formed request is left to the usual path, which answers it.
Pure but for the one decode: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from serving.http_messages import INVALID_REQUEST, Response, openai_error

__all__ = ["ModelLimit", "PromptLimits"]


@dataclass(frozen=True, slots=True)
class ModelLimit:
    context: int  # tokens: the longest context of the model's engines
    chars_per_token: int  # at most, for its tokenizer

    @property
    def chars(self) -> int:
        """The most characters of text that may still fit in `context` tokens."""
        return self.context * self.chars_per_token


class _Message(msgspec.Struct, gc=False):
    role: Any = None
    content: Any = None


class _Shape(msgspec.Struct, gc=False):
    """A request's model and prompt fields, the rest of the body skipped."""

    model: Any = None
    prompt: Any = None
    messages: list[_Message] | None = None


_shape = msgspec.json.Decoder(_Shape)


class PromptLimits:
    def __init__(self) -> None:
        self._limits: dict[str, ModelLimit] = {}
        self._smallest = 0  # chars: bodies no longer than this are not looked at (0: none)

    def update(self, limits: Mapping[str, ModelLimit]) -> None:
        """The models whose limit is known now (every other one: nothing is refused)."""
        self._limits = dict(limits)
        self._smallest = min((limit.chars for limit in self._limits.values()), default=0)

    def refusal(self, body: bytes, *, chat: bool) -> Response | None:
        """The 400 for a request whose prompt surely exceeds its model's context, else
        None (then the request goes on as usual). `chat`: a chat completion, whose
        engine reads `messages` only (a completion's reads `prompt` only)."""
        if not self._smallest or len(body) <= self._smallest:
            return None
        try:
            shape = _shape.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return None  # not a well-formed request: the usual path answers it
        limit = self._limits.get(shape.model) if isinstance(shape.model, str) else None
        if limit is None:
            return None
        prompt = None if chat else shape.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if len(prompt) > limit.context and all(type(t) is int for t in prompt):
                return _too_long(limit, len(prompt), "")
            return None
        if isinstance(prompt, str):
            chars = len(prompt)
        elif chat and shape.messages is not None:
            chars = _chat_chars(shape.messages, limit.chars)
        else:
            return None
        if chars <= limit.chars:
            return None
        return _too_long(limit, -(-chars // limit.chars_per_token), f" ({chars} characters "
                         f"of text, at most {limit.chars_per_token} per token)")


def _chat_chars(messages: list[_Message], enough: int) -> int:
    """The text of the non-assistant messages, stripped as a template may strip it
    (and may drop an earlier assistant turn's reasoning); counting stops past `enough`."""
    total = 0
    for message in messages:
        if message.role == "assistant":
            continue
        content = message.content
        if isinstance(content, str):
            total += len(content.strip())
        elif isinstance(content, list):
            total += sum(len(part["text"].strip()) for part in content
                         if isinstance(part, dict) and part.get("type") == "text"
                         and isinstance(part.get("text"), str))
        if total > enough:
            break
    return total


def _too_long(limit: ModelLimit, tokens: int, detail: str) -> Response:
    return openai_error(
        400, f"This model's maximum context length is {limit.context} tokens. However, "
        f"your prompt has at least {tokens} tokens{detail}. Please reduce the length of "
        "the prompt.", INVALID_REQUEST, "context_length_exceeded")
