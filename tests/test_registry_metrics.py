"""The registry's /metrics at fleet size: a scrape grows with models, not with members."""

from __future__ import annotations

import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from registry.metrics import PER_MEMBER_SERIES_MAX, LoopStats, make_metrics_registry
from registry.protocol import Endpoints, MemberRecord, MemberSpec, MemberState, Role
from registry.published import Published

MODELS = 4


def _published(members: int, now: float, late: int = 0) -> Published:
    """`members` members over MODELS models; the first `late` last heartbeat 40 s ago."""
    records = tuple(
        MemberRecord(
            spec=MemberSpec(id=f"decode-{i}", incarnation=1,
                            role=Role.PREFILL if i % 2 else Role.DECODE, model=f"m{i % MODELS}",
                            protocol="reference",
                            endpoints=Endpoints(http=f"http://10.0.{i // 256}.{i % 256}:8000")),
            state=MemberState.READY, heartbeat_at=now - (40.0 if i < late else 0.5))
        for i in range(members))
    return Published(epoch=1, version=1, members=records, heartbeat_interval_s=1.0,
                     lease_s=3.0, self_preserving=False, taken_at=now)


def _scrape(snapshot: Published) -> dict[str, list]:
    text = generate_latest(make_metrics_registry(LoopStats(), lambda: snapshot)).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_a_scrape_does_not_grow_per_member_past_the_cap():
    now = time.time()
    small = _scrape(_published(PER_MEMBER_SERIES_MAX + 1, now))
    big = _scrape(_published(4 * PER_MEMBER_SERIES_MAX, now))
    assert {name: len(samples) for name, samples in small.items()} == {
        name: len(samples) for name, samples in big.items()}
    assert sum(len(samples) for samples in big.values()) < 1_000
    assert big["pdreg_member_heartbeat_age_seconds"] == []


def test_members_and_heartbeat_ages_are_counted_at_any_size():
    now = time.time()
    members = 4 * PER_MEMBER_SERIES_MAX
    families = _scrape(_published(members, now, late=10))
    counted = {(s.labels["role"], s.labels["model"]): s.value
               for s in families["pdreg_members"] if s.labels["state"] == "ready"}
    # even ids decode (models m0, m2), odd ones prefill (m1, m3)
    assert counted[("decode", "m0")] == counted[("prefill", "m1")] == members / MODELS
    assert counted[("prefill", "m0")] == 0
    assert sum(counted.values()) == members
    buckets = [s for s in families["pdreg_heartbeat_age_seconds"]
               if s.name == "pdreg_heartbeat_age_seconds_bucket"]
    within_lease = sum(s.value for s in buckets if s.labels["le"] == "3.0")
    everyone = sum(s.value for s in buckets if s.labels["le"] == "+Inf")
    assert (within_lease, everyone) == (members - 10, members)  # the 10 late ones stand out


def test_small_fleets_keep_a_series_per_member():
    now = time.time()
    families = _scrape(_published(3, now, late=1))
    ages = {s.labels["id"]: s.value for s in families["pdreg_member_heartbeat_age_seconds"]}
    assert set(ages) == {"decode-0", "decode-1", "decode-2"}
    assert ages["decode-0"] >= 40.0 > ages["decode-1"]
