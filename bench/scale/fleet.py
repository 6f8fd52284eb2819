"""The simulated fleet of `bench_scale.py`: its members, their load walk, its constants.

Members are spread over MODELS models (event topics); a `probe` member of a model of its
own flips its state every PROBE_EVERY_S (a membership event whose arrival the
subscribers time); with churn, CHURN_MEMBERS `churn-*` members leave and come back as
new incarnations. Loads change on every heartbeat as agents' loads wobble.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass

from wire.protocol import Endpoints, MemberSpec, Role

MODELS = 8  # members spread over this many models (topics)
PROBE_MODEL = "probe"
PROBE_EVERY_S = 0.25
CHURN_MEMBERS = 200
WALK_STEPS = 65_521  # a prime, so a member's steps do not repeat with the fleet's order
KV_E4 = [k / 10_000 for k in range(10_001)]  # KV use as a heartbeat carries it (4 places)


def member_spec(member_id: str, model: str, i: int, incarnation: int = 1) -> MemberSpec:
    """Member `i`'s spec: a host address of its own, labels, a capacity (what a
    snapshot carries per member)."""
    host = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
    return MemberSpec(id=member_id, incarnation=incarnation,
                      role=Role.PREFILL if i % 2 else Role.DECODE, model=model,
                      protocol="reference",
                      endpoints=Endpoints(http=f"http://{host}:8000", kv_host=host,
                                          kv_port=5600),
                      labels={"zone": f"z{i % 4}", "rack": f"r{i % 32}"}, capacity=64)


@dataclass(slots=True)
class Member:
    """One simulated member as the generator (or the deadband simulation) holds it."""

    spec: MemberSpec
    nonce: bytes
    session: bytes = b""
    seq: int = 0
    running: int = 0
    kv: float = 0.0  # (the deadband simulation's walk)
    up: bool = True
    kv_e4: int = 0  # the generator's walk: KV use in units of 0.0001 (what a beat carries)


def walk_steps(rng: random.Random, n: int = WALK_STEPS) -> list[tuple[int, int]]:
    """The load walk's steps, drawn once: running requests -2..+2 (0 twice as likely) and
    KV use uniform within +-0.01 (in units of 0.0001), per beat, as agents' loads wobble."""
    return [(rng.choice((-2, -1, 0, 0, 1, 2)), round(rng.uniform(-100.0, 100.0)))
            for _ in range(n)]


class GcPauses:
    """The process's garbage collections (gc.callbacks): how many, how many were full
    ones (generation 2, the walks over everything tracked), the longest."""

    def __init__(self) -> None:
        self.count, self.full, self.max_s, self._t = 0, 0, 0.0, 0.0
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        self.count += 1
        self.full += info["generation"] == 2
        self.max_s = max(self.max_s, time.perf_counter() - self._t)

    def reset(self) -> None:
        self.count, self.full, self.max_s = 0, 0, 0.0

    def figures(self) -> dict[str, float]:
        return {"gc_count": self.count, "gc_full": self.full,
                "gc_max_ms": round(1e3 * self.max_s, 1)}


def gc_text(figures: dict[str, float]) -> str:
    return (f"{figures['gc_count']} ({figures['gc_full']} full), "
            f"max {figures['gc_max_ms']} ms")
