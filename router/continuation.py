"""Continuing a client's stream on another decode: what was sent, and what to ask next.

When a decode fails mid-stream, the router re-prefills the prompt plus the tokens the
client already has, on a new pair, and relays the rest into the same client stream. It
works from token ids (vLLM's `return_token_ids`), never from re-tokenized text, which
can change the output. Three parts, all pure:

- `TokenTap` reads every relayed read of complete SSE events, at a few substring
  searches per read: the output token ids forwarded so far, the prompt's ids (chunk 0),
  whether the generation finished, whether an error event arrived (the engine's way of
  failing mid-stream), and whether the stream ended (`data: [DONE]`). When the client
  did not ask for token ids, it forwards them as null, which is what vLLM itself writes.
  Chunks that carry ids but no text (a character's first bytes) are held back until a
  chunk with text follows: a continuation must start between characters, or vLLM
  re-emits the prompt's text (seen against vLLM's completions API: a continuation
  cut inside a character repeated the prompt's text).
- `continuation_of` turns the client's request into the next one: a `/v1/completions`
  request whose prompt is the ids so far, `max_tokens` (and `min_tokens`) reduced by
  what was sent. A chat request continues as a completion too (vLLM applies the chat
  template once; the ids already contain it), and `Reshaper` turns the completion
  chunks back into chat chunks.
- `Reshaper` rewrites the continuation's events so the client sees one stream: the
  original response id, `created` and model, no second `prompt_token_ids`, usage that
  counts the whole generation.

What cannot be continued exactly falls back to today's SSE error event; see
`why_not_migratable` and docs/operations.md, "Request migration".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from wire.protocol import Handshake

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "Reshaper",
    "TokenTap",
    "continuation_of",
    "streams_token_ids",
    "why_not_migratable",
]

COMPLETIONS_PATH: Final = "/v1/completions"
CHAT_PATH: Final = "/v1/chat/completions"
OPENAI_DEFAULT_MAX_TOKENS: Final = 16  # /v1/completions without max_tokens (vLLM too)

# Literal prefixes keep these searches at C speed: `"token_ids":[...]` or
# `"prompt_token_ids":[...]` (the prefix is checked before the match).
_IDS = re.compile(rb'token_ids"\s*:\s*\[([0-9,\s]*)\]')
# An error event: vLLM writes `data: {"error": {...}}` (older: `"object": "error"`) and
# then [DONE]. In JSON text a quote is escaped, so these cannot come from token text.
_ERROR = re.compile(rb'(?:^|\n)data: ?\{\s*"error"\s*:|"object"\s*:\s*"error"')
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# Chat deltas the completion endpoint cannot reproduce (tool-call and reasoning parsers).
_PARSED_DELTA = re.compile(rb'"(?:tool_calls|reasoning_content|reasoning)"\s*:\s*[\[{"]')
# A chunk with output ids but no text (bytes of a character not yet whole): vLLM's
# detokenizer re-emits the whole prompt's text if a continuation starts inside a
# character, so such chunks are held back until text follows (see TokenTap).
_OUTPUT_IDS = re.compile(rb'(?<!prompt_)token_ids"\s*:\s*\[\s*\d')
_NO_TEXT = re.compile(rb'"(?:text|content)"\s*:\s*""|"delta"\s*:\s*\{\s*\}')
DONE_EVENT: Final = b"data: [DONE]\n\n"
EVENT_END: Final = b"\n\n"

# Request fields that make a continuation impossible to match, by what they are.
_STRUCTURED: Final = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "structural_tag", "structured_outputs")
# Chat fields a /v1/completions continuation must not carry (tools and structured output
# are refused before; these only shape the chat prompt, which the ids already hold).
_CHAT_ONLY: Final = frozenset({
    "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "response_format", "logprobs", "top_logprobs",
    "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "documents", "mm_processor_kwargs", "echo",
    "add_special_tokens", "modalities", "audio", "reasoning_effort", "include_reasoning",
    "prediction", "return_prompt_text"})
# Completion fields that described the first leg only.
_FIRST_LEG_ONLY: Final = ("echo", "prompt_logprobs", "suffix", "return_prompt_text")

_decode = msgspec.json.decode
_encode = msgspec.json.encode


# SGLang 0.5.23 refuses return_token_ids on streamed chat (400): its chat streams carry
# no ids, so they cannot be continued exactly (seen against it: the request answers
# 400). Its completions stream ids as vLLM's do.
_NO_CHAT_STREAM_IDS: Final = frozenset({Handshake.SGLANG})


def streams_token_ids(protocol: str, path: str) -> bool:
    """Whether an engine speaking `protocol` streams token ids on `path` when asked."""
    return not (path.endswith(CHAT_PATH) and protocol in _NO_CHAT_STREAM_IDS)


def why_not_migratable(path: str, body: Mapping[str, Any]) -> str | None:
    """Why this request's stream cannot be continued exactly; None if it can."""
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "n > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("echo"):
        return "echo"
    if any(body.get(key) for key in _STRUCTURED):
        return "structured output"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        return "structured output"
    if path.endswith(CHAT_PATH):
        if body.get("tools") and body.get("tool_choice") != "none":
            return "tools"
        if body.get("logprobs"):
            return "chat logprobs"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and \
            len(prompt) > 1:
        return "several prompts"
    if body.get("suffix"):
        return "suffix"
    return None


