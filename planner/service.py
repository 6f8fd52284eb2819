"""The planner as a service: planning rounds every interval, and its HTTP face.

    GET /v1/plan   every (model, role): now, desired, why, the inputs used, the hook
    GET /metrics   Prometheus (planner.metrics)
    GET /health    liveness: 200 while the loop answers

Everything runs on one event loop in a background thread (`ServingThread`); the same
class serves tests (port 0, start/close) and `pdreg planner`. The endpoints only read:
what a stranger who reaches the port learns is what /metrics publishes anyway, and
nothing it sends changes a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from planner.tick import MembershipSource, Plan, PlannerConfig, PlanningLoop
from serving.http_messages import Request, Response
from serving.http_server import HttpApp
from serving.lifecycle import ServingThread, ShutdownState

__all__ = ["PlannerServer", "plan_json"]

logger = logging.getLogger(__name__)

def plan_json(plan: Plan, config: PlannerConfig) -> dict[str, Any]:
    """The /v1/plan document (also what `pdreg plan --json` prints)."""
    rule = config.rule
    decisions = []
    for entry in plan.entries:
        d, s, hook = entry.decision, entry.signals, entry.hook
        decisions.append({
            "model": d.model, "role": d.role_name, "now": d.current, "desired": d.desired,
            "recommended": d.recommended, "reason": d.reason.value, "why": d.why,
            "holding": d.holding,
            "inputs": None if s is None else {
                "replicas": s.replicas, "running": s.running, "waiting": s.waiting,
                "capacity": s.capacity, "utilization": _finite(s.utilization),
                "kv_usage": s.kv_usage, "ttft_s": _finite(s.ttft_s),
                "itl_s": _finite(s.itl_s), "request_rate": _finite(s.request_rate)},
            "exec": None if hook is None else {
                "applied": hook.applied, "running": hook.running,
                "last_error": hook.last_error},
        })
    return {
        "updated_at": plan.updated_at,
        "interval_s": config.interval_s,
        "ttft_slo_s": rule.ttft_slo_s,
        "itl_slo_s": rule.itl_slo_s,
        "latency_quantile": config.latency_quantile,
        "holding": any(e.decision.holding for e in plan.entries),
        "problems": list(plan.problems),
        "decisions": decisions,
    }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class PlannerServer:
    def __init__(self, config: PlannerConfig, view: MembershipSource, *,
                 host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.host = host
        self.rounds = PlanningLoop(config, view)
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        app = HttpApp()
        app.add("GET", "/v1/plan", self._handle_plan)
        app.add("GET", "/metrics", self._handle_metrics)
        app.add("GET", "/health", self._handle_health)
        app.on_startup.append(self._start_rounds)
        app.on_cleanup.append(self._stop_rounds)
        self._serving = ServingThread(app, host, port, name="pdreg-planner")

    @property
    def port(self) -> int:
        return self._serving.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> PlannerServer:
        """Bind, serve and start planning; returns once the socket accepts connections.
        On a started planner it does nothing."""
        if self._serving.started:
            return self
        self._serving.start()
        logger.info("[planner] serving url=%s interval=%.1fs", self.url, self.config.interval_s)
        return self

    async def _start_rounds(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run_rounds())

    async def _run_rounds(self) -> None:
        async with httpx.AsyncClient(timeout=self.config.scrape_timeout_s,
                                     trust_env=False) as client:
            while True:
                started = self._clock()
                try:
                    await self.rounds.tick(client, started)
                except Exception:  # a bug in a round must not stop planning
                    logger.exception("[planner] round failed; next in %.1fs",
                                     self.config.interval_s)
                elapsed = self._clock() - started
                await asyncio.sleep(max(0.0, self.config.interval_s - elapsed))

    async def _handle_plan(self, request: Request) -> Response:
        return Response(200, msgspec.json.encode(plan_json(self.rounds.plan, self.config)))

    async def _handle_metrics(self, request: Request) -> Response:
        return Response(200, self.rounds.metrics.render(),
                        content_type="text/plain; version=0.0.4")

    async def _handle_health(self, request: Request) -> Response:
        return Response(200, b'{"status":"ok"}')

    def close(self) -> None:
        """Stop planning (a running hook is killed), stop serving. Safe twice."""
        if self._serving.state is ShutdownState.STOPPED:
            return
        self._serving.close()
        logger.info("[planner] stopped")

    async def _stop_rounds(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.rounds.hook is not None:
            await self.rounds.hook.close()

    def __enter__(self) -> PlannerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
