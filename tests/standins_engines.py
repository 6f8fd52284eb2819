"""Contract stand-ins for vLLM's and SGLang's P/D endpoints (their fleet: standins_fleet.py).

Each stand-in is a real aiohttp server on loopback that checks the handshake fields
exactly as the engine's contract states them (docs/engines.md §2, §3)
and answers 400 to anything else. KV "transfer" goes through a `KvHub` shared by the
stand-ins of one test: a prefill stores the prompt it processed; the decode takes it and
refuses (500, as vLLM does with kv_load_failure_policy=fail) when it is missing or is not
the prompt of its own request.

Output follows vLLM's token-id contract (docs/engines.md §6), which request migration relies on:
- a prompt is token ids: the UTF-8 bytes of the text (chat: the contents joined by
  newlines, a stand-in's chat template), or `"prompt": [ids]` as given;
- each next token is a function of every id before it (`next_token`), so continuing from
  prompt + the ids generated so far gives exactly the rest of the answer;
- `"return_token_ids": true` adds `prompt_token_ids` (completions: in the first choice,
  chat: top level of the first chunk) and `token_ids` per chunk; otherwise both are null,
  as vLLM writes them;
- the response id is `cmpl-` (chat: `chatcmpl-`) + the X-Request-Id header, else the
  body's `request_id`, else a random one; streams end with finish_reason on the last
  token's chunk, a usage chunk if asked, then `data: [DONE]`;
- `max_tokens` absent means 16 on /v1/completions; null (and absent on chat) means up to
  the context length (`max_model_len`).
SGLang stand-ins differ where real SGLang 0.5.23 does (docs/engines.md §3):
a streamed chat with `return_token_ids` is refused (400), the response id is the body's
`rid` (X-Request-Id is ignored), and every chunk carries `"usage": null`.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from wire.protocol import Role

T = TypeVar("T")

NIXL_REQUEST_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
P2P_ID = re.compile(r"^___prefill_addr_(?P<p>[^_]+:\d+)___decode_addr_(?P<d>[^_]+:\d+)_"
                    r"(?P<uid>[0-9a-f]{32})$")
KV_WAIT_S = 5.0  # how long a decode waits for its prefill's KV (SGLang, P2P: concurrent)
MAX_MODEL_LEN = 65536  # engines' default context length (StandinEngine.max_model_len)
VOCAB = 997


# --- output: each token a function of every token before it -----------------------------------

def prompt_ids(path: str, body: dict[str, Any]) -> tuple[int, ...]:
    if path.endswith("/chat/completions"):
        text = "\n".join(str(m.get("content", "")) for m in body["messages"])
        return tuple(text.encode())
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tuple(prompt.encode())
    if not all(type(t) is int and 0 <= t < VOCAB for t in prompt):
        raise Rejected("prompt token ids must be integers in the vocabulary")
    return tuple(prompt)


def _state_after(ids: tuple[int, ...] | list[int]) -> int:
    state = 17
    for token in ids:
        state = _step(state, token)
    return state


def _step(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 1) % (1 << 61)


def generate_ids(prompt: tuple[int, ...] | list[int], n: int) -> list[int]:
    """The n tokens after `prompt`: each one from a rolling hash of all before it."""
    state = _state_after(prompt)
    out = []
    for _ in range(n):
        token = (state >> 13) % VOCAB
        out.append(token)
        state = _step(state, token)
    return out


def token_text(token: int) -> str:
    return f" t{token}"


def tokens_for(prompt: str, n: int) -> list[str]:
    """The texts of the first n tokens after a text prompt (what tests expect)."""
    return [token_text(t) for t in generate_ids(tuple(prompt.encode()), n)]


# --- the KV hub -----------------------------------------------------------------------------

@dataclass
class KvHub:
    entries: dict[Any, tuple[int, ...]] = field(default_factory=dict)

    def put(self, key: Any, prompt: tuple[int, ...]) -> None:
        self.entries[key] = prompt

    async def take(self, key: Any, timeout_s: float) -> tuple[int, ...] | None:
        """Wait (polling: a stand-in, not a KV engine) for a prefill to fill `key`."""
        deadline = time.monotonic() + timeout_s
        while key not in self.entries:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.002)
        return self.entries.pop(key)


# --- the stand-in engine ------------------------------------------------------------------------

@dataclass
class Faults:
    """Failure injection. Each applies to every request until reset."""

    status: int = 0  # answer this status instead of serving
    drop: bool = False  # close the connection without an answer
    cut_after_chunks: int = -1  # stream this many chunks, then drop the connection
    error_after_chunks: int = -1  # stream this many chunks, then an error event + [DONE]
    stall_after_chunks: int = -1  # stream this many chunks, then go silent for stall_s
    stall_s: float = 3600.0
    delay_s: float = 0.0  # before answering
    token_delay_s: float = 0.0  # between streamed chunks
    answer_delay_s: float = 0.0  # after the handshake (KV handed over), before answering
    end_delay_s: float = 0.0  # between a stream's [DONE] and its end (the last chunk)


KV_REPLY = web.RequestKey("kv_reply", dict)


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


class Rejected(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StandinEngine:
    """One engine endpoint: role prefill|decode|mixed, protocol vllm-nixl|sglang|vllm-p2p."""

    def __init__(self, role: Role, protocol: str, hub: KvHub, *, model: str = "m",
                 kv_port: int = 0, bootstrap_port: int = 0) -> None:
        self.role = role
        self.protocol = protocol
        self.hub = hub
        self.model = model
        self.kv_port = kv_port
        self.bootstrap_port = bootstrap_port
        self.engine_id = uuid.uuid4().hex
        self.max_model_len = MAX_MODEL_LEN
        self.faults = Faults()
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.rejections: list[str] = []
        self.cancelled = 0  # streams whose client went away
        self.connections: dict[tuple[str, int], Any] = {}  # peer address -> its transport
        self.url = ""
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", _health)
        self.app = app

    @property
    def kv_address(self) -> str:
        return f"127.0.0.1:{self.kv_port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        self.requests.append((request.path, body, dict(request.headers)))
        if request.transport is not None:
            self.connections[request.transport.get_extra_info("peername")] = request.transport
        f = self.faults
        if f.delay_s:
            await asyncio.sleep(f.delay_s)
        if f.drop:
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        if f.status:
            return web.json_response({"error": {"message": "injected"}}, status=f.status)
        try:
            prompt = prompt_ids(request.path, body)
            check = getattr(self, f"_check_{self.protocol.replace('-', '_')}")
            if self.role is Role.MIXED:
                self._check_plain(body)
            else:
                failure = await check(request, body, prompt)
                if failure:
                    return web.json_response({"error": {"message": failure}}, status=500)
        except (Rejected, KeyError, TypeError) as exc:
            message = exc.message if isinstance(exc, Rejected) else f"bad request: {exc!r}"
            self.rejections.append(message)
            return web.json_response({"error": {"message": message}}, status=400)
        if f.answer_delay_s:
            await asyncio.sleep(f.answer_delay_s)
        return await self._generate(request, body, prompt)

    # Contract checks: return a failure string for a 500, raise Rejected for a 400.

    def _check_plain(self, body: dict[str, Any]) -> None:
        for key in ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"):
            if key in body:
                raise Rejected(f"a mixed engine got handshake field {key}")

    async def _check_vllm_nixl(self, request: web.Request, body: dict[str, Any],
                               prompt: tuple[int, ...]) -> str | None:
        params = body.get("kv_transfer_params")
        if self.role is Role.PREFILL:
            if params != NIXL_REQUEST_PARAMS:
                raise Rejected(f"prefill kv_transfer_params must be {NIXL_REQUEST_PARAMS}")
            if body.get("max_tokens") != 1 or body.get("stream") is not False:
                raise Rejected("prefill needs max_tokens=1 and stream=false")
            if "stream_options" in body:
                raise Rejected("stream_options is only allowed with stream=true")
            if "max_completion_tokens" in body and body["max_completion_tokens"] != 1:
                raise Rejected("prefill needs max_completion_tokens=1")
            request_id = uuid.uuid4().hex
            self.hub.put((self.engine_id, request_id), prompt)
            request[KV_REPLY] = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [1, 2, 3], "remote_engine_id": self.engine_id,
                "remote_request_id": request_id, "remote_host": "127.0.0.1",
                "remote_port": self.kv_port, "tp_size": 1, "transfer_mode": "pull",
            }
            return None
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            raise Rejected("decode needs the prefill's kv_transfer_params")
        for key in ("remote_engine_id", "remote_request_id", "remote_block_ids",
                    "remote_host", "remote_port", "tp_size"):
            if key not in params:
                raise Rejected(f"kv_transfer_params lacks {key}: not passed verbatim")
        stored = self.hub.entries.pop((params["remote_engine_id"],
                                       params["remote_request_id"]), None)
        if stored != prompt:
            return "KV load failed: no such blocks for this prompt"
        return None

    async def _check_sglang(self, request: web.Request, body: dict[str, Any],
                            prompt: tuple[int, ...]) -> str | None:
        host, port, room = (body.get("bootstrap_host"), body.get("bootstrap_port"),
                            body.get("bootstrap_room"))
        if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
            raise Rejected("bootstrap_room must be an integer below 2**63")
        if not isinstance(host, str) or not isinstance(port, int):
            raise Rejected("bootstrap_host and bootstrap_port are required")
        if self.role is Role.PREFILL:
            if (host, port) != ("127.0.0.1", self.bootstrap_port):
                raise Rejected(f"bootstrap {host}:{port} is not this prefill's")
            self.hub.put((host, port, room), prompt)
            return None
        stored = await self.hub.take((host, port, room), KV_WAIT_S)
        if stored != prompt:
            return "bootstrap room never filled by the prefill"
        return None

    async def _check_vllm_p2p(self, request: web.Request, body: dict[str, Any],
                              prompt: tuple[int, ...]) -> str | None:
        match = P2P_ID.match(request.headers.get("X-Request-Id", ""))
        if match is None:
            raise Rejected("X-Request-Id must encode ___prefill_addr_..___decode_addr_.._uuid")
        if self.role is Role.PREFILL:
            if match["p"] != self.kv_address or body.get("max_tokens") != 1:
                raise Rejected("prefill address mismatch or max_tokens != 1")
            self.hub.put(match["uid"], prompt)
            return None
        if match["d"] != self.kv_address:
            raise Rejected("decode address mismatch")
        stored = await self.hub.take(match["uid"], KV_WAIT_S)
        return None if stored == prompt else "no KV arrived from the prefill"

    # Generation.

    async def _generate(self, request: web.Request, body: dict[str, Any],
                        prompt: tuple[int, ...]) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        limit = body.get("max_completion_tokens") if chat else None
        if limit is None:
            limit = body.get("max_tokens", None if chat else 16)
        n = self.max_model_len - len(prompt) if limit is None else int(limit)
        if n < 1 or len(prompt) + n > self.max_model_len:
            return web.json_response({"error": {"message": "too long"}}, status=400)
        ids = generate_ids(prompt, n)
        with_ids = body.get("return_token_ids") is True
        sglang = self.protocol == "sglang"
        if sglang and chat and with_ids and body.get("stream"):
            return web.json_response({"object": "error", "message": "return_token_ids is "
                                      "not supported with streaming on /v1/chat/completions",
                                      "type": "BadRequest", "code": 400}, status=400)
        created = int(time.time())
        if sglang:
            rid = str(body.get("rid") or uuid.uuid4().hex)
        else:
            rid = (("chatcmpl-" if chat else "cmpl-") + (
                request.headers.get("X-Request-Id") or str(body.get("request_id") or "")
                or uuid.uuid4().hex))
        model = body.get("model", self.model)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                 "total_tokens": len(prompt) + n}
        if not body.get("stream"):
            text = "".join(token_text(t) for t in ids)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text},
                 "logprobs": None, "finish_reason": "length", "stop_reason": None,
                 "token_ids": ids if with_ids else None} if chat else
                {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                 "stop_reason": None, "prompt_token_ids": list(prompt) if with_ids else None,
                 "token_ids": ids if with_ids else None})
            reply: dict[str, Any] = {
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model, "choices": [choice], "usage": usage}
            if chat:
                reply["prompt_token_ids"] = list(prompt) if with_ids else None
            if KV_REPLY in request:
                reply["kv_transfer_params"] = request[KV_REPLY]
            return web.json_response(reply)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            chunk = {"id": rid, "object": obj, "created": created, "model": model,
                     "choices": choices, **({"usage": None} if sglang else {}), **extra}
            return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

        f = self.faults
        try:
            if chat:
                await response.write(event(
                    [{"index": 0, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}],
                    **({"prompt_token_ids": list(prompt)} if with_ids else {})))
            for i, token in enumerate(ids):
                if i == f.cut_after_chunks:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                if i == f.error_after_chunks:
                    await response.write(b'data: {"error": {"message": "injected", '
                                         b'"type": "InternalServerError", "code": 500}}\n\n'
                                         b"data: [DONE]\n\n")
                    return response
                if i == f.stall_after_chunks:
                    await asyncio.sleep(f.stall_s)
                finish = "length" if i == n - 1 else None
                token_ids = [token] if with_ids else None
                if chat:
                    choice = {"index": 0, "delta": {"content": token_text(token)},
                              "logprobs": None, "finish_reason": finish,
                              "token_ids": token_ids}
                else:
                    choice = {"index": 0, "text": token_text(token), "logprobs": None,
                              "finish_reason": finish, "stop_reason": None,
                              "prompt_token_ids": list(prompt) if with_ids and i == 0
                              else None, "token_ids": token_ids}
                await response.write(event([choice]))
                if f.token_delay_s:
                    await asyncio.sleep(f.token_delay_s)
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(event([], usage=usage))
            await response.write(b"data: [DONE]\n\n")
            if f.end_delay_s:
                await asyncio.sleep(f.end_delay_s)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return response
