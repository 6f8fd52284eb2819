"""The planner's rounds and HTTP face against a real HTTP server answering like a router:
decisions, their inputs and reasons in /v1/plan and /metrics, bad input held and
counted, and the --exec hook run when a decision changes."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from planner_helpers import FakeRouterMetrics, HandView, member

from pdreg.testing import wait_until
from planner.rule import Bounds, RuleConfig
from planner.service import PlannerServer
from planner.tick import Plan, PlannerConfig, PlanningLoop
from registry.client import LinkState, LiveMember
from wire.protocol import Load, Role

WAIT_S = 10.0
FAST_RULE = RuleConfig(scale_down_window_s=0.0, latency_window_s=1.0,
                       prefill=Bounds(1, 8), decode=Bounds(1, 8))


@pytest.fixture
def router_metrics() -> Iterator[FakeRouterMetrics]:
    with FakeRouterMetrics() as server:
        yield server


def fleet(router_url: str, *, prefill_load: Load, decode_load: Load | None = None,
          suspect_decode: bool = False) -> list[LiveMember]:
    return [member("prefill-a", Role.PREFILL, load=prefill_load, capacity=8),
            member("decode-a", Role.DECODE, load=decode_load or Load(), capacity=16,
                   suspect=suspect_decode),
            member("router-a", Role.API_SERVER, model="", protocol="openai", http=router_url)]


def rounds(loop: PlanningLoop, times: list[float]) -> Plan:
    async def run() -> Plan:
        async with httpx.AsyncClient(timeout=2.0) as client:
            plan = Plan()
            for now in times:
                plan = await loop.tick(client, now)
            if loop.hook is not None:  # let hook runs started by the last round finish
                await asyncio.wait_for(_hooks_done(loop), WAIT_S)
            return plan
    return asyncio.run(run())


async def _hooks_done(loop: PlanningLoop) -> None:
    assert loop.hook is not None
    while loop.hook._running:
        await asyncio.sleep(0.01)


def entry(plan: Plan, role: Role):
    return next(e for e in plan.entries if e.decision.role is role)


def test_prefill_queueing_scales_prefills(router_metrics: FakeRouterMetrics) -> None:
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=8, waiting=8)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0), view)
    plan = rounds(loop, [0.0])
    prefill, decode = entry(plan, Role.PREFILL), entry(plan, Role.DECODE)
    assert (prefill.decision.current, prefill.decision.desired) == (1, 3)  # util 2.0 / 0.7
    assert "waiting 8" in prefill.decision.why
    assert decode.decision.desired == 1
    text = loop.metrics.render().decode()
    assert 'pdreg_planner_desired_replicas{model="tiny",role="prefill"} 3.0' in text
    assert 'pdreg_planner_input_waiting{model="tiny",role="prefill"} 8.0' in text
    assert 'pdreg_planner_holding{model="tiny",role="prefill"} 0.0' in text


def test_load_is_averaged_over_the_load_window(router_metrics: FakeRouterMetrics) -> None:
    """One prefill serving one request at a time reads busy or idle, never between."""
    view = HandView()
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=3.0), view)
    for now, running in [(0.0, 1), (1.0, 0), (2.0, 1), (3.0, 0)]:
        view.set(*fleet(router_metrics.url, prefill_load=Load(running=running)))
        plan = rounds(loop, [now])
    signals = entry(plan, Role.PREFILL).signals
    assert signals is not None and signals.running == 0.5  # not 1, not 0
    assert entry(plan, Role.PREFILL).decision.desired == 1


def test_ttft_and_request_rate_come_from_the_routers(router_metrics: FakeRouterMetrics) -> None:
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=4, waiting=2)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0), view)
    router_metrics.observe_ttft("tiny", 0.02, times=100)  # before the window: not counted
    rounds(loop, [0.0])
    router_metrics.observe_ttft("tiny", 3.0, times=20)
    plan = rounds(loop, [2.0])
    signals = entry(plan, Role.PREFILL).signals
    assert signals is not None and signals.ttft_s is not None
    assert 2.5 <= signals.ttft_s <= 5.0 and signals.request_rate == pytest.approx(10.0)
    d = entry(plan, Role.PREFILL).decision
    assert d.desired == 2 and d.reason.value == "ttft", d.why  # 3 s vs 1 s, doubling at most
    assert 'pdreg_planner_input_request_rate{model="tiny"} 10.0' in loop.metrics.render().decode()


def test_itl_is_the_mean_gap_of_the_window(router_metrics: FakeRouterMetrics) -> None:
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=1),
                    decode_load=Load(running=8, kv_usage=0.5)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0), view)
    router_metrics.metrics.itl_of("tiny").observe(5.0)  # before the window: not counted
    rounds(loop, [0.0])
    for gap in [0.02] * 9 + [0.5]:  # one stall among steady tokens
        router_metrics.metrics.itl_of("tiny").observe(gap)
    plan = rounds(loop, [2.0])
    decode = entry(plan, Role.DECODE)
    assert decode.signals is not None and decode.signals.itl_s == pytest.approx(0.068)
    assert decode.decision.desired == 2 and decode.decision.reason.value == "itl"
    shown = re.search(r'^pdreg_planner_input_itl_seconds\{model="tiny"\} (\S+)$',
                      loop.metrics.render().decode(), re.MULTILINE)
    assert shown and float(shown.group(1)) == pytest.approx(0.068)


def test_a_router_that_cannot_be_read_is_left_out_and_the_others_decide(
        router_metrics: FakeRouterMetrics) -> None:
    """Router A stops answering: within --router-stale-after its last figures still
    count; past it, A is left out (a metric, a log line) and B's figures decide. Nothing
    freezes: the idle fleet scales down on B's word."""
    with FakeRouterMetrics() as other:
        view = HandView()
        members = fleet(router_metrics.url, prefill_load=Load(running=8, waiting=8))
        router_b = member("router-b", Role.API_SERVER, model="", protocol="openai",
                          http=other.url)
        view.set(*members, router_b)
        config = PlannerConfig(rule=FAST_RULE, load_window_s=0.0, router_stale_after_s=5.0)
        loop = PlanningLoop(config, view)
        assert entry(rounds(loop, [0.0]), Role.PREFILL).decision.desired == 3
        router_metrics.status = 500
        view.set(*fleet(router_metrics.url, prefill_load=Load()), router_b)  # idle now
        stale = rounds(loop, [1.0])
        assert entry(stale, Role.PREFILL).decision.desired == 1
        assert not any(e.decision.holding for e in stale.entries)
        assert any("router-a" in p and "HTTP 500" in p for p in stale.problems)
        assert 'pdreg_planner_routers{standing="stale"} 1.0' in loop.metrics.render().decode()

        left_out = rounds(loop, [7.0])
        assert not any(e.decision.holding for e in left_out.entries)
        text = loop.metrics.render().decode()
        assert 'pdreg_planner_routers{standing="left_out"} 1.0' in text
        assert 'pdreg_planner_routers{standing="read"} 1.0' in text
        assert 'pdreg_planner_input_errors_total{kind="router_unreachable"} 2.0' in text

        router_metrics.status, router_metrics.body = 200, b"garbage {{{"
        rounds(loop, [8.0])
        assert 'kind="router_bad_metrics"' in loop.metrics.render().decode()

        router_metrics.body = None
        recovered = rounds(loop, [9.0])
        assert not recovered.problems
        assert 'pdreg_planner_routers{standing="read"} 2.0' in loop.metrics.render().decode()


