"""The reference engine offers vLLM's migration contract exactly (sim backend, in a process).

`return_token_ids` gives the ids out (null when not asked, as vLLM writes them),
`"prompt": [ids]` takes them in, `request_id` names the response, `max_tokens` means what
vLLM makes of it, and a generation continued from prompt + the ids so far is the same
generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from reference_helpers import EngineHandle, collect, read_sse, start_engine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def mixed() -> Iterator[EngineHandle]:
    with start_engine(role="mixed", backend="sim") as engine:
        yield engine


def post(engine: EngineHandle, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(engine.url + path, json={"model": "tiny", **body}, timeout=30, **kw)


def test_continuing_from_ids_gives_the_rest_exactly(mixed: EngineHandle) -> None:
    n = 20
    body = {"messages": [{"role": "user", "content": "héllo ✓"}], "max_tokens": n,
            "return_token_ids": True, "stream": True}
    whole = post(mixed, CHAT, body)
    events = read_sse(whole)
    prompt_ids = events[0]["prompt_token_ids"]  # the role chunk carries them
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ids, _ = collect(whole, True)
    assert len(ids) == n
    for k in range(1, n):
        rest = post(mixed, COMPLETIONS, {"prompt": prompt_ids + ids[:k], "max_tokens": n - k,
                                         "return_token_ids": True, "stream": True})
        assert collect(rest, True)[0] == ids[k:]


def test_token_ids_are_null_unless_asked_for(mixed: EngineHandle) -> None:
    for path, body in ((COMPLETIONS, {"prompt": "x"}),
                       (CHAT, {"messages": [{"role": "user", "content": "x"}]})):
        for stream in (False, True):
            response = post(mixed, path, {**body, "max_tokens": 3, "stream": stream})
            objects = read_sse(response) if stream else [response.json()]
            for obj in objects:
                assert obj.get("prompt_token_ids") is None
                for choice in obj["choices"]:
                    assert choice.get("token_ids") is None
                    assert choice.get("prompt_token_ids") is None


def test_the_last_token_carries_the_finish_reason(mixed: EngineHandle) -> None:
    events = read_sse(post(mixed, COMPLETIONS, {"prompt": "x", "max_tokens": 4,
                                                "stream": True, "return_token_ids": True}))
    assert [len(e["choices"][0]["token_ids"]) for e in events] == [1, 1, 1, 1]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "length"]


@pytest.mark.parametrize(("headers", "body", "want"), [
    ({}, {"request_id": "abc"}, "cmpl-abc"),
    ({"X-Request-Id": "hdr"}, {"request_id": "abc"}, "cmpl-hdr"),  # the header wins
])
def test_request_id_names_the_response(mixed: EngineHandle, headers: dict[str, str],
                                       body: dict[str, Any], want: str) -> None:
    response = post(mixed, COMPLETIONS, {"prompt": "x", "max_tokens": 2, **body},
                    headers=headers)
    assert response.json()["id"] == want
    chat = post(mixed, CHAT, {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 2, "stream": True, **body}, headers=headers)
    assert {e["id"] for e in read_sse(chat)} == {want.replace("cmpl-", "chatcmpl-")}


def test_max_tokens_means_what_vllm_makes_of_it(mixed: EngineHandle) -> None:
    def count(path: str, body: dict[str, Any]) -> int:
        response = post(mixed, path, {**body, "return_token_ids": True})
        assert response.status_code == 200, response.text
        return len(response.json()["choices"][0]["token_ids"])

    assert count(COMPLETIONS, {"prompt": "x"}) == 16  # absent: OpenAI's default
    assert count(COMPLETIONS, {"prompt": [1] * 65530, "max_tokens": None}) == 6  # null: the rest
    assert count(CHAT, {"messages": [{"role": "user", "content": "x"}],
                        "max_completion_tokens": 3, "max_tokens": 9}) == 3
