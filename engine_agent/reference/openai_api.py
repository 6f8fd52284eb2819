"""OpenAI-compatible request parsing and response shapes, with vLLM's and SGLang's extras.

Extras understood: `ignore_eos`, `return_token_ids` (vLLM: `prompt_token_ids` and
`token_ids`), `request_id` (vLLM: sets the response id), `seed`, `kv_transfer_params`
(vLLM P/D), `bootstrap_host`/`bootstrap_port`/`bootstrap_room` (SGLang P/D). Unknown
fields are ignored, as vLLM does by default. Unlike OpenAI, the default temperature is 0
(greedy), so tests and demos are repeatable.

What a router needs to continue a generation elsewhere is vLLM's exactly (docs/engines.md §6):
`"prompt": [ids]` is accepted, `return_token_ids` gives the ids out, and `max_tokens`
means what vLLM makes of it: absent on /v1/completions = 16, null (and absent on chat) =
up to the context length. Response shapes follow vLLM's too: `token_ids` and
`prompt_token_ids` are written as null when not asked for; a chat stream opens with a
role chunk that carries `prompt_token_ids`; the last token's chunk carries the finish
reason.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from engine_agent.reference import tokens
from engine_agent.reference.backend import SamplingParams
from engine_agent.reference.engine import EngineError, FetchKv, GenerationRequest, HoldKv
from engine_agent.reference.prefix_cache import CacheScope

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default)


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str = ""
    max_tokens: int | UnsetType | None = UNSET
    temperature: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    n: int = 1
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    request_id: str | None = None
    cache_salt: str | None = None  # vLLM's: isolates this request's prefix-cache blocks


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[Any]


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def _prompt_ids(prompt: str | list[Any]) -> list[int]:
    if isinstance(prompt, str):
        return tokens.encode(prompt)
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return tokens.encode(prompt[0])
    if prompt and all(isinstance(p, str) for p in prompt):
        raise EngineError("only one prompt per request is supported")
    try:
        return tokens.check_token_ids(prompt)
    except tokens.PromptError as exc:
        raise EngineError(str(exc)) from None


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(str(part.get("text", "")) for part in message.content
                   if part.get("type") == "text")


def _sampling(body: _Common, max_tokens: int | None, room: int) -> SamplingParams:
    """`max_tokens` None: up to the context length, which leaves `room` tokens."""
    if body.n != 1:
        raise EngineError("n must be 1")
    max_tokens = room if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise EngineError("max_tokens must be at least 1")
    temperature = 0.0 if body.temperature is None else body.temperature
    if temperature < 0:
        raise EngineError("temperature must be >= 0")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=body.seed,
                          ignore_eos=body.ignore_eos)


def _int(params: dict[str, Any], name: str) -> int:
    value = params.get(name)
    if type(value) is not int:
        raise EngineError(f"kv_transfer_params.{name} must be an integer, got {value!r}")
    return value


def _str(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise EngineError(f"kv_transfer_params.{name} must be a non-empty string, "
                          f"got {value!r}")
    return value


def _handshake(body: _Common, role: str, new_handle: str) -> tuple[
        HoldKv | None, FetchKv | None]:
    params = body.kv_transfer_params
    if params:
        if params.get("do_remote_decode"):
            return HoldKv(key=f"h:{new_handle}", vllm_handle=new_handle), None
        if params.get("do_remote_prefill"):
            handle = _str(params, "remote_request_id")
            expected = params.get("remote_num_tokens")
            return None, FetchKv(host=_str(params, "remote_host"),
                                 port=_int(params, "remote_port"), key=f"h:{handle}",
                                 engine_id=_str(params, "remote_engine_id"),
                                 expected_tokens=expected if type(expected) is int else None)
    if body.bootstrap_room is not None and role != "mixed":
        # A mixed engine serves SGLang's P/D fields as a plain request.
        key = f"r:{body.bootstrap_room}"
        if role == "prefill":
            return HoldKv(key=key), None
        if not body.bootstrap_host or not body.bootstrap_port:
            raise EngineError("bootstrap_room needs bootstrap_host and bootstrap_port")
        return None, FetchKv(host=body.bootstrap_host, port=body.bootstrap_port, key=key,
                             bootstrap=True)
    return None, None


def _scope(body: _Common, adapters: Mapping[str, int]) -> CacheScope:
    """The request's LoRA adapter (its `model`, when that names one) and cache salt."""
    if body.cache_salt is not None and not body.cache_salt:
        raise EngineError("cache_salt must be a non-empty string")  # as vLLM says
    lora_id = adapters.get(body.model)
    return CacheScope(body.model if lora_id is not None else None, lora_id, body.cache_salt)


