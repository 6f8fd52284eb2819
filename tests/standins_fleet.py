"""Stand-in engines serving on a private loop, and the static membership routers read.

`Fleet` starts contract stand-ins (tests/standins_engines.py) of one protocol on a
`LoopThread` and keeps their membership in a `StaticView`, which is what the router needs
of a `MembershipView`.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from standins_engines import KvHub, StandinEngine

from registry.client import LiveMember
from registry.view_changes import Changes, ChangeTrail
from wire.protocol import Endpoints, Load, MemberRecord, MemberSpec, MemberState, Role

T = TypeVar("T")


# --- running servers on a private loop -------------------------------------------------------

class LoopThread:
    """An asyncio loop in a daemon thread; tests submit coroutines to it. Stop with close()."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="standins-loop")
        self._runners: list[web.AppRunner] = []
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application, host: str = "127.0.0.1") -> str:
        async def start() -> str:
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, 0)
            await site.start()
            self._runners.append(runner)
            port = runner.addresses[0][1]
            return f"http://{host}:{port}"
        return self.run(start())

    def close(self) -> None:
        async def stop() -> None:
            for runner in self._runners:
                await runner.cleanup()
        try:
            self.run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


# --- membership ------------------------------------------------------------------------------

def live_member(member_id: str, role: Role, url: str, *, model: str = "m",
                protocol: str = "vllm-nixl", kv_port: int = 0, bootstrap_port: int = 0,
                state: MemberState = MemberState.READY, suspect: bool = False,
                incarnation: int = 1, labels: dict[str, str] | None = None,
                load: Load | None = None, load_at: float | None = None) -> LiveMember:
    spec = MemberSpec(
        id=member_id, incarnation=incarnation, role=role, model=model, protocol=protocol,
        endpoints=Endpoints(http=url, kv_host="127.0.0.1" if kv_port or bootstrap_port else "",
                            kv_port=kv_port, bootstrap_port=bootstrap_port),
        labels=labels or {})
    load = load or Load()
    record = MemberRecord(spec=spec, state=state, suspect=suspect, load=load)
    return LiveMember(record=record, load=load,
                      load_at=time.monotonic() if load_at is None else load_at, registry="static")


class StaticView:
    """What the router needs of a MembershipView: members(), changes() and report(), for
    unit tests."""

    synced = True

    def __init__(self, members: dict[str, LiveMember] | None = None, *,
                 loads_apart: bool = False, max_steps: int = 1024) -> None:
        """`loads_apart`: list load-only changes per model, apart from membership
        changes, as the real view does (its merge tells them apart); else every change
        is listed as one."""
        self._members: dict[str, LiveMember] = dict(members or {})
        self._loads_apart = loads_apart
        self._trail: ChangeTrail[LiveMember] = ChangeTrail(self._members,
                                                           max_steps=max_steps)
        self._trail.publish(self._members, self._members)
        self.reports: list[tuple[str, int, str]] = []
        self.asked: list[str] = []  # the models whose loads readers asked for

    def members(self) -> dict[str, LiveMember]:
        return self._members

    def changes(self, since: int) -> Changes[LiveMember]:
        return self._trail.since(since)

    def loads(self, model: str, after: int, upto: int) -> frozenset[str] | None:
        return self._trail.loads(model, after, upto)

    def set(self, members: dict[str, LiveMember]) -> None:
        """The new membership, swapped by reference, with the ids that changed, as the
        real view does (found here by comparing, which only a test can afford)."""
        old, self._members = self._members, dict(members)
        changed = {i for i in old.keys() | self._members.keys()
                   if old.get(i) is not self._members.get(i)}
        loads: dict[str, list[str]] = {}
        if self._loads_apart:
            for i in sorted(changed):
                was, now = old.get(i), self._members.get(i)
                if was is not None and now is not None and was.record is now.record:
                    changed.discard(i)
                    spec = now.record.spec
                    for model in (spec.model, *spec.adapters):
                        loads.setdefault(model, []).append(i)
        self._trail.publish(self._members, changed, loads)

    def loads_confirmed_at(self, model: str) -> float:
        return -math.inf  # each member's own load_at says how current it is

    def ask(self, model: str) -> None:
        self.asked.append(model)  # (every load is current here)

    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        self.reports.append((member_id, incarnation, problem))


@dataclass
class Fleet:
    """Stand-in engines of one protocol, serving on a LoopThread, and their membership."""

    loop: LoopThread
    protocol: str
    hub: KvHub = field(default_factory=KvHub)
    engines: dict[str, StandinEngine] = field(default_factory=dict)
    view: StaticView = field(default_factory=StaticView)
    _next_port: int = 20000

    def add(self, member_id: str, role: Role, *, model: str = "m", host: str = "127.0.0.1",
            url: str = "", **member_kw: Any) -> StandinEngine:
        """`url`: what the member advertises, if not where it serves (e.g. a host name)."""
        # KV/bootstrap ports are labels here (nothing binds them): any distinct numbers.
        self._next_port += 1
        engine = StandinEngine(role, self.protocol, self.hub, model=model,
                               kv_port=self._next_port, bootstrap_port=self._next_port + 500)
        engine.url = self.loop.serve(engine.app, host)
        self.engines[member_id] = engine
        members = dict(self.view.members())
        members[member_id] = live_member(
            member_id, role, url or engine.url, model=model, protocol=self.protocol,
            kv_port=engine.kv_port, bootstrap_port=engine.bootstrap_port, **member_kw)
        self.view.set(members)
        return engine

    def remove(self, member_id: str) -> None:
        members = dict(self.view.members())
        members.pop(member_id, None)
        self.view.set(members)
