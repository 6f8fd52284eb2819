"""Dashboard streams cost the changes: the whole state once, then what changed.

A stream used to compare a fingerprint of every member each tick (O(members) per open
page). Now it reads the loop's change log (registry/change_log.py): after its first
message it never reads the snapshot again and renders nothing per unchanged member.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from raw_member import RawMember, member_spec
from test_dashboard import apply_ops

from registry import dashboard
from registry.change_log import ChangeLog
from registry.dashboard import SharedState, _events
from registry.published import Published
from wire.protocol import (
    LeaveReason,
    Load,
    LoadEntry,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    MemberState,
    MemberUpdated,
)

MEMBERS = 5_000


class _Request:
    """What `_events` asks of Starlette's request: whether the client left."""

    def __init__(self) -> None:
        self.gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


def _record(i: int, state: MemberState = MemberState.READY) -> MemberRecord:
    return MemberRecord(member_spec(f"decode-{i}", model="m"), state, heartbeat_at=time.time())


def _messages(raw: list[str]) -> list[tuple[str, Any]]:
    out = []
    for text in raw:
        lines = text.strip().splitlines()
        if lines and lines[0].startswith("event:"):
            out.append((lines[0].split(":", 1)[1].strip(),
                        json.loads(lines[1].split(":", 1)[1])))
    return out


def test_a_stream_sends_every_change_and_walks_no_member(monkeypatch):
    records = tuple(_record(i) for i in range(MEMBERS))
    snapshot = Published(epoch=1, version=MEMBERS, members=records,
                         heartbeat_interval_s=1.0, lease_s=3.0, self_preserving=False,
                         taken_at=time.time())
    reads = {"published": 0, "member_json": 0}

    def published() -> Published:
        reads["published"] += 1
        return snapshot

    counted = dashboard.member_json

    def member_json(record: MemberRecord, now: float) -> dict[str, Any]:
        reads["member_json"] += 1
        return counted(record, now)

    monkeypatch.setattr(dashboard, "STREAM_POLL_S", 0.001)
    monkeypatch.setattr(dashboard, "member_json", member_json)
    log = ChangeLog()
    request = _Request()
    raw: list[str] = []

    async def run() -> None:
        stream = _events(SharedState(published), log, request, lambda: None)  # type: ignore[arg-type]
        raw.append(await anext(stream))  # retry:
        raw.append(await anext(stream))  # the whole state, once
        assert reads == {"published": 1, "member_json": MEMBERS}
        reads["member_json"] = 0
        version = MEMBERS
        # Each tick, a few changes of a big membership: joins, a state change, loads,
        # a leave. The stream must send exactly these.
        for tick in range(20):
            version += 1
            joined = MemberJoined(1, version, _record(MEMBERS + tick))
            version += 1
            drained = MemberUpdated(1, version, _record(tick, MemberState.DRAINING))
            log.append("events", [joined, drained], time.time())
            log.append("loads", [LoadEntry(f"decode-{tick + 100}", 1,
                                           Load(running=tick + 1), 0.1)], time.time())
            version += 1
            log.append("events", [MemberLeft(1, version, f"decode-{tick + 200}", 1, "m",
                                             LeaveReason.BYE)], time.time())
            raw.append(await anext(stream))
        request.gone = True
        async for text in stream:
            raw.append(text)

    asyncio.run(run())
    assert log.followers == 0  # unfollowed at the end
    assert reads["published"] == 1  # the snapshot was read for the first message only
    assert reads["member_json"] == 40  # one per joined or changed member, none per tick
    messages = _messages(raw)
    assert [kind for kind, _ in messages] == ["state"] + ["changes"] * 20
    members = {m["id"]: m for m in messages[0][1]["members"]}
    events: list[dict[str, Any]] = []
    for _, changes in messages[1:]:
        apply_ops(members, events, changes["ops"])
    assert len(members) == MEMBERS + 20 - 20
    assert all(members[f"decode-{t}"]["state"] == "draining" for t in range(20))
    assert all(members[f"decode-{t + 100}"]["load"]["running"] == t + 1 for t in range(20))
    assert not any(f"decode-{t + 200}" in members for t in range(20))
    assert [e["kind"] for e in events[:3]] == ["joined", "updated", "left"]


def test_a_stream_behind_the_log_gets_the_whole_state_again(monkeypatch):
    snapshot = Published(epoch=1, version=1, members=(_record(0),), heartbeat_interval_s=1.0,
                         lease_s=3.0, self_preserving=False, taken_at=time.time())
    monkeypatch.setattr(dashboard, "STREAM_POLL_S", 0.001)
    log = ChangeLog(capacity=10)
    raw: list[str] = []

    async def run() -> None:
        stream = _events(SharedState(lambda: snapshot), log, _Request(), lambda: None)  # type: ignore[arg-type]
        raw.append(await anext(stream))
        raw.append(await anext(stream))
        for i in range(12):  # more than the log holds, before the stream reads again
            log.append("loads", [LoadEntry("decode-0", 1, Load(running=i), 0.0)], time.time())
        raw.append(await anext(stream))

    asyncio.run(run())
    assert [kind for kind, _ in _messages(raw)] == ["state", "state"]


def test_the_log_costs_the_loop_nothing_without_a_stream():
    log = ChangeLog()
    log.append("loads", [LoadEntry("a", 1, Load(), 0.0)], 0.0)
    assert log.head == 0 and log.since(0) == ([], 0)
    cursor = log.follow()
    log.append("loads", [LoadEntry("a", 1, Load(), 0.0)], 0.0)
    got = log.since(cursor)
    assert got is not None and [c.kind for c in got[0]] == ["loads"] and got[1] == 1
    log.unfollow()
    assert log.since(1) == ([], 1)


@pytest.mark.timeout(120)
def test_an_open_page_ends_with_what_the_registry_holds(registry_factory):
    """Over a real registry: members join, change load and leave while a stream is open;
    the state it builds from its first message and the changes is /v1/members."""
    registry = registry_factory(heartbeat_interval_s=0.5, lease_s=30.0)  # nobody expires
    url = registry.http_url
    members = [RawMember(registry.control_address, spec=member_spec(f"decode-{i}", model="m"))
               for i in range(12)]
    try:
        with httpx.stream("GET", url + "/v1/stream", timeout=httpx.Timeout(30.0)) as response:
            lines = response.iter_lines()
            held: dict[str, dict[str, Any]] = {}
            events: list[dict[str, Any]] = []

            def read_until(done: Any) -> None:
                event = ""
                deadline = time.monotonic() + 20
                for line in lines:
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:"):
                        data = json.loads(line.split(":", 1)[1])
                        if event == "state":
                            held.clear()
                            held.update({m["id"]: m for m in data["members"]})
                        else:
                            apply_ops(held, events, data["ops"])
                        if done():
                            return
                    assert time.monotonic() < deadline
            read_until(lambda: True)  # the first state
            for i, member in enumerate(members):
                member.register(load=Load(running=i))
            for member in members[:4]:
                member.bye()
            for i, member in enumerate(members[4:]):
                member.heartbeat(load=Load(running=100 + i, kv_usage=0.5))

            def same() -> bool:
                truth = httpx.get(url + "/v1/members").json()
                return ({m["id"]: (m["state"], m["load"]["running"]) for m in truth}
                        == {i: (m["state"], m["load"]["running"]) for i, m in held.items()})
            read_until(lambda: len(held) == 8 and same())
    finally:
        for member in members:
            member.close()