def output_limit(path: str, body: Mapping[str, Any]) -> int | None:
    """The client's limit on output tokens; None = up to the context length."""
    if path.endswith(CHAT_PATH):
        limit = body.get("max_completion_tokens")
        return body.get("max_tokens") if limit is None else limit
    return body.get("max_tokens", OPENAI_DEFAULT_MAX_TOKENS)


def continuation_of(path: str, body: Mapping[str, Any], prompt_ids: list[int],
                    sent_ids: list[int]) -> dict[str, Any] | None:
    """The /v1/completions body that generates the rest; None if nothing is left."""
    limit = output_limit(path, body)
    if isinstance(limit, int) and limit - len(sent_ids) < 1:
        return None
    chat = path.endswith(CHAT_PATH)
    out = {k: v for k, v in body.items() if not (chat and k in _CHAT_ONLY)}
    for key in _FIRST_LEG_ONLY:
        out.pop(key, None)
    out["prompt"] = prompt_ids + sent_ids
    out["max_tokens"] = limit - len(sent_ids) if isinstance(limit, int) else None
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens:
        out["min_tokens"] = max(0, min_tokens - len(sent_ids))
    out["stream"] = True
    out["return_token_ids"] = True
    return out


def _ids(raw: bytes) -> list[int]:
    return [int(x) for x in raw.split(b",") if x.strip()]


@dataclass(slots=True)
class Fed:
    """What `TokenTap.feed` found in one read of complete events."""

    forward: bytes  # what to send on (events up to an error event, ids cut if asked)
    error: bool = False  # an error event arrived (it and what follows are not forwarded)
    done: bool = False  # the stream's last event, data: [DONE], is in `forward`


@dataclass(slots=True)
class TokenTap:
    """What the client has been sent, read from the relayed bytes.

    `strip`: forward `token_ids`/`prompt_token_ids` as null (the router asked for them;
    the client did not, and vLLM answers such a client with nulls). `chat`: watch for
    deltas only a chat endpoint makes (tool calls, reasoning), which a continuation
    could not reproduce.
    """

    strip: bool
    chat: bool = False
    watch_usage: bool = False
    hold_back: bool = True
    held: bytes = b""  # text-less chunks waiting for the text that completes them
    prompt_raw: bytes | None = None
    sent_raw: list[bytes] = field(default_factory=list)
    first_event: bytes = b""
    finished: bool = False
    usage_sent: bool = False
    unmigratable: str = ""  # why, once known from the stream itself

    def feed(self, events: bytes) -> Fed:
        if self.held:
            events, self.held = self.held + events, b""
        fed = Fed(events)
        if b"error" in events:  # cheap test first; the pattern only where it may match
            found = _ERROR.search(events)
            if found is not None:
                start = events.rfind(EVENT_END, 0, found.start() + 1)
                events = events[:start + 2] if start >= 0 else b""
                fed.error = True
        if self.hold_back:
            events, self.held = _hold_text_less_tail(events)
        if not self.first_event and events:
            self.first_event = events[:events.find(EVENT_END)]
        if not self.finished and b"finish_reason" in events and _FINISHED.search(events):
            self.finished = True
        if self.watch_usage and not self.usage_sent and b"usage" in events and \
                _USAGE.search(events):
            self.usage_sent = True
        if self.chat and not self.unmigratable and _PARSED_DELTA.search(events):
            self.unmigratable = "tool call or reasoning deltas"
        fed.forward = self._take_ids(events)
        fed.done = fed.forward.endswith(DONE_EVENT) and (
            len(fed.forward) == len(DONE_EVENT)
            or fed.forward.endswith(EVENT_END + DONE_EVENT))
        return fed

    def _take_ids(self, events: bytes) -> bytes:
        if b"token_ids" not in events:
            return events
        pieces: list[bytes] = []
        last = 0
        for match in _IDS.finditer(events):
            if events.endswith(b'"prompt_', 0, match.start()):
                if self.prompt_raw is None:
                    self.prompt_raw = match.group(1)
            else:
                self.sent_raw.append(match.group(1))
            if self.strip:  # what vLLM writes when the client did not ask: null
                pieces.append(events[last:match.start(1) - 1])
                pieces.append(b"null")
                last = match.end()
        if not self.strip:
            return events
        pieces.append(events[last:])
        return b"".join(pieces)

    def drop_held(self) -> None:
        """The leg failed: what was held back is regenerated by the next one."""
        self.held = b""

    @property
    def prompt_ids(self) -> list[int] | None:
        return None if self.prompt_raw is None else _ids(self.prompt_raw)

    def sent_ids(self) -> list[int]:
        return [t for raw in self.sent_raw for t in _ids(raw)]

    def sent_count(self) -> int:
        return sum(len(_ids(raw)) for raw in self.sent_raw)


