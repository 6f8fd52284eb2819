"""Overload end to end: a real registry, sim engines as processes (1 prefill, 1 decode,
slow enough to saturate), the router with admission and three classes, and a burst of
concurrent clients far past what the budget admits at once.

What a user would notice: every request gets an answer (none hangs, none is dropped);
the critical class is served in full; sheddable requests that would miss their SLO get
429 with Retry-After; requests still queued at their class's deadline get 503 with
Retry-After; afterwards nothing is queued or reserved, and `pdreg status --router`
shows the classes, the answers and the budgets."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from reference_helpers import EngineHandle, start_engines

from pdreg.cmd_status import admission_lines
from pdreg.testing import wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from router.config import AdmissionOptions
from router.guard import LOOPBACK_ALLOW
from router.service import RouterConfig, RouterServer
from wire.protocol import MemberState

CLASSES = """
default = "standard"
[classes.critical]
priority = 2
ttft_slo_ms = 60000
[classes.standard]
priority = 1
ttft_slo_ms = 300
[classes.batch]
priority = 0
ttft_slo_ms = 100
sheddable = true
"""
PROMPT = "overload " * 24  # ~216 byte tokens on the sim; ~60 by the router's estimate
BURST = {"critical": 8, "standard": 8, "batch": 16}
ANSWER_TIMEOUT_S = 120.0
QUEUED_BEFORE_BATCH = 4


@pytest.fixture
def engines(registry: RegistryServer) -> Iterator[list[EngineHandle]]:
    slow = ["--sim-prefill-delay", "0.002", "--sim-decode-delay", "0.005"]
    handles = start_engines([
        {"role": role, "backend": "sim", "registry": registry.control_address,
         "extra_args": slow} for role in ("prefill", "decode")])
    try:
        yield handles
    finally:
        for handle in handles:
            handle.stop(timeout_s=10)


@pytest.fixture
def router(view: MembershipView, tmp_path: Path) -> Iterator[RouterServer]:
    classes = tmp_path / "classes.toml"
    classes.write_text(CLASSES)
    config = RouterConfig(port=0, policy="round_robin", allow_upstream=LOOPBACK_ALLOW,
                          admission=AdmissionOptions(classes_file=str(classes),
                                                     prefill_budget_tokens=100))
    server = RouterServer(config, view).start()
    try:
        yield server
    finally:
        server.close()


async def _post(session: aiohttp.ClientSession, url: str, klass: str
                ) -> tuple[str, int, str, bytes]:
    async with session.post(url + "/v1/completions", headers={"x-pdreg-priority": klass},
                            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                  "ignore_eos": True}) as response:
        return klass, response.status, response.headers.get("Retry-After", ""), \
            await response.read()


async def _burst(url: str) -> list[tuple[str, int, str, bytes]]:
    timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        first = await _post(session, url, "critical")  # measured: the prefills' speed
        assert first[1] == 200, first
        order = [k for k in ("critical", "standard") for _ in range(BURST[k])]
        first_wave = [asyncio.create_task(_post(session, url, k)) for k in order]
        # The batch wave arrives once a queue has formed: it would wait behind it.
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            while await _queued(session, url) < QUEUED_BEFORE_BATCH:
                await asyncio.sleep(0.01)
        batch = [_post(session, url, "batch") for _ in range(BURST["batch"])]
        return [*await asyncio.gather(*first_wave), *await asyncio.gather(*batch)]


async def _queued(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/v1/admission") as response:
        models = (await response.json())["models"]
    return sum(models["tiny"]["queued"].values()) if "tiny" in models else 0


def test_a_burst_past_capacity_is_queued_shed_and_answered(
        engines: list[EngineHandle], view: MembershipView, router: RouterServer) -> None:
    ids = [h.id for h in engines]
    wait_until(lambda: all(i in view.members() and view.members()[i].record.state
                           is MemberState.READY for i in ids), 30)
    answers = asyncio.run(_burst(router.url))
    assert len(answers) == sum(BURST.values())  # every request answered
    by = Counter((klass, status) for klass, status, _, _ in answers)
    assert by[("critical", 200)] == BURST["critical"], by
    assert by[("batch", 429)] >= 1, by  # shed at once, not after waiting
    assert all(status in (200, 429, 503) for _, status, _, _ in answers), by
    for klass, status, retry_after, body in answers:
        if status == 429:
            assert klass == "batch" and b"slo_shed" in body
        if status in (429, 503):
            assert retry_after.isdigit() and int(retry_after) >= 1, (status, body)
        if status == 503:
            assert b"queue_deadline" in body or b"queue_full" in body
    # Afterwards: nothing queued, nothing reserved, and the operator sees it.
    report = httpx.get(router.url + "/v1/admission", timeout=10).json()
    assert report["enabled"] and report["routers"] == 1
    model = report["models"]["tiny"]
    assert sum(model["queued"].values()) == 0 and model["bytes"] == 0
    assert all(m["used"] == 0 and m["requests"] == 0 for m in report["members"])
    assert model["outcomes"]["batch"].get("shed_slo", 0) == by[("batch", 429)]
    lines = admission_lines(router.url)
    assert lines[0].startswith("admission: 1 routers share each budget; classes: critical")
    assert any(line.startswith("admission, model tiny: queued") for line in lines)
    assert any(line.startswith("budget ") and "(prefill)" in line for line in lines)
