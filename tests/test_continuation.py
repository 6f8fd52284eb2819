"""Continuation math: what the tap reads from relayed bytes, and the next request."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.continuation import (
    Reshaper,
    TokenTap,
    continuation_of,
    output_limit,
    why_not_migratable,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def event(obj: dict[str, Any], *, spaced: bool = False) -> bytes:
    text = json.dumps(obj) if spaced else msgspec.json.encode(obj).decode()
    return f"data: {text}\n\n".encode()


def chunk(text: str, ids: list[int] | None, *, prompt: list[int] | None = None,
          finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish, "stop_reason": None}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    choice["token_ids"] = ids
    return {"id": "cmpl-x", "object": "text_completion", "created": 7, "model": "m",
            "choices": [choice]}


def events_of(data: bytes) -> list[Any]:
    return [e[6:] if e == b"data: [DONE]" else json.loads(e[6:])
            for e in data.split(b"\n\n") if e]


# --- the tap ----------------------------------------------------------------------------

TRICKY = st.one_of(
    st.text(max_size=12),
    st.sampled_from(['"token_ids":[1,2]', "data: [DONE]", '"error": 1', "\n\n", "error",
                     '"finish_reason":"stop"', "\\", '{"error"', "prompt_token_ids"]))


@given(st.lists(st.tuples(TRICKY, st.lists(st.integers(0, 10**6), min_size=1, max_size=3)),
                min_size=1, max_size=8),
       st.lists(st.integers(0, 10**6), min_size=1, max_size=5), st.booleans(), st.booleans(),
       st.integers(1, 4))
def test_tap_reads_ids_and_strips_them_whatever_the_text(
        tokens: list[tuple[str, list[int]]], prompt: list[int], strip: bool, spaced: bool,
        reads: int) -> None:
    raw = [event(chunk(text, ids, prompt=prompt if i == 0 else None), spaced=spaced)
           for i, (text, ids) in enumerate(tokens)] + [b"data: [DONE]\n\n"]
    tap = TokenTap(strip=strip)
    forwarded = []
    size = max(1, len(raw) // reads)
    for i in range(0, len(raw), size):  # several reads of whole events
        fed = tap.feed(b"".join(raw[i:i + size]))
        assert not fed.error
        forwarded.append(fed.forward)
    assert fed.done
    assert tap.prompt_ids == prompt
    assert tap.sent_ids() == [t for _, ids in tokens for t in ids]
    got = events_of(b"".join(forwarded))
    assert got[-1] == b"[DONE]"
    for (text, ids), obj in zip(tokens, got[:-1], strict=True):
        choice = obj["choices"][0]
        assert choice["text"] == text
        assert choice["token_ids"] == (None if strip else ids)
        assert choice.get("prompt_token_ids") is None or not strip


def test_tap_stops_at_an_error_event_and_forwards_what_came_before() -> None:
    tap = TokenTap(strip=False)
    data = (event(chunk("a", [1], prompt=[9])) + event(chunk("b", [2]))
            + b'data: {"error": {"message": "boom", "code": 500}}\n\n' + b"data: [DONE]\n\n")
    fed = tap.feed(data)
    assert fed.error and not fed.done
    assert [c["choices"][0]["text"] for c in events_of(fed.forward)] == ["a", "b"]
    assert tap.sent_ids() == [1, 2]


@pytest.mark.parametrize("error", [
    b'data: {"error": {"message": "x"}}\n\n',
    b'data: {"object": "error", "message": "x", "type": "BadRequestError", "code": 400}\n\n',
])
def test_both_vllm_error_shapes_are_seen(error: bytes) -> None:
    assert TokenTap(strip=False).feed(error).error


def test_text_that_looks_like_an_error_or_the_end_is_just_text() -> None:
    tap = TokenTap(strip=False)
    fed = tap.feed(event(chunk('data: {"error": 1} data: [DONE]\n\n"object":"error"', [5])))
    assert not fed.error and not fed.done and tap.sent_ids() == [5]


def test_finish_and_usage_are_noticed() -> None:
    tap = TokenTap(strip=False, watch_usage=True)
    tap.feed(event(chunk("a", [1], finish="length")))
    assert tap.finished and not tap.usage_sent
    tap.feed(event({"id": "x", "choices": [], "usage": {"prompt_tokens": 1}}))
    assert tap.usage_sent


def test_chat_deltas_a_completion_cannot_reproduce_are_noticed() -> None:
    tap = TokenTap(strip=False, chat=True)
    tap.feed(event({"choices": [{"delta": {"reasoning_content": "hmm"}, "token_ids": [1]}]}))
    assert tap.unmigratable


# --- the next request ---------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "why"), [
    (COMPLETIONS, {"prompt": "x"}, None),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, None),
    (COMPLETIONS, {"prompt": ["a"]}, None),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "several prompts"),
    (COMPLETIONS, {"prompt": "x", "n": 2}, "n > 1"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, "n > 1"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "x", "guided_json": {"type": "object"}}, "structured output"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix"),
    (CHAT, {"messages": []}, None),
    (CHAT, {"messages": [], "response_format": {"type": "text"}}, None),
    (CHAT, {"messages": [], "response_format": {"type": "json_object"}}, "structured output"),
    (CHAT, {"messages": [], "tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"messages": [], "tools": [{"type": "function"}], "tool_choice": "none"}, None),
    (CHAT, {"messages": [], "logprobs": True}, "chat logprobs"),
])
def test_what_can_be_continued(path: str, body: dict[str, Any], why: str | None) -> None:
    assert why_not_migratable(path, body) == why


@pytest.mark.parametrize(("path", "body", "limit"), [
    (COMPLETIONS, {}, 16),  # OpenAI's and vLLM's default
    (COMPLETIONS, {"max_tokens": None}, None),
    (COMPLETIONS, {"max_tokens": 5}, 5),
    (CHAT, {}, None),
    (CHAT, {"max_tokens": 7}, 7),
    (CHAT, {"max_tokens": 7, "max_completion_tokens": 3}, 3),
])
def test_output_limit(path: str, body: dict[str, Any], limit: int | None) -> None:
    assert output_limit(path, body) == limit


def test_a_chat_continues_as_a_completion_from_ids() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_completion_tokens": 10, "min_tokens": 4, "temperature": 0, "seed": 3,
            "tools": [], "stream_options": {"include_usage": True}, "user": "u"}
    out = continuation_of(CHAT, body, [1, 2], [7, 8, 9])
    assert out == {"model": "m", "prompt": [1, 2, 7, 8, 9], "stream": True,
                   "max_tokens": 7, "min_tokens": 1, "temperature": 0, "seed": 3,
                   "stream_options": {"include_usage": True}, "user": "u",
                   "return_token_ids": True}


def test_a_completion_continues_with_what_is_left() -> None:
    body = {"model": "m", "prompt": "abc", "echo": False, "prompt_logprobs": 1}
    out = continuation_of(COMPLETIONS, body, [1], [5] * 3)
    assert out is not None
    assert out["prompt"] == [1, 5, 5, 5] and out["max_tokens"] == 13
    assert "echo" not in out and "prompt_logprobs" not in out
    assert continuation_of(COMPLETIONS, {"max_tokens": 3}, [1], [5, 5, 5]) is None
    assert continuation_of(CHAT, {"messages": []}, [1], [5])["max_tokens"] is None  # type: ignore[index]


# --- reshaping a continuation into the client's stream ---------------------------------------

def test_reshaper_keeps_one_id_and_the_chat_shape_and_adds_up_usage() -> None:
    tap = TokenTap(strip=True, chat=True)
    first = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1,
             "model": "m", "prompt_token_ids": [1, 2, 3],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tap.feed(event(first) + event({"id": "chatcmpl-a", "choices": [
        {"index": 0, "delta": {"content": "x"}, "token_ids": [4]}]}))
    shaper = Reshaper.for_stream(tap, chat=True, keep_ids=False)
    leg = (event(chunk("y", [5], prompt=[1, 2, 3, 4]) | {"id": "cmpl-b", "created": 9})
           + event(chunk("z", [6], finish="length") | {"id": "cmpl-b"})
           + event({"id": "cmpl-b", "object": "text_completion", "created": 9, "model": "m",
                    "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                             "total_tokens": 6}})
           + b"data: [DONE]\n\n")
    got = events_of(shaper.reshape(leg))
    assert got[-1] == b"[DONE]"
    assert {(e["id"], e["object"], e["created"]) for e in got[:-1]} == {
        ("chatcmpl-a", "chat.completion.chunk", 1)}
    assert [e["choices"][0]["delta"]["content"] for e in got[:2]] == ["y", "z"]
    assert got[1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["token_ids"] is None for e in got[:2])
    assert all(e.get("prompt_token_ids") is None for e in got[:-1])
    assert got[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chunks_with_ids_but_no_text_wait_for_the_text_that_completes_them() -> None:
    # vLLM's detokenizer re-emits the prompt's text when a continuation starts inside a
    # character: a cut must fall between characters, so such chunks are held back.
    tap = TokenTap(strip=False)
    fed = tap.feed(event(chunk("a", [1], prompt=[9])) + event(chunk("", [2])))
    assert [c["choices"][0]["text"] for c in events_of(fed.forward)] == ["a"]
    assert tap.sent_ids() == [1]
    fed = tap.feed(event(chunk("é", [3])))
    assert [c["choices"][0]["text"] for c in events_of(fed.forward)] == ["", "é"]
    assert tap.sent_ids() == [1, 2, 3]
    tap.feed(event(chunk("", [4])) + event(chunk("", [5])))
    tap.drop_held()  # the leg failed: the next one regenerates 4 and 5
    assert tap.sent_ids() == [1, 2, 3]
    fed = tap.feed(event(chunk("", [6], finish="length")) + b"data: [DONE]\n\n")
    assert fed.done and tap.sent_ids() == [1, 2, 3, 6]  # a finishing chunk is not held


def test_what_is_held_in_a_chat_stream() -> None:
    tap = TokenTap(strip=False, chat=True)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            "prompt_token_ids": [1]}
    fed = tap.feed(event(role))
    assert fed.forward  # the role chunk has no output ids: it goes at once
    fed = tap.feed(event({"choices": [{"delta": {}, "token_ids": [7]}]}))
    assert not fed.forward and tap.held
    fed = tap.feed(event({"choices": [{"delta": {"content": "x"}, "token_ids": [8]}]}))
    assert len(events_of(fed.forward)) == 2 and tap.sent_ids() == [7, 8]
