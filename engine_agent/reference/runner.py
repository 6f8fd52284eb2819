"""Start-up, registration, readiness and drain for one reference engine process.

Order: bind HTTP, KV and bootstrap sockets (ports known) -> register JOINING -> load and
warm the model -> READY, print one JSON "ready" line on stdout -> serve until SIGTERM or
SIGINT -> DRAINING, wait for in-flight requests and held KV -> bye -> exit 0.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio
from aiohttp import web

from engine_agent.reference.backend import Backend, SamplingParams
from engine_agent.reference.bootstrap import Route, RouteResolver, bootstrap_app
from engine_agent.reference.engine import Engine, GenerationRequest
from engine_agent.reference.kv_publisher import KvEventPublisher
from engine_agent.reference.kv_store import KvStore
from engine_agent.reference.kv_transfer import KvClient, KvServer
from engine_agent.reference.prefix_cache import PrefixCache
from engine_agent.reference.scheduler import Scheduler
from engine_agent.reference.server import EngineServer, ServerState
from engine_agent.reference.tokens import BYTES_TOKENIZER, encode
from registry.security import ClientCurve
from wire.protocol import (
    Endpoints,
    Handshake,
    KvEventsSpec,
    MemberSpec,
    MemberState,
    Role,
    role_name,
)

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineConfig:
    role: Role
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""  # "" = host
    kv_port: int = 0
    bootstrap_port: int = 0
    backend: str = "torch"  # "torch" | "sim"
    protocol: str = Handshake.VLLM_NIXL
    max_running: int = 8
    kv_capacity_tokens: int = 65536
    kv_lease_s: float = 30.0
    kv_fetch_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    register: bool = True
    registries: str | None = None
    token: str = ""
    curve: ClientCurve | None = None  # CURVE keys for the registry link
    threads: int = 1
    sim_prefill_s_per_token: float = 0.0
    sim_decode_s_per_token: float = 0.0
    sim_kv_bytes_per_token: int = 128
    labels: dict[str, str] = field(default_factory=dict)
    # Prefix cache (every role; a decode keeps what it pulls): on by default, like
    # vLLM's. None = as many blocks as the KV capacity holds; 0 = off.
    prefix_cache_blocks: int | None = None
    block_size: int = 16  # tokens per cached block (vLLM's GPU default)
    # Publish KV events (vLLM's wire format) for KV-aware routers: on by default, so the
    # router's default policy (`kv`) matches exactly with no flag; ports are picked (0).
    kv_events: bool = True
    kv_events_port: int = 0  # PUB port; 0 = any free one (advertised in the spec)
    kv_events_replay_port: int = 0
    # LoRA adapters served besides `model` (vLLM's --lora-modules): a request naming one
    # gets blocks of its own; the reference model has no adapter weights to apply.
    adapters: tuple[str, ...] = ()

    def adapter_ids(self) -> dict[str, int]:
        """name -> LoRA id, from 1 as vLLM numbers them (in its events' `lora_id`)."""
        return {name: i for i, name in enumerate(self.adapters, 1)}


def make_backend(config: EngineConfig) -> Backend:
    if config.backend == "sim":
        from engine_agent.reference.sim import SimBackend

        return SimBackend(prefill_s_per_token=config.sim_prefill_s_per_token,
                          decode_s_per_token=config.sim_decode_s_per_token,
                          kv_bytes_per_token=config.sim_kv_bytes_per_token)
    if config.backend == "torch":
        # torch warns at import when numpy is absent; the engine never needs numpy.
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        from engine_agent.reference.torch_backend import TorchBackend  # imports torch: slow

        return TorchBackend(config.model, threads=config.threads)
    raise ValueError(f"unknown backend {config.backend!r}; expected torch or sim")


async def _warm_up(engine: Engine) -> None:
    """One short request end to end, so the first real one does not pay for lazy init."""
    generation = await engine.start(GenerationRequest(
        prompt=encode("warm up"), params=SamplingParams(max_tokens=2, ignore_eos=True)))
    try:
        async for _ in generation.tokens():
            pass
    finally:
        await generation.close()
    engine.requests_total = engine.prompt_tokens_total = 0
    engine.prefix_cache_hit_tokens_total = 0
    engine.pulled_tokens_total = engine.pulled_hit_tokens_total = 0


async def _start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]
    return runner, bound_port