def _request(body: _Common, prompt: list[int], max_tokens: int | None, *, role: str,
             new_handle: str, max_model_len: int,
             adapters: Mapping[str, int]) -> GenerationRequest:
    hold, fetch = _handshake(body, role, new_handle)
    params = _sampling(body, max_tokens, max_model_len - len(prompt))
    return GenerationRequest(prompt=prompt, params=params, hold=hold, fetch=fetch,
                             scope=_scope(body, adapters))


def completion_request(body: CompletionBody, *, role: str, new_handle: str,
                       max_model_len: int,
                       adapters: Mapping[str, int] | None = None) -> GenerationRequest:
    """`role` is the engine's: "prefill", "decode" or "mixed". `adapters`: the LoRA
    adapters it serves, name -> id."""
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is UNSET else body.max_tokens
    return _request(body, _prompt_ids(body.prompt), max_tokens, role=role,
                    new_handle=new_handle, max_model_len=max_model_len,
                    adapters=adapters or {})


def chat_request(body: ChatBody, *, role: str, new_handle: str, max_model_len: int,
                 adapters: Mapping[str, int] | None = None) -> GenerationRequest:
    text = tokens.chat_prompt([(m.role, _message_text(m)) for m in body.messages])
    max_tokens = body.max_completion_tokens
    if max_tokens is None and body.max_tokens is not UNSET:
        max_tokens = body.max_tokens
    return _request(body, tokens.encode(text), max_tokens, role=role, new_handle=new_handle,
                    max_model_len=max_model_len, adapters=adapters or {})


# --- Responses ---------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI's usage, with vLLM's `prompt_tokens_details.cached_tokens` (what vLLM
    writes with --enable-prompt-tokens-details): the prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "code": status}, "object": "error"}


class ResponseShape:
    """Builds one request's response objects (completion or chat, streamed or not), with
    the fields vLLM writes: token ids as null unless asked for."""

    def __init__(self, *, chat: bool, request_id: str, model: str, prompt: list[int],
                 return_token_ids: bool, cached_tokens: int = 0) -> None:
        self.chat = chat
        self.cached_tokens = cached_tokens
        self.request_id = request_id
        self.model = model
        self.prompt = prompt
        self.return_token_ids = return_token_ids
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = f"{self.object}.chunk" if chat else self.object

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def _ids(self, ids: list[int]) -> list[int] | None:
        return ids if self.return_token_ids else None

    def full(self, text: str, token_ids: list[int], finish_reason: str,
             kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                      "message": {"role": "assistant", "content": text},
                                      "finish_reason": finish_reason, "stop_reason": None,
                                      "token_ids": self._ids(token_ids)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None,
                      "prompt_token_ids": self._ids(self.prompt),
                      "token_ids": self._ids(token_ids)}
        response = self._envelope(self.object, [choice])
        if self.chat:
            response["prompt_token_ids"] = self._ids(self.prompt)
        response["usage"] = usage(len(self.prompt), len(token_ids), self.cached_tokens)
        if kv_transfer_params is not None:
            response["kv_transfer_params"] = kv_transfer_params
        return response

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk: the role, and the prompt's ids if asked."""
        chunk = self._envelope(self.chunk_object, [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}])
        chunk["prompt_token_ids"] = self._ids(self.prompt)
        return chunk

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              first: bool) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text},
                                      "logprobs": None, "finish_reason": finish_reason,
                                      "token_ids": self._ids(token_ids)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None,
                      "prompt_token_ids": self._ids(self.prompt) if first else None,
                      "token_ids": self._ids(token_ids)}
        return self._envelope(self.chunk_object, [choice])

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        response = self._envelope(self.chunk_object, [])
        response["usage"] = usage(len(self.prompt), completion_tokens, self.cached_tokens)
        return response
