"""The planner's inputs: windowed quantiles and rates from cumulative series, router
pages parsed (and refused when hostile), membership grouped per (model, role)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from planner_helpers import member

from planner.histogram import Cumulative, Window, quantile
from planner.inputs import fleet_of, routers_of
from planner.scrape import ScrapeError, metrics_url, parse_router_metrics
from planner.smoothing import LoadMeans, MeanLoad
from router.admission.metrics import AdmissionMetrics
from router.metrics import ITL_BUCKETS_S, TTFT_BUCKETS_S, RouterMetrics
from wire.protocol import Endpoints, Load, MemberState, Role

INF = math.inf


# --- histogram math ------------------------------------------------------------------------


@pytest.mark.parametrize(("counts", "q", "expected"), [
    ((10, 10, 10), 0.5, 0.5),  # all in (0, 1]: halfway up it
    ((0, 10, 10), 0.5, 1.5),  # all in (1, 2]
    ((5, 10, 10), 0.9, 1.8),  # rank 9 of 10: 4/5 of the way through (1, 2]
    ((10, 10, 10), 0.99, 0.99),
    ((0, 0, 10), 0.5, 2.0),  # in +Inf: the highest finite bound, as Prometheus answers
    ((0, 0, 0), 0.5, None),
])
def test_quantile_follows_prometheus(counts: tuple[float, ...], q: float,
                                     expected: float | None) -> None:
    assert quantile(Cumulative((1.0, 2.0, INF), counts), q) == pytest.approx(expected)


@given(st.lists(st.integers(0, 50), min_size=3, max_size=3), st.floats(0.01, 0.99),
       st.floats(0.01, 0.99))
def test_quantile_is_monotone_and_within_the_buckets(increments: list[int], q1: float,
                                                     q2: float) -> None:
    counts = tuple(float(sum(increments[:i + 1])) for i in range(3))
    h = Cumulative((0.1, 1.0, INF), counts)
    low, high = sorted((q1, q2))
    a, b = quantile(h, low), quantile(h, high)
    if counts[-1] == 0:
        assert a is None and b is None
    else:
        assert a is not None and b is not None and 0.0 <= a <= b <= 1.0


def test_a_restarted_router_counts_from_zero() -> None:
    before = Cumulative((1.0, INF), (50.0, 60.0))
    after = Cumulative((1.0, INF), (3.0, 4.0))
    assert after.minus(before) == after
    assert Cumulative((1.0, INF), (55.0, 70.0)).minus(before).counts == (5.0, 10.0)


def test_window_sums_routers_over_the_span() -> None:
    window = Window(10.0)
    key = ("ttft", "m")
    for t, (a, b) in enumerate([(0, 0), (10, 100), (20, 100), (30, 300)]):
        window.add("r1", key, Cumulative((1.0, INF), (a, a)), float(5 * t))
        window.add("r2", key, Cumulative((1.0, INF), (b, b)), float(5 * t))
    total, span = window.delta(key, 15.0) or (None, 0.0)
    # At t=15 the baseline is the sample at t=5: r1 30-10, r2 300-100.
    assert total is not None and total.total == 220.0 and span == 10.0
    assert window.delta(("ttft", "other"), 15.0) is None
    window.forget(30.0)  # nothing newer than t=20 from anyone
    assert window.delta(key, 30.0) is None


def test_cumulative_refuses_nonsense() -> None:
    for bounds, counts in [((1.0,), (1.0,)), ((2.0, 1.0, INF), (0, 0, 0)),
                           ((1.0, INF), (5.0, 4.0)), ((1.0, INF), (math.nan, 1.0))]:
        with pytest.raises(ValueError):
            Cumulative(bounds, counts)


# --- router pages --------------------------------------------------------------------------


def test_parses_what_the_router_writes() -> None:
    metrics = RouterMetrics()
    for seconds in (0.02, 0.3, 0.3, 4.0):
        metrics.ttft_of("llama").observe(seconds)
    metrics.requests_of("llama", "ok").inc(3)
    metrics.requests_of("llama", "no_capacity").inc()
    for gap in (0.02, 0.03, 0.03, 0.2):
        metrics.itl_of("llama").observe(gap)
    figures = parse_router_metrics(metrics.render().decode())
    ttft = figures.ttft["llama"]
    assert ttft.bounds == (*TTFT_BUCKETS_S, INF) and ttft.total == 4
    assert figures.requests == {"llama": 4.0}  # every outcome is an arrival
    itl = figures.itl["llama"]
    assert itl.bounds == (*ITL_BUCKETS_S, INF) and itl.total == 4
    assert figures.itl_sum["llama"] == pytest.approx(0.28)
    assert quantile(itl, 0.5) == pytest.approx(0.0375)  # rank 2 of 3 in (0.025, 0.05]


def test_parses_the_queue_wait_summed_over_classes() -> None:
    metrics = RouterMetrics()
    waits = AdmissionMetrics(metrics.registry)
    for klass, seconds in (("critical", 0.02), ("batch", 0.3), ("batch", 4.0)):
        waits.queue_wait.labels("llama", klass).observe(seconds)
    wait = parse_router_metrics(metrics.render().decode()).queue_wait["llama"]
    assert wait.total == 3 and quantile(wait, 0.5) == pytest.approx(0.25 + 0.25 * 0.5)


def test_a_router_without_the_itl_histogram_is_fine() -> None:
    assert parse_router_metrics("").itl == {}


ITL_PAGE = """# TYPE pdreg_router_itl_seconds histogram
pdreg_router_itl_seconds_bucket{le="0.02",model="m"} 3
pdreg_router_itl_seconds_bucket{le="0.05",model="m"} 9
pdreg_router_itl_seconds_bucket{le="+Inf",model="m"} 10
pdreg_router_itl_seconds_count{model="m"} 10
pdreg_router_itl_seconds_sum{model="m"} 0.4
"""


def test_parses_the_itl_histogram() -> None:
    itl = parse_router_metrics(ITL_PAGE).itl["m"]
    assert itl.counts == (3.0, 9.0, 10.0)
    assert quantile(itl, 0.5) == pytest.approx(0.02 + 0.03 * 2 / 6)


@pytest.mark.parametrize("page", [
    "this is not prometheus {{{",
    ITL_PAGE.replace("} 9", "} NaN"),
    ITL_PAGE.replace("} 9", "} -9"),
    ITL_PAGE.replace("} 9", "} 2"),  # cumulative counts going down
    ITL_PAGE.replace('le="0.05"', 'le="fast"'),
    ITL_PAGE.replace('le="+Inf"', 'le="1"'),  # no +Inf bucket
])
def test_a_bad_page_is_an_error_not_a_crash(page: str) -> None:
    with pytest.raises(ScrapeError):
        parse_router_metrics(page)


@pytest.mark.parametrize(("url", "ok"), [
    ("http://10.0.0.5:8000", True),
    ("https://router.example:443", True),
    ("http://169.254.169.254:80", False),  # cloud metadata
    ("http://[fe80::1]:8000", False),
    ("http://0.0.0.0:8000", False),
    ("file:///etc/passwd", False),
])
def test_metrics_url_refuses_what_a_member_must_not_point_at(url: str, ok: bool) -> None:
    """Whether it advertises the URL itself (`metrics`) or only its API address."""
    for endpoints in (Endpoints(http=url), Endpoints(http="http://10.0.0.5:8000",
                                                     metrics=f"{url}/metrics")):
        if ok:
            assert metrics_url(endpoints).endswith("/metrics")
        else:
            with pytest.raises(ScrapeError):
                metrics_url(endpoints)


@pytest.mark.parametrize(("endpoints", "expected"), [
    # A router with --metrics-port advertises where its page is: that is what is read.
    (Endpoints(http="http://10.0.0.5:8000", metrics="http://10.0.0.5:9100/metrics"),
     "http://10.0.0.5:9100/metrics"),
    # An older router (or one without --metrics-port) serves it on its API port.
    (Endpoints(http="http://10.0.0.5:8000"), "http://10.0.0.5:8000/metrics"),
    (Endpoints(http="http://[fd00::5]:8000", metrics="http://[fd00::5]:9100/metrics"),
     "http://[fd00::5]:9100/metrics"),
])
def test_metrics_url_is_the_advertised_one_else_the_api_address(
        endpoints: Endpoints, expected: str) -> None:
    assert metrics_url(endpoints) == expected


# --- membership ---------------------------------------------------------------------------


def test_fleet_counts_joining_and_ready_but_not_draining() -> None:
    members = [
        member("p1", Role.PREFILL, load=Load(running=2, waiting=1), capacity=4),
        member("p2", Role.PREFILL, state=MemberState.JOINING, capacity=4),
        member("p3", Role.PREFILL, state=MemberState.DRAINING, load=Load(running=9)),
        member("d1", Role.DECODE, load=Load(running=3, kv_usage=0.5)),  # no capacity
        member("d2", Role.DECODE, load=Load(running=1, kv_usage=0.1), capacity=16),
        member("m1", Role.MIXED),
        member("r1", Role.API_SERVER, model="", protocol="openai"),
    ]
    fleet = fleet_of({m.id: m for m in members})
    prefill, decode = fleet.models["tiny"][Role.PREFILL], fleet.models["tiny"][Role.DECODE]
    assert (prefill.replicas, prefill.ready, prefill.running, prefill.waiting,
            prefill.capacity) == (2, 1, 2, 1, 8)
    assert decode.capacity == 32  # d1 declares none: its role's mean
    assert decode.kv_usage == pytest.approx(0.3)
    assert fleet_of({m.id: m for m in members}, default_capacity=8).models[
        "tiny"][Role.DECODE].capacity == 24


def test_fleet_plans_both_roles_and_marks_suspect_members() -> None:
    members = [member("p1", Role.PREFILL, suspect=True), member("p2", Role.PREFILL)]
    roles = fleet_of({m.id: m for m in members}).models["tiny"]
    assert roles[Role.DECODE].replicas == 0
    assert roles[Role.PREFILL].unsure == ("p1",)


@pytest.mark.parametrize("model", ["--force", "a b", "x;rm", "-m", ""])
def test_models_whose_name_could_mislead_the_hook_are_refused(model: str) -> None:
    fleet = fleet_of({"p": member("p", Role.PREFILL, model=model)})
    assert fleet.models == {} and model in fleet.refused


def test_only_openai_api_servers_are_routers() -> None:
    members = [
        member("r2", Role.API_SERVER, model="", protocol="openai"),
        member("r1", Role.API_SERVER, model="", protocol="openai"),
        member("planner", Role.API_SERVER, model="", protocol="pdreg-planner"),
        member("r3", Role.API_SERVER, model="", protocol="openai",
               state=MemberState.DRAINING),
        member("p", Role.PREFILL),
    ]
    assert [m.id for m in routers_of({m.id: m for m in members})] == ["r1", "r2"]


def test_load_means_cover_the_window_only() -> None:
    means = LoadMeans(2.0)
    means.add("k", MeanLoad(4, 0, 0.2), 0.0)
    means.add("k", MeanLoad(0, 2, 0.4), 1.0)
    mean = means.add("k", MeanLoad(2, 0, 0.6), 2.0)
    assert (mean.running, mean.waiting, mean.kv_usage) == pytest.approx((2.0, 2 / 3, 0.4))
    mean = means.add("k", MeanLoad(0, 0, 0.0), 3.5)  # t=0 and t=1 have left the window
    assert (mean.running, mean.waiting, mean.kv_usage) == pytest.approx((1.0, 0.0, 0.3))
    assert LoadMeans(0.0).add("k", MeanLoad(7, 1, 0.5), 9.0) == MeanLoad(7, 1, 0.5)
