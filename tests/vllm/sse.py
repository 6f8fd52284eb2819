"""Read an OpenAI-style SSE stream into chunks, and the token ids and text they carry.

Both shapes vLLM streams with `"return_token_ids": true`:
- completions: `choices[0].text`, `choices[0].token_ids`, and
  `choices[0].prompt_token_ids` in chunk 0;
- chat: `choices[0].delta.content`, `choices[0].token_ids`, and a top-level
  `prompt_token_ids` in chunk 0 (the role chunk, which carries no generated ids).
Some chunks have empty text and non-empty ids (byte fragments): ids are counted, never
text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

DATA_PREFIX = "data: "
DONE = "[DONE]"


@dataclass
class Streamed:
    """What one stream delivered, in order."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # `data: [DONE]` arrived

    @property
    def token_ids(self) -> list[int]:
        return [i for chunk in self.chunks for choice in chunk.get("choices", [])
                for i in choice.get("token_ids") or []]

    @property
    def text(self) -> str:
        return "".join(choice_text(choice) for chunk in self.chunks
                       for choice in chunk.get("choices", []))

    @property
    def prompt_token_ids(self) -> list[int]:
        for chunk in self.chunks:
            if chunk.get("prompt_token_ids"):
                return list(chunk["prompt_token_ids"])
            for choice in chunk.get("choices", []):
                if choice.get("prompt_token_ids"):
                    return list(choice["prompt_token_ids"])
        return []

    @property
    def ids(self) -> set[str]:
        return {chunk["id"] for chunk in self.chunks if "id" in chunk}

    @property
    def usage(self) -> dict[str, Any] | None:
        for chunk in self.chunks:
            if chunk.get("usage"):
                return dict(chunk["usage"])
        return None

    @property
    def finish_reason(self) -> str | None:
        reasons = [choice.get("finish_reason") for chunk in self.chunks
                   for choice in chunk.get("choices", []) if choice.get("finish_reason")]
        return reasons[-1] if reasons else None


def choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def events(response: httpx.Response) -> Iterator[dict[str, Any] | None]:
    """Each `data:` event as a dict; None for `[DONE]`."""
    for line in response.iter_lines():
        if not line.startswith(DATA_PREFIX):
            continue
        data = line[len(DATA_PREFIX):]
        if data == DONE:
            yield None
            return
        yield json.loads(data)


def read_stream(response: httpx.Response, into: Streamed | None = None) -> Streamed:
    """Every chunk of a 200 streaming response (into `into`, so a reader in another
    thread can watch progress)."""
    out = into if into is not None else Streamed()
    for event in events(response):
        if event is None:
            out.done = True
            break
        out.chunks.append(event)
    return out


def post_stream(url: str, body: dict[str, Any], timeout_s: float,
                headers: dict[str, str] | None = None,
                into: Streamed | None = None) -> Streamed:
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers,
                      timeout=timeout_s) as response:
        if response.status_code != 200:
            raise AssertionError(f"POST {url} answered {response.status_code}: "
                                 f"{response.read().decode(errors='replace')[:500]}")
        return read_stream(response, into)
