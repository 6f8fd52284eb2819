"""Reading a router's /metrics: the TTFT and ITL histograms and the request counter.

Names (CONTRACT.md, the router's side): `pdreg_router_ttft_seconds{model}`,
`pdreg_router_itl_seconds{model}` (histograms; of ITL the planner uses the mean, from
`_sum` and `_count`), `pdreg_router_requests_total{model, outcome}` (every outcome is an
arrival, 503s included), `pdreg_router_queue_wait_seconds{model, class}` (admission's
queue wait, summed over classes). A router is another process the
planner does not trust blindly: the body is size-capped, every number must be finite,
and a page that does not parse is an error the caller counts, never a crash.
"""

from __future__ import annotations

import ipaddress
import math
from collections import defaultdict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from planner.histogram import Cumulative
from wire.protocol import Endpoints

__all__ = ["MAX_BODY_BYTES", "RouterFigures", "ScrapeError", "fetch_metrics",
           "metrics_url", "parse_router_metrics"]

TTFT_FAMILY = "pdreg_router_ttft_seconds"
ITL_FAMILY = "pdreg_router_itl_seconds"
REQUESTS_FAMILY = "pdreg_router_requests"  # the parser drops the counter's `_total`
QUEUE_WAIT_FAMILY = "pdreg_router_queue_wait_seconds"
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_MODELS_PER_ROUTER = 1024
MAX_BUCKETS = 128


class ScrapeError(Exception):
    """A router's metrics could not be read or made no sense; the message says which."""


@dataclass(frozen=True, slots=True)
class RouterFigures:
    """One router's cumulative figures, per model."""

    ttft: dict[str, Cumulative] = field(default_factory=dict)
    itl: dict[str, Cumulative] = field(default_factory=dict)
    itl_sum: dict[str, float] = field(default_factory=dict)  # seconds, all gaps
    requests: dict[str, float] = field(default_factory=dict)
    queue_wait: dict[str, Cumulative] = field(default_factory=dict)  # all classes


def metrics_url(endpoints: Endpoints) -> str:
    """Where the router serves /metrics: the URL it advertises (`endpoints.metrics`, a
    router with --metrics-port), else its API address (older routers, or one without
    --metrics-port). Refuses what a planner must never fetch.

    A member's addresses come from its registration. Link-local addresses (cloud metadata
    services live there) are refused, so a registered member cannot point the planner at
    them.
    """
    advertised = endpoints.metrics
    url = advertised or endpoints.http
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"router address {url!r} is not http(s)://host:port")
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:
        address = None
    if address is not None and (address.is_link_local or address.is_multicast
                                or address.is_unspecified):
        raise ScrapeError(f"router address {url!r} is link-local, multicast or "
                          "unspecified: not scraped")
    return advertised or f"{parts.scheme}://{parts.netloc}/metrics"


async def fetch_metrics(client: httpx.AsyncClient, url: str) -> str:
    """GET the page, at most MAX_BODY_BYTES; ScrapeError on anything but 200 text."""
    try:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ScrapeError(f"{url}: HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise ScrapeError(f"{url}: more than {MAX_BODY_BYTES} bytes")
    except httpx.HTTPError as exc:
        raise ScrapeError(f"{url}: {type(exc).__name__}: {exc}") from None
    return body.decode("utf-8", errors="replace")


def parse_router_metrics(text: str) -> RouterFigures:
    """The figures the planner reads; ScrapeError if the page is not Prometheus text."""
    buckets: dict[str, dict[str, dict[float, float]]] = {
        TTFT_FAMILY: defaultdict(dict), ITL_FAMILY: defaultdict(dict),
        QUEUE_WAIT_FAMILY: defaultdict(dict)}
    requests: dict[str, float] = defaultdict(float)
    itl_sum: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in buckets and family.type == "histogram":
                for sample in family.samples:
                    model = sample.labels.get("model", "")
                    if sample.name.endswith("_bucket"):
                        bound = float(sample.labels.get("le", "nan"))
                        held = buckets[family.name][model]  # classes add up
                        held[bound] = held.get(bound, 0.0) + _finite(sample.value)
                    elif family.name == ITL_FAMILY and sample.name.endswith("_sum"):
                        itl_sum[model] = _finite(sample.value)
            elif family.name == REQUESTS_FAMILY and family.type == "counter":
                for sample in family.samples:
                    if sample.name == f"{REQUESTS_FAMILY}_total":
                        requests[sample.labels.get("model", "")] += _finite(sample.value)
        figures = RouterFigures(ttft=_histograms(buckets[TTFT_FAMILY]),
                                itl=_histograms(buckets[ITL_FAMILY]), itl_sum=itl_sum,
                                requests=dict(requests),
                                queue_wait=_histograms(buckets[QUEUE_WAIT_FAMILY]))
    except (ValueError, TypeError, IndexError) as exc:
        raise ScrapeError(f"not Prometheus text the router writes: {exc}") from None
    models = set(figures.ttft) | set(figures.itl) | set(figures.requests)
    if len(models) > MAX_MODELS_PER_ROUTER:
        raise ScrapeError(f"{len(models)} models on one router (at most "
                          f"{MAX_MODELS_PER_ROUTER})")
    return figures


def _finite(value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"sample value {value} is not a finite count")
    return value


def _histograms(per_model: dict[str, dict[float, float]]) -> dict[str, Cumulative]:
    out = {}
    for model, by_bound in per_model.items():
        if any(math.isnan(b) for b in by_bound):
            raise ValueError(f"a bucket of model {model!r} has no numeric `le`")
        if len(by_bound) > MAX_BUCKETS:
            raise ValueError(f"model {model!r} has {len(by_bound)} buckets")
        bounds = tuple(sorted(by_bound))
        out[model] = Cumulative(bounds, tuple(by_bound[b] for b in bounds))
    return out
