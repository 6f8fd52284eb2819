"""What `make test-sglang` sends and how it compares: requests to real SGLang, token ids.

Token ids as real SGLang 0.5.23 gives them (docs/engines.md §3):
completions `return_token_ids` -> `choices[0].token_ids` (every chunk when streaming);
chat `return_token_ids` -> `choices[0].response_token_ids` (not streaming); a chat stream
refuses `return_token_ids`, so it asks `return_output_ids_in_sglext` and reads
`sglext.output_ids` from its last chunk.

Every case's prompt starts with its own name, so no request hits another's prefix cache.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from engine_agent.probes import parse_gauges

MAX_TOKENS = 16
LOAD_MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 120.0
SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
PROMPT_TOKENS = "sglang:prompt_tokens_total"


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Case:
    name: str
    chat: bool
    stream: bool

    @property
    def prompt(self) -> str:
        return f"{self.name}: the registry keeps the live membership of every engine"


CASES = (
    Case("completion", chat=False, stream=False),
    Case("completion-stream", chat=False, stream=True),
    Case("chat", chat=True, stream=False),
    Case("chat-stream", chat=True, stream=True),
)


def client(base_url: str) -> openai.OpenAI:
    # No retries: a request that needed one is a failure this check must see.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused",
                         timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _extra(obj: Any, name: str) -> Any:
    """An SGLang field the openai types do not declare (kept in model_extra)."""
    return (getattr(obj, "model_extra", None) or {}).get(name)


def run_case(api: openai.OpenAI, model: str, case: Case) -> Output:
    usage = {"stream_options": {"include_usage": True}} if case.stream else {}
    if case.chat:
        messages = [{"role": "user", "content": case.prompt}]
        ids_flag = "return_output_ids_in_sglext" if case.stream else "return_token_ids"
        extra = {"ignore_eos": True, ids_flag: True}
        reply = api.chat.completions.create(model=model, messages=messages, stream=case.stream,
                                            extra_body=extra, **SAMPLING, **usage)
        if case.stream:
            return _collect(reply, lambda c: c.delta.content, chat=True)
        choice = reply.choices[0]
        return _finished(reply, _extra(choice, "response_token_ids"), choice.message.content)
    extra = {"ignore_eos": True, "return_token_ids": True}
    reply = api.completions.create(model=model, prompt=case.prompt, stream=case.stream,
                                   extra_body=extra, **SAMPLING, **usage)
    if case.stream:
        return _collect(reply, lambda c: c.text, chat=False)
    choice = reply.choices[0]
    return _finished(reply, _extra(choice, "token_ids"), choice.text)


def _finished(reply: Any, token_ids: Any, text: str | None) -> Output:
    assert isinstance(token_ids, list), f"no token ids in the reply: {reply}"
    assert reply.usage is not None, f"no usage in the reply: {reply}"
    return Output(token_ids=token_ids, text=text or "", prompt_tokens=reply.usage.prompt_tokens,
                  completion_tokens=reply.usage.completion_tokens)


def _collect(stream: Any, text_of: Callable[[Any], str | None], *, chat: bool) -> Output:
    out = Output()
    for chunk in stream:
        for choice in chunk.choices:
            out.text += text_of(choice) or ""
            if not chat:
                out.token_ids.extend(_extra(choice, "token_ids") or [])
        sglext = _extra(chunk, "sglext") or {}
        if chat and sglext.get("output_ids"):
            out.token_ids.extend(sglext["output_ids"][0])
        if chunk.usage is not None:
            out.prompt_tokens = chunk.usage.prompt_tokens
            out.completion_tokens = chunk.usage.completion_tokens
    assert out.prompt_tokens > 0, "the stream carried no usage chunk (stream_options)"
    return out


def metric_samples(url: str, names: list[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    response.raise_for_status()
    return parse_gauges(response.text, names)


def prompt_tokens(url: str) -> float:
    """An SGLang server's prompt tokens computed so far (prefill counts each it ran)."""
    return sum(value for _, value in metric_samples(url, [PROMPT_TOKENS]).get(PROMPT_TOKENS, []))


def open_posts(url: str) -> float:
    """Generation requests an SGLang server holds open right now (live)."""
    name = "sglang:http_requests_active"
    return sum(value for labels, value in metric_samples(url, [name]).get(name, [])
               if labels.get("method") == "POST")


