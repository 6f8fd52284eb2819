"""What `bench_scale.py` reads from the registry under test: its own counters and
histograms (scraped from /metrics: that costs the loop nothing), a snapshot's bytes, and
/metrics scrapes inside the window on purpose (--scrape-every)."""

from __future__ import annotations

import math
import time

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from wire.protocol import Sync, make_encoder

SYNC_TIMEOUT_MS = 60_000


def heartbeats_handled(metrics_url: str) -> float:
    """The registry's own count of heartbeats handled."""
    for line in httpx.get(metrics_url, timeout=30).text.splitlines():
        if line.startswith("pdreg_heartbeats_total "):
            return float(line.split()[1])
    return math.nan


def loop_figures(metrics_url: str) -> dict[str, float]:
    """The registry's loop-turn and snapshot-build histograms (registries before them: {})."""
    figures: dict[str, float] = {}
    text = httpx.get(metrics_url, timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            le = sample.labels.get("le")
            if sample.name == "pdreg_loop_turn_seconds_bucket" and le in ("0.025", "0.1"):
                figures[f"turns_upto_{le}"] = sample.value
            elif sample.name == "pdreg_loop_turn_seconds_count":
                figures["turns"] = sample.value
            elif sample.name == "pdreg_snapshot_build_seconds_count":
                figures["snapshot_builds"] = sample.value
            elif sample.name == "pdreg_snapshot_build_seconds_sum":
                figures["snapshot_build_s"] = sample.value
    if "turns" in figures:
        figures["turns_over_25ms"] = figures["turns"] - figures.pop("turns_upto_0.025")
        figures["turns_over_100ms"] = figures["turns"] - figures.pop("turns_upto_0.1")
    return figures


def scrape_during(metrics_url: str, seconds: float, every_s: float) -> list[tuple[int, float]]:
    """Sleep `seconds`; with `every_s`, scrape /metrics that often meanwhile: the
    (bytes, seconds) of each scrape."""
    scraped: list[tuple[int, float]] = []
    end = time.monotonic() + seconds
    if every_s <= 0:
        time.sleep(seconds)
        return scraped
    while end - time.monotonic() > 0:
        t = time.perf_counter()
        body = httpx.get(metrics_url, timeout=30).content
        scraped.append((len(body), time.perf_counter() - t))
        time.sleep(max(0.0, min(every_s - (time.perf_counter() - t), end - time.monotonic())))
    return scraped


def sync_bytes(address: str) -> bytes:
    """One whole snapshot, as the registry encodes it (every model)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://{address}")
    s.send(make_encoder().encode(Sync()))
    assert s.poll(SYNC_TIMEOUT_MS), "no snapshot"
    raw = s.recv()
    s.close(linger=0)
    return raw
