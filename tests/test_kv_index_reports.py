"""Routers' KV index reports over real sockets: who may send one and what a stranger can
change (nothing), then the whole path end to end.

The registry runs as docs/security.md says to run it securely (fleet and admin tokens). A
`KvIndexReport` is taken only from a registered `api_server` with its own session and a
new seq, at most one per interval after a small burst, and may describe only registered
members that publish KV events at their current incarnation. It is only shown: it never
changes a member, the version or the event stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import msgspec
import pytest
from raw_member import RawMember, member_spec

from pdreg.cmd_status import fetch_members, render
from pdreg.testing import wait_until
from registry import sessions
from registry.kv_reports import KV_REPORT_BURST
from registry.server import RegistryServer
from wire.limits import NO_PROOF
from wire.protocol import (
    MAX_KV_ENTRIES,
    KvEventsSpec,
    KvIndexEntry,
    KvIndexReport,
    KvIndexState,
    ReplyStatus,
    Role,
    make_encoder,
)

TOKEN = "fleet-s3cret"
WAIT_S = 10.0
FORGED_PROOF = b"\x07" * sessions.PROOF_BYTES
LIVE = KvIndexState.LIVE
_encode = make_encoder().encode


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryServer]) -> RegistryServer:
    # A long interval: the rate limit refills one report a minute, so a test sees it.
    return registry_factory(heartbeat_interval_s=60.0, lease_s=180.0, token=TOKEN,
                            admin_token="admin-s3cret")


def raw(registry: RegistryServer, member_id: str, role: Role, *, kv: bool = False) -> RawMember:
    spec = member_spec(member_id, role=role)
    if kv:
        spec = msgspec.structs.replace(spec, kv_events=KvEventsSpec(
            endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558",
            block_size=16))
    member = RawMember(registry.control_address, token=TOKEN, spec=spec)
    assert member.register().status is ReplyStatus.OK
    return member


@pytest.fixture
def fleet(registry: RegistryServer) -> Iterator[dict[str, RawMember]]:
    members = {"router": raw(registry, "api_server-10.0.0.1-8000", Role.API_SERVER),
               "prefill": raw(registry, "prefill-10.0.0.5-8100", Role.PREFILL, kv=True),
               "decode": raw(registry, "decode-10.0.0.7-8200", Role.DECODE)}
    try:
        yield members
    finally:
        for member in members.values():
            member.close()


def kv_report(member: RawMember, entries: list[KvIndexEntry], seq: int | None = None,
              proof: bytes = NO_PROOF) -> KvIndexReport:
    return KvIndexReport(member.id, member.spec.incarnation,
                         member.next_seq() if seq is None else seq, entries, proof)


def shown(registry: RegistryServer, member_id: str) -> dict | None:
    """The member's `kv_index` as /v1/members shows it (None: no such field)."""
    members = httpx.get(f"{registry.http_url}/v1/members",
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()
    return next(m for m in members if m["id"] == member_id).get("kv_index")


def membership_state(registry: RegistryServer) -> tuple[object, ...]:
    """Everything a report must not move: versions, events, records."""
    records = registry.submit(lambda m, now: m.records()).result(WAIT_S)  # type: ignore
    return (registry.published.version, registry.stats.events,
            sorted((r.spec.id, r.state, r.suspect, r.load) for r in records))


def test_a_routers_report_is_shown_and_changes_no_membership(registry, fleet):
    prefill, router = fleet["prefill"], fleet["router"]
    before = membership_state(registry)
    entries = [KvIndexEntry(prefill.id, prefill.spec.incarnation, LIVE, 120, 40)]
    assert router.ask_signed(kv_report(router, entries)).status is ReplyStatus.OK
    assert wait_until(lambda: shown(registry, prefill.id) is not None, WAIT_S)
    assert shown(registry, prefill.id) == {"state": "live", "blocks": 120, "lag_s": 0.04,
                                           "routers": {"live": 1}}
    assert shown(registry, fleet["decode"].id) is None  # publishes no KV events
    assert membership_state(registry) == before
    # The dashboard's state and plain `pdreg status` show it too.
    state = httpx.get(f"{registry.http_url}/v1/dashboard",
                      headers={"Authorization": f"Bearer {TOKEN}"}).json()
    card = next(m for m in state["members"] if m["id"] == prefill.id)
    assert card["kv_index"]["state"] == "live" and card["kv_index"]["blocks"] == 120
    table = render(fetch_members(registry.control_address, token=TOKEN))
    assert "KV INDEX" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith(prefill.id))
    assert row.endswith("live 120 blocks lag 0.0s")


@pytest.mark.parametrize("proof", [NO_PROOF, FORGED_PROOF], ids=["none", "random"])
def test_a_forged_report_is_refused_and_shows_nothing(registry, fleet, proof):
    prefill, router = fleet["prefill"], fleet["router"]
    stranger = RawMember(registry.control_address, member_id="attacker-1")
    try:
        entries = [KvIndexEntry(prefill.id, prefill.spec.incarnation, KvIndexState.UNKNOWN)]
        as_router = kv_report(router, entries, seq=10**6, proof=proof)
        reply = stranger.ask(as_router)
        assert reply.status is ReplyStatus.REJECTED and "proof" in reply.reason
        as_nobody = KvIndexReport("ghost", 1, 1, entries, proof)
        assert stranger.ask(as_nobody).status is ReplyStatus.UNKNOWN
    finally:
        stranger.close()
    assert registry.stats.rejections["proof"] == 1
    assert shown(registry, prefill.id) is None and registry.stats.kv_reports["accepted"] == 0