def test_with_no_router_readable_load_scales_up_but_nothing_scales_down(
        router_metrics: FakeRouterMetrics, caplog: pytest.LogCaptureFixture) -> None:
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=8, waiting=8)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0,
                                      router_stale_after_s=0.5), view)
    assert entry(rounds(loop, [0.0]), Role.PREFILL).decision.desired == 3
    router_metrics.status = 500
    view.set(*fleet(router_metrics.url, prefill_load=Load()))  # idle, but the only router is dark
    with caplog.at_level("INFO", logger="planner.tick"):
        held = rounds(loop, [1.0])
    assert any("router left out id=router-a" in r.message for r in caplog.records)
    prefill = entry(held, Role.PREFILL).decision
    assert (prefill.desired, prefill.holding) == (3, True)
    assert "no scale-down" in prefill.why and "latency users get is unknown" in prefill.why
    text = loop.metrics.render().decode()
    assert 'pdreg_planner_holding{model="tiny",role="prefill"} 1.0' in text
    assert 'pdreg_planner_input_errors_total{kind="no_router_readable"} 1.0' in text
    # Busier than ever: the registry's load figures still scale prefills up.
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=24, waiting=24)))
    busier = entry(rounds(loop, [2.0]), Role.PREFILL).decision
    assert busier.desired == 8 and not busier.holding


def test_a_suspect_member_holds_its_role_only(router_metrics: FakeRouterMetrics) -> None:
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=8, waiting=8),
                    decode_load=Load(running=16, kv_usage=0.9)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0), view)
    rounds(loop, [0.0])
    view.set(*fleet(router_metrics.url, prefill_load=Load(), decode_load=Load(),
                    suspect_decode=True))
    plan = rounds(loop, [1.0])
    assert entry(plan, Role.DECODE).decision.holding
    assert entry(plan, Role.DECODE).decision.desired == 2
    assert not entry(plan, Role.PREFILL).decision.holding
    assert entry(plan, Role.PREFILL).decision.desired == 1
    view.state = LinkState.SYNCING  # a resync: the last view stands
    assert not entry(rounds(loop, [2.0]), Role.PREFILL).decision.holding
    view.state = LinkState.AWAY  # the registry went silent: the view may be out of date
    assert all(e.decision.holding for e in rounds(loop, [3.0]).entries)


