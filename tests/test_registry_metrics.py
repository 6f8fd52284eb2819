"""The registry's /metrics at fleet size: a scrape grows with models, not with members;
and the HTTP side's snapshot, which the scrape reads, is built when someone reads it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from membership_ops import Fleet, spec
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from raw_member import RawMember

from registry.membership import Membership
from registry.metrics import PER_MEMBER_SERIES_MAX, LoopStats, make_metrics_registry
from registry.server import SNAPSHOT_PERIOD_S, RegistryConfig, RegistryServer
from wire.protocol import ReplyStatus, Role

MODELS = 4


def _fleet(members: int, now: float, late: int = 0) -> Fleet:
    """`members` members over MODELS models; the first `late` last heartbeat 40 s ago."""
    fleet = Fleet()
    for i in range(members):
        role = Role.PREFILL if i % 2 else Role.DECODE
        fleet.join(spec(f"decode-{i}", 1, model=f"m{i % MODELS}", role=role), now=now - 40.0)
    for i in range(late, members):
        fleet.beat(f"decode-{i}", 1, now=now - 0.5)
    return fleet


def _scrape(fleet: Membership, now: float) -> dict[str, list]:
    figures = fleet.figures(now, PER_MEMBER_SERIES_MAX)
    text = generate_latest(make_metrics_registry(LoopStats(), lambda: figures,
                                                 clock=lambda: now)).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_a_scrape_does_not_grow_per_member_past_the_cap():
    now = 100.0
    small = _scrape(_fleet(PER_MEMBER_SERIES_MAX + 1, now), now)
    big = _scrape(_fleet(4 * PER_MEMBER_SERIES_MAX, now), now)
    assert {name: len(samples) for name, samples in small.items()} == {
        name: len(samples) for name, samples in big.items()}
    assert sum(len(samples) for samples in big.values()) < 1_000
    assert big["pdreg_member_heartbeat_age_seconds"] == []


def test_members_and_heartbeat_ages_are_counted_at_any_size():
    now = 100.0
    members = 4 * PER_MEMBER_SERIES_MAX
    families = _scrape(_fleet(members, now, late=10), now)
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
    now = 100.0
    families = _scrape(_fleet(3, now, late=1), now)
    ages = {s.labels["id"]: s.value for s in families["pdreg_member_heartbeat_age_seconds"]}
    assert set(ages) == {"decode-0", "decode-1", "decode-2"}
    assert ages["decode-0"] >= 40.0 > ages["decode-1"]


def _snapshot_builds(registry: RegistryServer) -> float:
    text = httpx.get(f"{registry.http_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdreg_snapshot_build_seconds_count":
                return sample.value
    raise AssertionError("pdreg_snapshot_build_seconds not exposed")


def test_the_http_snapshot_is_built_for_readers_not_per_change():
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0)).start()
    members = [RawMember(registry.control_address, member_id=f"decode-127.0.0.1-{9100 + i}")
               for i in range(5)]
    try:
        before = _snapshot_builds(registry)
        for member in members:  # five membership changes, nobody reading
            assert member.register().status is ReplyStatus.OK
            time.sleep(0.05)  # (old registries built one per change, 20 ms apart)
        # A reader right after the changes sees all of them...
        listed = httpx.get(f"{registry.http_url}/v1/members", timeout=30).json()
        assert {m["id"] for m in listed} >= {m.spec.id for m in members}
        # ...from one build for that read (and one for this scrape), not one per change.
        assert _snapshot_builds(registry) - before <= 2
    finally:
        for member in members:
            member.close()
        registry.close()


def test_a_flood_of_readers_costs_the_loop_a_build_per_change_not_per_read():
    """A reader (a token holder beyond loopback) can ask for fresh snapshots, but many
    reads of an unchanged membership share one build, and every read is answered."""
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0)).start()
    member = RawMember(registry.control_address)
    try:
        assert member.register().status is ReplyStatus.OK
        before = _snapshot_builds(registry)
        started = time.monotonic()
        with httpx.Client(timeout=30) as client, ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda _: client.get(f"{registry.http_url}/v1/members"), range(200)))
        elapsed = time.monotonic() - started
        assert all(a.status_code == 200 and a.json()[0]["id"] == member.spec.id
                   for a in answers)
        # loads age out every SNAPSHOT_PERIOD_S: at most one build per period, plus the scrape
        assert _snapshot_builds(registry) - before <= 2 + elapsed / SNAPSHOT_PERIOD_S
    finally:
        member.close()
        registry.close()


def _samples(registry: RegistryServer) -> dict[str, list]:
    text = httpx.get(f"{registry.http_url}/metrics", timeout=30).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _counted(families: dict[str, list], state: str) -> float:
    return sum(s.value for s in families["pdreg_members"] if s.labels["state"] == state)


def test_a_scrape_shows_every_change_acknowledged_before_it_without_a_snapshot():
    """The counts a scrape (or /healthz) shows are the loop's, copied for it: every
    registration and departure acknowledged before the scrape is in it, and neither builds
    the HTTP snapshot (an O(members) build at fleet size)."""
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0)).start()
    members = [RawMember(registry.control_address, member_id=f"decode-127.0.0.1-{9200 + i}")
               for i in range(4)]
    try:
        builds = _snapshot_builds(registry)
        for count, member in enumerate(members, 1):
            assert member.register().status is ReplyStatus.OK
            assert _counted(_samples(registry), "ready") == count  # no wait in between
        assert members[0].bye().status is ReplyStatus.OK
        families = _samples(registry)
        assert _counted(families, "ready") == 3
        ages = [s for s in families["pdreg_heartbeat_age_seconds"]
                if s.name == "pdreg_heartbeat_age_seconds_count"]
        assert sum(s.value for s in ages) == 3
        # A liveness probe reads the same counts: as fresh, and no snapshot either.
        health = httpx.get(f"{registry.http_url}/healthz", timeout=30).json()
        assert (health["status"], health["members"]) == ("ok", 3)
        assert health["epoch"] == registry.epoch
        assert _snapshot_builds(registry) == builds
    finally:
        for member in members:
            member.close()
        registry.close()