def test_a_captured_report_cannot_be_replayed(registry, fleet):
    prefill, router = fleet["prefill"], fleet["router"]
    live = [KvIndexEntry(prefill.id, prefill.spec.incarnation, LIVE, 50)]
    assert router.ask_signed(kv_report(router, live)).status is ReplyStatus.OK
    captured = router.last_frames
    unknown = [KvIndexEntry(prefill.id, prefill.spec.incarnation, KvIndexState.UNKNOWN, 3)]
    assert router.ask_signed(kv_report(router, unknown)).status is ReplyStatus.OK
    reply = router.send_frames(captured)  # a replay of the first: refused, changes nothing
    assert reply.status is ReplyStatus.REJECTED and "replay" in reply.reason
    assert wait_until(lambda: (shown(registry, prefill.id) or {}).get("state") == "unknown",
                      WAIT_S)


def test_only_routers_may_report(registry, fleet):
    """An engine holds a session too, but may not describe anyone's index."""
    prefill, decode = fleet["prefill"], fleet["decode"]
    entries = [KvIndexEntry(prefill.id, prefill.spec.incarnation, KvIndexState.UNKNOWN)]
    for sender in (prefill, decode):
        reply = sender.ask_signed(kv_report(sender, entries))
        assert reply.status is ReplyStatus.REJECTED and "api_server" in reply.reason
    assert registry.stats.rejections["reporter"] == 2
    assert shown(registry, prefill.id) is None


def test_only_registered_members_that_publish_events_can_be_described(registry, fleet):
    prefill, decode, router = fleet["prefill"], fleet["decode"], fleet["router"]
    entries = [KvIndexEntry("prefill-10.9.9.9-1", 1, LIVE, 7),  # no such member
               KvIndexEntry(prefill.id, prefill.spec.incarnation + 1, LIVE, 7),  # not yet
               KvIndexEntry(decode.id, decode.spec.incarnation, LIVE, 7),  # no KV events
               KvIndexEntry(router.id, router.spec.incarnation, LIVE, 7)]  # nor a router
    assert router.ask_signed(kv_report(router, entries)).status is ReplyStatus.OK
    assert registry.stats.kv_entries["ignored"] == 4
    metrics = httpx.get(f"{registry.http_url}/metrics").text
    assert 'pdreg_kv_index_report_entries_total{result="ignored"} 4.0' in metrics
    ids = [m["id"] for m in httpx.get(f"{registry.http_url}/v1/members",
                                      headers={"Authorization": f"Bearer {TOKEN}"}).json()
           if "kv_index" in m]
    assert ids == []


def test_one_report_per_interval(registry, fleet):
    prefill, router = fleet["prefill"], fleet["router"]
    entries = [KvIndexEntry(prefill.id, prefill.spec.incarnation, LIVE, 1)]
    replies = [router.ask_signed(kv_report(router, entries)) for _ in range(5)]
    burst = int(KV_REPORT_BURST)
    assert [r.status for r in replies] == \
        [ReplyStatus.OK] * burst + [ReplyStatus.REJECTED] * (5 - burst)
    assert "retry in" in replies[-1].reason
    assert registry.stats.kv_reports["limited"] == 5 - burst
    assert registry.stats.rejections["rate"] == 5 - burst
    # The router's heartbeats are untouched by it.
    assert router.heartbeat().status is ReplyStatus.OK


def test_oversized_reports_are_refused_whole(registry, fleet):
    prefill, router = fleet["prefill"], fleet["router"]
    entry = KvIndexEntry(prefill.id, prefill.spec.incarnation, LIVE, 1)
    tiny = KvIndexEntry("p", 1, LIVE)  # ~7 bytes: the count, not the size, is over
    too_many = kv_report(router, [tiny] * (MAX_KV_ENTRIES + 1))
    reply = router.ask_signed(too_many)
    assert reply.status is ReplyStatus.REJECTED and reply.reason.startswith("invalid")
    long_id = msgspec.structs.replace(entry, member_id="p" * 128)
    too_big = kv_report(router, [long_id] * 600)  # fewer entries, but over 64 KiB
    reply = router.ask_signed(too_big)
    assert reply.status is ReplyStatus.REJECTED and reply.reason.startswith("oversized")
    assert shown(registry, prefill.id) is None
    # Neither took the router's seq: its next report is fine.
    assert router.ask_signed(kv_report(router, [entry])).status is ReplyStatus.OK


def test_a_member_that_leaves_or_restarts_loses_its_figures(registry, fleet):
    prefill, router = fleet["prefill"], fleet["router"]
    entries = [KvIndexEntry(prefill.id, prefill.spec.incarnation, LIVE, 64)]
    assert router.ask_signed(kv_report(router, entries)).status is ReplyStatus.OK
    assert wait_until(lambda: shown(registry, prefill.id) is not None, WAIT_S)
    assert prefill.bye().status is ReplyStatus.OK
    prefill.restart(prefill.spec.incarnation + 1)
    assert prefill.register().status is ReplyStatus.OK
    # A new incarnation starts with no figures: nothing from the old one is shown.
    assert wait_until(lambda: shown(registry, prefill.id) is None, WAIT_S)