def test_a_registry_never_reached_is_named(router_metrics: FakeRouterMetrics) -> None:
    view = HandView(state=LinkState.SYNCING, epoch=0)
    plan = rounds(PlanningLoop(PlannerConfig(rule=FAST_RULE), view), [0.0])
    assert plan.problems == ("registry 127.0.0.1:7600: syncing, no snapshot yet",)


def test_models_that_leave_are_forgotten(router_metrics: FakeRouterMetrics) -> None:
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=1)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0), view)
    rounds(loop, [0.0])
    view.set()
    assert rounds(loop, [1.0]).entries == ()
    assert "pdreg_planner_desired_replicas{" not in loop.metrics.render().decode()


# --- the --exec hook ------------------------------------------------------------------------


def hook_script(tmp_path: Path, body: str) -> tuple[str, ...]:
    script = tmp_path / "hook.py"
    script.write_text(f"import sys, time\nlog = {str(tmp_path / 'calls')!r}\n{body}\n")
    return (sys.executable, str(script))


def test_exec_is_called_when_a_decision_changes(router_metrics: FakeRouterMetrics,
                                                tmp_path: Path) -> None:
    argv = hook_script(tmp_path, "open(log, 'a').write(' '.join(sys.argv[1:]) + '\\n')")
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=8, waiting=8)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0, exec_argv=argv), view)
    rounds(loop, [0.0, 1.0])  # the same decision twice: one call
    assert (tmp_path / "calls").read_text().splitlines() == ["tiny prefill 3"]
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=1)))
    rounds(loop, [2.0])
    assert (tmp_path / "calls").read_text().splitlines() == ["tiny prefill 3", "tiny prefill 1"]
    hook = loop.hook.status("tiny", "prefill")  # type: ignore[union-attr]
    assert hook is not None and hook.applied == 1 and not hook.last_error
    assert 'pdreg_planner_exec_total{result="ok"} 2.0' in loop.metrics.render().decode()


def test_a_failing_or_hanging_hook_is_retried_and_counted(router_metrics: FakeRouterMetrics,
                                                          tmp_path: Path) -> None:
    argv = hook_script(tmp_path, "print('scale refused'); sys.exit(3)")
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=8, waiting=8)))
    loop = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0, exec_argv=argv), view)
    rounds(loop, [0.0])
    rounds(loop, [1.0])  # tried again
    hook = loop.hook.status("tiny", "prefill")  # type: ignore[union-attr]
    assert hook is not None and hook.applied == 1 and "exit code 3" in hook.last_error
    assert "scale refused" in hook.last_error
    assert 'pdreg_planner_exec_total{result="failed"} 2.0' in loop.metrics.render().decode()

    slow = PlanningLoop(PlannerConfig(rule=FAST_RULE, load_window_s=0.0, exec_timeout_s=0.3,
                                      exec_argv=hook_script(tmp_path, "time.sleep(30)")), view)
    rounds(slow, [0.0])
    assert "killed after 0.3 s" in slow.hook.status("tiny", "prefill").last_error  # type: ignore[union-attr]
    assert 'result="timeout"' in slow.metrics.render().decode()


# --- the service ----------------------------------------------------------------------------


def test_service_serves_plan_metrics_and_health(router_metrics: FakeRouterMetrics) -> None:
    view = HandView()
    view.set(*fleet(router_metrics.url, prefill_load=Load(running=8, waiting=8),
                    decode_load=Load(running=2, kv_usage=0.95)))
    config = PlannerConfig(rule=FAST_RULE, load_window_s=0.0, interval_s=0.05)
    with PlannerServer(config, view) as server:
        assert wait_until(lambda: len(httpx.get(f"{server.url}/v1/plan").json()["decisions"])
                          == 2, WAIT_S)
        plan = httpx.get(f"{server.url}/v1/plan").json()
        assert httpx.get(f"{server.url}/health").status_code == 200
        text = httpx.get(f"{server.url}/metrics").text
    by_role = {d["role"]: d for d in plan["decisions"]}
    assert by_role["decode"]["desired"] == 2 and by_role["decode"]["reason"] == "kv_usage"
    assert by_role["prefill"]["inputs"]["waiting"] == 8
    assert plan["ttft_slo_s"] == 1.0 and plan["holding"] is False
    assert re.search(r'^pdreg_planner_desired_replicas\{model="tiny",role="decode"\} 2\.0$',
                     text, re.MULTILINE)
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing in CI: .ci/run installs the prometheus package")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
