"""Shared test settings."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from reference_helpers import EngineHandle
from standins_fleet import LoopThread

from registry.client import MembershipView
from registry.server import RegistryConfig, RegistryServer
from router.guard import LOOPBACK_ALLOW
from router.kv.routing import KvOptions
from router.service import RouterConfig, RouterServer

# Deterministic in CI: the same examples every run, no flaky deadline failures.
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


RegistryFactory = Callable[..., RegistryServer]


@pytest.fixture
def registry_factory() -> Iterator[RegistryFactory]:
    """Starts real registries on OS-chosen loopback ports: quick timings (0.2 s, lease
    1 s) unless a test overrides any `RegistryConfig` field; every one is closed at the
    end."""
    started: list[RegistryServer] = []

    def start(**overrides: Any) -> RegistryServer:
        config = RegistryConfig(port=0, events_port=0, http_port=0,
                                heartbeat_interval_s=0.2, lease_s=1.0)
        started.append(RegistryServer(dataclasses.replace(config, **overrides)).start())
        return started[-1]
    try:
        yield start
    finally:
        for server in started:
            server.close()


@pytest.fixture
def registry(registry_factory: RegistryFactory) -> RegistryServer:
    """A real registry with quick timings (0.2 s, lease 1 s)."""
    return registry_factory()


@pytest.fixture
def view(registry: RegistryServer) -> Iterator[MembershipView]:
    """A MembershipView of `registry`, closed after the test."""
    v = MembershipView(registry.control_address).start()
    try:
        yield v
    finally:
        v.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    """An event loop on its own thread, for stand-in engines."""
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


@pytest.fixture
def routers() -> Iterator[list[RouterServer]]:
    """Routers a test starts (append them); every one is closed at the end."""
    servers: list[RouterServer] = []
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def kv_router(view: MembershipView) -> Iterator[RouterServer]:
    """A `--policy kv` router on the registry's view in which every request takes its
    prefill leg (no conditional disaggregation): a decode that keeps what it pulls would
    otherwise serve repeats alone, and these tests check the prefill's choice and hits."""
    config = RouterConfig(port=0, policy="kv", allow_upstream=LOOPBACK_ALLOW,
                          kv=KvOptions(disagg_min_uncached_tokens=0))
    server = RouterServer(config, view).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def handles() -> Iterator[list[EngineHandle]]:
    """Reference engines a test starts (append them); each is stopped at the end."""
    started: list[EngineHandle] = []
    try:
        yield started
    finally:
        for handle in started:
            handle.stop(timeout_s=10)