@dataclass
class RouterCounts:
    picks: dict[tuple[str, str], float]  # (member, role) -> times chosen
    retries: float  # a leg failed before the client got anything: tried on a new pair
    migrations: float  # a stream under way continued on a new pair

    @classmethod
    def read(cls, router_url: str) -> RouterCounts:
        names = ["pdreg_router_picks_total", "pdreg_router_retries_total",
                 "pdreg_router_migrations_total"]
        samples = metric_samples(router_url, names)
        picks = {(labels.get("member", ""), labels.get("role", "")): value
                 for labels, value in samples.get("pdreg_router_picks_total", [])}

        def total(name: str) -> float:
            return sum(value for _, value in samples.get(name, []))
        return cls(picks, total("pdreg_router_retries_total"),
                   total("pdreg_router_migrations_total"))

    def picked(self, before: RouterCounts, role: str) -> dict[str, float]:
        """Members of `role` chosen since `before`, with how often."""
        grown = {member: value - before.picks.get((member, r), 0.0)
                 for (member, r), value in self.picks.items() if r == role}
        return {member: n for member, n in grown.items() if n > 0}


# --- load: many completions at once, each checked against a reference -------------------


LOAD_PROMPTS = 4


def load_body(i: int) -> dict[str, Any]:
    """Request i of a load run: LOAD_PROMPTS distinct prompts, every other one streamed."""
    return {"model": "tiny", "prompt": f"load {i % LOAD_PROMPTS}: prefill and decode apart",
            "max_tokens": LOAD_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": i % 2 == 1}


def complete(url: str, body: dict[str, Any]) -> list[int]:
    """POST /v1/completions and return the generated ids; raise on any failure a client
    would notice (status, an error event in the stream, a short answer)."""
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        return list(response.json()["choices"][0]["token_ids"])
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        done = False
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event mid-stream: {event['error']}")
            for choice in event.get("choices", []):
                ids.extend(choice.get("token_ids") or [])
        if not done:
            raise RuntimeError("stream ended without [DONE]")
    return ids


class LoadRun:
    """`total` requests from `threads` clients; each outcome "ok" or what went wrong."""

    def __init__(self, url: str, total: int, threads: int,
                 reference: dict[int, list[int]]) -> None:
        self.url, self.total, self.reference = url, total, reference
        self.outcomes: dict[int, str] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(threads)]

    def start(self) -> LoadRun:
        for thread in self._threads:
            thread.start()
        return self

    def done(self) -> int:
        return len(self.outcomes)

    def join(self, timeout_s: float) -> None:
        for thread in self._threads:
            thread.join(timeout_s)

    def failures(self) -> dict[int, str]:
        return {i: outcome for i, outcome in self.outcomes.items() if outcome != "ok"}

    def _client(self) -> None:
        while True:
            with self._lock:
                i, self._next = self._next, self._next + 1
            if i >= self.total:
                return
            try:
                ids = complete(self.url, load_body(i))
                expected = self.reference[i % LOAD_PROMPTS]
                outcome = "ok" if ids == expected else f"ids {ids} != reference {expected}"
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            self.outcomes[i] = outcome


def load_references(url: str) -> dict[int, list[int]]:
    """The load prompts' ids from one plain server."""
    reference = {i: complete(url, {**load_body(i), "stream": False})
                 for i in range(LOAD_PROMPTS)}
    for i, ids in reference.items():
        assert len(ids) == LOAD_MAX_TOKENS, (i, ids)
    return reference


def scheduler_holds(url: str) -> dict[str, int]:
    """What an SGLang server's scheduler holds right now, from GET /v1/loads (live, unlike
    the /metrics gauges): running, waiting, and the P/D hand-off queues, non-zero only."""
    response = httpx.get(f"{url}/v1/loads", timeout=5)
    response.raise_for_status()
    held: dict[str, int] = {}
    for rank in response.json()["loads"]:
        queues = {"running": rank.get("num_running_reqs"),
                  "waiting": rank.get("num_waiting_reqs"),
                  **(rank.get("disaggregation") or {})}
        for key, value in queues.items():
            if key.endswith("_reqs") or key in ("running", "waiting"):
                held[key] = held.get(key, 0) + int(value or 0)
    return {key: value for key, value in held.items() if value}