def _make_agent(config: EngineConfig, spec_for: Callable[[str, int], MemberSpec],
                load: Callable[[], Any], port: int) -> tuple[Any, MemberSpec]:
    """The registration agent (engine_agent.agent), or None with --no-register."""
    advertise = config.advertise_host or config.host
    try:
        from engine_agent.agent import Agent, default_member_id, new_incarnation
    except ImportError:
        if config.register:
            raise
        member_id = f"{role_name(config.role)}-{advertise}-{port}"
        return None, spec_for(member_id, time.time_ns())
    spec = spec_for(default_member_id(config.role, advertise, port), new_incarnation())
    if not config.register:
        return None, spec
    agent = Agent(spec, registries=config.registries, load=load, token=config.token,
                  state=MemberState.JOINING, curve=config.curve)
    return agent.start(), spec


@dataclass
class _Held:
    """What a running engine holds: closed in reverse order on the way out, whatever
    start-up reached."""

    ctx: zmq.asyncio.Context
    model_dir: str
    resolver: RouteResolver = field(default_factory=RouteResolver)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    runners: list[web.AppRunner] = field(default_factory=list)
    kv_client: KvClient | None = None
    kv_server: KvServer | None = None
    publisher: KvEventPublisher | None = None
    backend: Backend | None = None
    agent: Any = None

    async def close(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.agent is not None:
            await loop.run_in_executor(None, self.agent.stop)
        for task in self.tasks:
            task.cancel()
        for runner in reversed(self.runners):
            await runner.cleanup()
        if self.kv_server is not None:
            self.kv_server.close()
        if self.kv_client is not None:
            self.kv_client.close()
        if self.publisher is not None:
            self.publisher.close()
        await self.resolver.close()
        self.ctx.term()
        if self.backend is not None:
            self.backend.close()
        shutil.rmtree(self.model_dir, ignore_errors=True)


async def run_engine(config: EngineConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    role = role_name(config.role)
    advertise = config.advertise_host or config.host
    engine_id = uuid.uuid4().hex  # per process: a restarted prefill refuses old handles
    scheduler = Scheduler(config.max_running, config.kv_capacity_tokens)
    held = _Held(zmq.asyncio.Context(), tempfile.mkdtemp(prefix="pdreg-reference-model-"))
    held.kv_client = KvClient(held.ctx)
    store = KvStore(scheduler, config.kv_lease_s) if config.role is Role.PREFILL else None
    # Every role caches: a decode keeps the blocks it pulls, as vLLM's does (Engine).
    blocks = (config.kv_capacity_tokens // config.block_size
              if config.prefix_cache_blocks is None else config.prefix_cache_blocks)
    prefix_cache = PrefixCache(config.block_size, blocks) if blocks > 0 else None
    try:
        kv_events = (_publish_kv_events(config, advertise, held)
                     if prefix_cache is not None else None)
        bootstrap_port = 0
        if store is not None:
            held.kv_server = KvServer(held.ctx, store, engine_id, config.host, config.kv_port)
            held.tasks.append(asyncio.create_task(held.kv_server.serve()))
            held.tasks.append(asyncio.create_task(store.run_sweeper()))
            route = Route(engine_id=engine_id, kv_host=advertise, kv_port=held.kv_server.port)
            runner, bootstrap_port = await _start_site(bootstrap_app(route), config.host,
                                                       config.bootstrap_port)
            held.runners.append(runner)
        state = ServerState(role=role, model=config.model, model_dir=held.model_dir,
                            bootstrap_port=bootstrap_port, adapters=config.adapter_ids())
        runner, port = await _start_site(EngineServer(state).app(), config.host, config.port)
        held.runners.append(runner)
        url = f"http://{advertise}:{port}"
        kv_port = held.kv_server.port if held.kv_server is not None else 0
        endpoints = Endpoints(http=url, kv_host=advertise if kv_port else "",
                              kv_port=kv_port, bootstrap_port=bootstrap_port)
        # The backend first: its context length is part of what the member registers.
        held.backend = await loop.run_in_executor(None, make_backend, config)
        spec_for = functools.partial(_member_spec, config, endpoints, kv_events,
                                     held.backend.max_model_len)
        held.agent, spec = _make_agent(config, spec_for, scheduler.load, port)
        engine = Engine(held.backend, scheduler, engine_id=engine_id, store=store,
                        kv_client=held.kv_client, resolver=held.resolver, kv_host=advertise,
                        kv_port=kv_port, fetch_timeout_s=config.kv_fetch_timeout_s,
                        prefix_cache=prefix_cache,
                        publish=held.publisher.publish if held.publisher else None)
        await _warm_up(engine)
        state.engine = engine
        if held.agent is not None:
            held.agent.set_state(MemberState.READY)
        _announce_ready(spec, engine_id, held.backend.name, endpoints, kv_events)
        await stop.wait()
        state.draining = True
        drained = await _drain(engine, held.agent, config.drain_timeout_s)
        logger.info("[shutdown] engine id=%s drained=%s", spec.id, drained)
        return 0
    finally:
        await held.close(loop)


def _publish_kv_events(config: EngineConfig, advertise: str, held: _Held
                       ) -> KvEventsSpec | None:
    """Start the KV event publisher (unless --no-kv-events): what the registration says."""
    if not config.kv_events:
        return None
    held.publisher = publisher = KvEventPublisher(config.host, config.kv_events_port,
                                                  config.kv_events_replay_port)
    return KvEventsSpec(endpoint=f"tcp://{advertise}:{publisher.port}",
                        replay_endpoint=f"tcp://{advertise}:{publisher.replay_port}",
                        block_size=config.block_size, hash_scheme="pdreg:content",
                        tokenizer=BYTES_TOKENIZER)


def _member_spec(config: EngineConfig, endpoints: Endpoints, kv_events: KvEventsSpec | None,
                 max_model_len: int, member_id: str, incarnation: int) -> MemberSpec:
    return MemberSpec(
        id=member_id, incarnation=incarnation, role=config.role, model=config.model,
        protocol=config.protocol, endpoints=endpoints, capacity=config.max_running,
        labels=config.labels, started_at=time.time(), kv_events=kv_events,
        adapters=config.adapters, max_model_len=max_model_len)


def _announce_ready(spec: MemberSpec, engine_id: str, backend: str, endpoints: Endpoints,
                    kv_events: KvEventsSpec | None) -> None:
    """Log it, and print the line test harnesses and the demo wait for on stdout."""
    logger.info("[engine] ready id=%s role=%s backend=%s url=%s kv_port=%d "
                "bootstrap_port=%d", spec.id, role_name(spec.role), backend, endpoints.http,
                endpoints.kv_port, endpoints.bootstrap_port)
    print(json.dumps({"event": "ready", "id": spec.id, "engine_id": engine_id,
                      "url": endpoints.http, "kv_port": endpoints.kv_port,
                      "bootstrap_port": endpoints.bootstrap_port,
                      "kv_events": kv_events.endpoint if kv_events else "",
                      "kv_events_replay": kv_events.replay_endpoint if kv_events else "",
                      "pid": os.getpid()}), flush=True)


async def _drain(engine: Engine, agent: Any, timeout_s: float) -> bool:
    """DRAINING until nothing is in flight (requests, KV not yet pulled) or the timeout."""
    loop = asyncio.get_running_loop()
    if agent is not None:
        # Agent.drain blocks (it polls in_flight and says bye); it reads an int we own,
        # which is safe to read from its thread.
        return bool(await loop.run_in_executor(
            None, agent.drain, lambda: engine.in_flight, timeout_s))
    deadline = loop.time() + timeout_s
    while engine.in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    return engine.in_flight == 0


def run(config: EngineConfig) -> int:
    """Run one engine on uvloop (when installed) until it is told to stop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_engine(config))
    return uvloop.run(run_engine(config))
