"""The engine's HTTP face: OpenAI routes, /metrics, and the probes peer routers make.

aiohttp.web on the event loop; request bodies are decoded and responses encoded with
msgspec. Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
/ready (SGLang's readiness, for a sidecar or a pod probe that asks it), and for
sglang-router / vllm-router start-up: /server_info (/get_server_info), /model_info
(/get_model_info), /version, /health_generate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from engine_agent.reference.engine import Engine, EngineError, Generation, new_handle
from engine_agent.reference.openai_api import (
    ChatBody,
    CompletionBody,
    ResponseShape,
    chat_request,
    completion_request,
    error_body,
)
from engine_agent.reference.tokens import Detokenizer

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


@dataclass(slots=True)
class ServerState:
    """What the HTTP side knows about the engine; the runner fills `engine` once warm."""

    role: str  # "prefill" | "decode" | "mixed"
    model: str
    model_dir: str  # an existing empty directory: peer routers look for a tokenizer there
    bootstrap_port: int = 0
    adapters: dict[str, int] = field(default_factory=dict)  # LoRA adapters: name -> id
    engine: Engine | None = None
    draining: bool = False
    started_at: float = field(default_factory=time.time)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status,
                        content_type="application/json")


def _error(message: str, status: int) -> web.Response:
    return _json(error_body(message, status), status)


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class EngineServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._completion_decoder = msgspec.json.Decoder(CompletionBody)
        self._chat_decoder = msgspec.json.Decoder(ChatBody)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        # /ready: SGLang's cheap readiness check, which its pods' probes and the sidecar
        # ask first (they fall back to /health only on 404).
        for path in ("/health", "/health_generate", "/ready"):
            app.router.add_get(path, self.health)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        app.router.add_get("/version", self.version)
        return app

    # --- generation ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        engine = self.state.engine
        if engine is None:
            return _error("the engine is still loading its model", 503)
        raw = await request.read()
        max_model_len = engine.backend.max_model_len
        try:
            handle = new_handle()
            if chat:
                body: CompletionBody | ChatBody = self._chat_decoder.decode(raw)
                gen_request = chat_request(body, role=self.state.role, new_handle=handle,
                                           max_model_len=max_model_len,
                                           adapters=self.state.adapters)
            else:
                body = self._completion_decoder.decode(raw)
                gen_request = completion_request(body, role=self.state.role,
                                                 new_handle=handle,
                                                 max_model_len=max_model_len,
                                                 adapters=self.state.adapters)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(f"invalid request body: {exc}", 400)
        except EngineError as exc:
            return _error(str(exc), exc.status)
        # vLLM's response id: the header, else the body's request_id, else its own.
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = (f"{prefix}-"
                      f"{request.headers.get(REQUEST_ID_HEADER) or body.request_id or handle}")
        try:
            generation = await engine.start(gen_request)
        except EngineError as exc:
            return _error(str(exc), exc.status)
        shape = ResponseShape(chat=chat, request_id=request_id,
                              model=body.model or self.state.model,
                              prompt=gen_request.prompt,
                              return_token_ids=body.return_token_ids,
                              cached_tokens=generation.cached_tokens)
        try:
            if body.stream:
                include_usage = bool((body.stream_options or {}).get("include_usage"))
                return await self._stream(request, generation, shape, include_usage)
            return await self._complete(generation, shape)
        finally:
            await generation.close()

    async def _complete(self, generation: Generation, shape: ResponseShape) -> web.Response:
        token_ids = [token async for token, _ in generation.tokens()]
        detok = Detokenizer.after(shape.prompt)
        text = "".join(detok.push(t) for t in token_ids) + detok.flush()
        return _json(shape.full(text, token_ids, generation.finish_reason,
                                generation.kv_transfer_params))

    async def _stream(self, request: web.Request, generation: Generation,
                      shape: ResponseShape, include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        if shape.chat:
            await response.write(_sse(shape.role_chunk()))
        detok = Detokenizer.after(shape.prompt)
        first = True
        async for token, finish in generation.tokens():
            text = detok.push(token) + (detok.flush() if finish else "")
            chunk = shape.chunk(text, [token], finish, first)
            if finish and generation.kv_transfer_params is not None:
                chunk["kv_transfer_params"] = generation.kv_transfer_params
            await response.write(_sse(chunk))
            first = False
        if include_usage:
            await response.write(_sse(shape.usage_chunk(generation.completion_tokens)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # --- probes and metrics ----------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        if self.state.engine is None:
            return web.Response(status=503, text="loading")
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        engine = self.state.engine
        max_len = engine.backend.max_model_len if engine is not None else None
        created = int(self.state.started_at)
        base = {"id": self.state.model, "object": "model", "created": created,
                "owned_by": "pdreg", "root": self.state.model, "max_model_len": max_len}
        # LoRA adapters as vLLM lists them: their own entries, `parent` the base model.
        adapters = [{**base, "id": name, "root": name, "parent": self.state.model}
                    for name in self.state.adapters]
        return _json({"object": "list", "data": [base, *adapters]})

    async def server_info(self, _: web.Request) -> web.Response:
        mode = self.state.role if self.state.role in ("prefill", "decode") else "null"
        engine = self.state.engine
        return _json({
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": self.state.bootstrap_port or None,
            "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "model_path": self.state.model_dir, "tokenizer_path": self.state.model_dir,
            "served_model_name": self.state.model,
            "max_total_num_tokens": engine.scheduler.kv_capacity_tokens if engine else None,
            "max_running_requests": engine.scheduler.max_running if engine else None,
            "version": "pdreg-reference"})

    async def model_info(self, _: web.Request) -> web.Response:
        return _json({"model_path": self.state.model_dir,
                      "tokenizer_path": self.state.model_dir, "is_generation": True,
                      "served_model_name": self.state.model})

    async def version(self, _: web.Request) -> web.Response:
        return _json({"version": "pdreg-reference"})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self.state),
                            content_type="text/plain", charset="utf-8")


def render_metrics(state: ServerState) -> str:
    """Prometheus text by hand: a few gauges, no registry to share between engines."""
    engine = state.engine
    model = f'model_name="{state.model}"'
    running = waiting = held = held_tokens = transfers = expired = total = external = 0
    prompt_tokens = hit_tokens = pulled = pulled_hits = 0
    usage = 0.0
    if engine is not None:
        sched = engine.scheduler
        running, waiting, usage = sched.running, sched.waiting, sched.kv_usage
        total, external = engine.requests_total, engine.external_kv_tokens_total
        prompt_tokens, hit_tokens = engine.prompt_tokens_total, engine.prefix_cache_hit_tokens_total
        pulled, pulled_hits = engine.pulled_tokens_total, engine.pulled_hit_tokens_total
        if engine.store is not None:
            held, held_tokens = len(engine.store.held), engine.store.held_tokens
            transfers, expired = engine.store.transferred_total, engine.store.expired_total
    rows = [
        ("vllm:num_requests_running", "gauge", model, running),
        ("vllm:num_requests_waiting", "gauge", model, waiting),
        ("vllm:kv_cache_usage_perc", "gauge", model, usage),
        ("vllm:prompt_tokens_by_source_total", "counter",
         f'{model},source="external_kv_transfer"', external),
        ("sglang:num_running_reqs", "gauge", model, running),
        ("sglang:num_queue_reqs", "gauge", model, waiting),
        ("sglang:token_usage", "gauge", model, usage),
        ("pdreg:engine_requests_total", "counter", model, total),
        # What the prefix cache really found: prompt tokens prefilled here, and of those
        # the tokens whose KV was cached. A decode's prompts pulled from a prefill are
        # counted apart (what its own cache held of them); vLLM's names count both, as
        # vLLM's decode counts its local hits on remote-prefill requests.
        ("pdreg:engine_prompt_tokens_total", "counter", model, prompt_tokens),
        ("pdreg:engine_prefix_cache_hit_tokens_total", "counter", model, hit_tokens),
        ("pdreg:engine_pulled_prompt_tokens_total", "counter", model, pulled),
        ("pdreg:engine_pulled_prompt_cached_tokens_total", "counter", model, pulled_hits),
        ("vllm:prefix_cache_queries_total", "counter", model, prompt_tokens + pulled),
        ("vllm:prefix_cache_hits_total", "counter", model, hit_tokens + pulled_hits),
        ("pdreg:kv_held_entries", "gauge", model, held),
        ("pdreg:kv_held_tokens", "gauge", model, held_tokens),
        ("pdreg:kv_transfers_total", "counter", model, transfers),
        ("pdreg:kv_expired_total", "counter", model, expired),
        ("pdreg:engine_draining", "gauge", model, int(state.draining)),
    ]
    lines = []
    for name, kind, labels, value in rows:
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