def _hold_text_less_tail(events: bytes) -> tuple[bytes, bytes]:
    """(events to forward, trailing events with output ids, no text and no finish)."""
    cut = len(events)
    while cut:
        previous = events.rfind(EVENT_END, 0, cut - 2)
        start = previous + 2 if previous >= 0 else 0
        event = events[start:cut]
        if not (_OUTPUT_IDS.search(event) and _NO_TEXT.search(event)) or \
                _FINISHED.search(event):
            break
        cut = start
    return events[:cut], events[cut:]


@dataclass(slots=True)
class Reshaper:
    """Rewrites a continuation leg's events into the client's stream.

    `origin`: the first event the client got (its id, `created`, model, object).
    `sent_before`: output tokens the client had before this leg (for usage).
    """

    chat: bool
    keep_ids: bool
    origin: dict[str, Any]
    prompt_tokens: int
    sent_before: int

    @classmethod
    def for_stream(cls, tap: TokenTap, *, chat: bool, keep_ids: bool) -> Reshaper:
        try:
            origin = _decode(tap.first_event.removeprefix(b"data:").strip())
        except msgspec.DecodeError:
            origin = {}
        prompt = tap.prompt_ids or []
        return cls(chat=chat, keep_ids=keep_ids,
                   origin=origin if isinstance(origin, dict) else {},
                   prompt_tokens=len(prompt), sent_before=tap.sent_count())

    def reshape(self, events: bytes) -> bytes:
        out = []
        for event in events.split(EVENT_END):
            if not event:
                continue
            if event.startswith(b"data:") and not event.endswith(b"[DONE]"):
                try:
                    obj = _decode(event[5:])
                except msgspec.DecodeError:
                    continue  # a broken event from a broken leg: the client never sees it
                if isinstance(obj, dict):
                    event = b"data: " + _encode(self._reshape(obj))
            out.append(event + EVENT_END)
        return b"".join(out)

    def _reshape(self, obj: dict[str, Any]) -> dict[str, Any]:
        origin = self.origin
        for key in ("id", "created", "model", "object"):
            if key in origin:
                obj[key] = origin[key]
        if "prompt_token_ids" in obj:  # the client's first chunk had them already
            obj["prompt_token_ids"] = None
        choices = obj.get("choices")
        if isinstance(choices, list):
            obj["choices"] = [self._choice(c) for c in choices if isinstance(c, dict)]
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            completion = usage["completion_tokens"] + self.sent_before
            usage.update(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                         total_tokens=self.prompt_tokens + completion)
        return obj

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
        if not self.keep_ids and "token_ids" in choice:
            choice["token_ids"] = None
        if not self.chat:
            return choice
        out: dict[str, Any] = {"index": choice.get("index", 0),
                               "delta": {"content": choice.get("text", "")},
                               "logprobs": None,
                               "finish_reason": choice.get("finish_reason")}
        if "stop_reason" in choice:
            out["stop_reason"] = choice["stop_reason"]
        if "token_ids" in choice:
            out["token_ids"] = choice["token_ids"]
        return out

    def usage_event(self, completion_tokens: int) -> bytes:
        """The final usage chunk, for a stream whose engine died just before sending it."""
        origin = self.origin
        obj = {key: origin[key] for key in ("id", "object", "created", "model")
               if key in origin}
        obj["choices"] = []
        obj["usage"] = {"prompt_tokens": self.prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": self.prompt_tokens + completion_tokens}
        return b"data: " + _encode(obj) + EVENT_END
