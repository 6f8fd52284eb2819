"""`--store file:PATH`: one registry that restarts and keeps its intents (atomic writes),
and the `memory` store's behaviour through the same admin path."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest
from raw_member import RawMember

from registry.membership import Membership
from registry.server import RegistryConfig, RegistryServer
from registry.store import sync as sync_module
from registry.store.base import StoreUnavailable
from registry.store.memory import FileStore, MemoryStore
from registry.store.metrics import StoreStats
from registry.store.records import CordonIntent, IntentKind, RegistryEntry
from registry.store.sync import StoreSync
from registry.store.url import StoreKind, StoreUrl
from wire.protocol import MemberState, ReplyStatus


def test_the_file_holds_every_intent_and_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "intents.json"
    store = FileStore(StoreUrl(StoreKind.FILE, path=str(path)))
    first = store.put("intents/drain/a", b'{"incarnation": 1, "at": 1}')
    store.put("intents/cordon/b", b'{"at": 2}')
    assert store.delete("intents/cordon/b") > first
    second = store.put("intents/cordon/c", b'{"at": 3}')
    on_disk = json.loads(path.read_text())
    assert on_disk == {"revision": second, "items": {
        "intents/drain/a": '{"incarnation": 1, "at": 1}', "intents/cordon/c": '{"at": 3}'}}
    assert os.listdir(path.parent) == ["intents.json"]  # no temporary file left behind
    again = FileStore(StoreUrl(StoreKind.FILE, path=str(path)))
    assert again.put("intents/drain/z", b"{}") == second + 1  # revisions go on


@pytest.mark.parametrize("content", [b"{not json", b'{"revision": "x", "items": {}}',
                                     b'{"revision": 1, "items": {"k": 5}}', b"[]",
                                     b"\xff\xfe"])
def test_a_damaged_file_stops_the_registry_with_a_way_out(tmp_path: Path,
                                                          content: bytes) -> None:
    path = tmp_path / "intents.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"intents\.json"):
        RegistryServer(RegistryConfig(port=0, events_port=0, http_port=-1,
                                      store=f"file:{path}"))


def test_a_write_that_cannot_reach_the_disk_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "intents.json"
    store = FileStore(StoreUrl(StoreKind.FILE, path=str(path)))
    store.put("intents/cordon/a", b'{"at": 1}')
    path.unlink()
    path.mkdir()  # the rename onto it fails
    with pytest.raises(StoreUnavailable, match="cannot write"):
        store.put("intents/cordon/b", b'{"at": 2}')
    path.rmdir()
    store.put("intents/cordon/c", b'{"at": 3}')
    assert set(json.loads(path.read_text())["items"]) == {"intents/cordon/a",
                                                          "intents/cordon/c"}


def _registry(store: str, ports: tuple[int, int, int] = (0, 0, 0)) -> RegistryServer:
    control, events, http = ports
    return RegistryServer(RegistryConfig(port=control, events_port=events, http_port=http,
                                         heartbeat_interval_s=0.2, lease_s=5.0,
                                         store=store)).start()


def test_a_registry_on_a_file_store_keeps_its_intents_across_a_restart(tmp_path: Path) -> None:
    store = f"file:{tmp_path / 'intents.json'}"
    registry = _registry(store)
    ports = (registry.control_port, registry.events_port, registry.http_port)
    drained = RawMember(registry.control_address, "decode-a", incarnation=5)
    try:
        assert drained.register().status is ReplyStatus.OK
        url = registry.http_url
        assert httpx.post(f"{url}/v1/members/decode-a/drain").json()["result"] == "draining"
        assert httpx.post(f"{url}/v1/members/decode-b/cordon").status_code == 200
        assert httpx.delete(f"{url}/v1/members/decode-c", params={"ban": 600}).status_code \
            == 200
    finally:
        registry.close()
        drained.close()
    registry = _registry(store, ports)  # a new process would do the same: same file
    members = [RawMember(registry.control_address, name, incarnation=5)
               for name in ("decode-a", "decode-b", "decode-c")]
    try:
        a, b, c = (m.register(MemberState.READY) for m in members)
        assert a.status is ReplyStatus.OK and b.status is ReplyStatus.OK
        assert c.status is ReplyStatus.REJECTED and c.banned_s > 500
        shown = {m["id"]: m for m in httpx.get(f"{registry.http_url}/v1/members").json()}
        assert shown["decode-a"]["state"] == "draining" and not shown["decode-a"]["cordoned"]
        assert shown["decode-b"]["cordoned"] and not shown["decode-b"]["routable"]
        assert members[0].heartbeat().drain and not members[1].heartbeat().drain
        kinds = {(i["kind"], i["id"]) for i in
                 httpx.get(f"{registry.http_url}/v1/intents").json()}
        assert kinds == {("drain", "decode-a"), ("cordon", "decode-b"), ("evict", "decode-c")}
    finally:
        registry.close()
        for member in members:
            member.close()


def test_the_memory_store_forgets_with_the_registry() -> None:
    registry = _registry("memory")
    ports = (registry.control_port, registry.events_port, registry.http_port)
    try:
        assert httpx.post(f"{registry.http_url}/v1/members/decode-b/cordon").json()[
            "shared"] is False
    finally:
        registry.close()
    registry = _registry("memory", ports)
    try:
        assert httpx.get(f"{registry.http_url}/v1/intents").json() == []
    finally:
        registry.close()


def test_intents_beyond_the_cap_are_refused_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store holding more intents than a registry keeps (misused, or hostile): the
    ones beyond the cap are refused, counted, and change nothing."""
    monkeypatch.setattr(sync_module, "MAX_INTENTS", 2)
    membership = Membership(epoch=1)

    def submit(action: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(action(membership, 0.0))
        return future

    stats = StoreStats()
    store = MemoryStore()
    sync = StoreSync(store, submit, RegistryEntry(id="r", control="h:1", events_port=2,
                                                  epoch=3, started_at=1.0), stats).start()
    try:
        assert sync.wait_loaded(10.0)
        for member_id in ("a", "b", "c"):
            sync.write(IntentKind.CORDON, member_id, CordonIntent(at=1.0))
        assert stats.refused == {"cap": 1}
        assert {i for _, i, _ in membership.intents.items()} == {"a", "b"}
        sync.remove(IntentKind.CORDON, "a")
        sync.write(IntentKind.CORDON, "c", CordonIntent(at=2.0))  # room again
        assert {i for _, i, _ in membership.intents.items()} == {"b", "c"}
    finally:
        sync.close()
