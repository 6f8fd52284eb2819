"""The etcd store against a real etcd on loopback: the client (keys, compare-and-delete,
watch, compaction, leases, authentication, TLS, failover), and StoreSync over it (what a
registry holds, and a malicious value refused and counted)."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from etcd_process import EtcdProcess, make_certificates, requires_etcd
from membership_ops import READY, fresh, spec

from pdreg.testing import free_low_port, wait_until
from registry.store.base import StoreUnavailable
from registry.store.etcd import Compacted, EtcdClient, EtcdRefused
from registry.store.etcd_store import EtcdStore
from registry.store.metrics import StoreStats
from registry.store.records import (
    CordonIntent,
    IntentKind,
    RegistryEntry,
    encode,
    intent_key,
)
from registry.store.sync import StoreSync
from registry.store.url import EtcdOptions, StoreKind, StoreUrl

pytestmark = requires_etcd
WAIT_S = 10.0
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    process = EtcdProcess(tmp_path_factory.mktemp("etcd") / "data").start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def prefix() -> str:
    return f"t{next(_prefixes)}"


@pytest.fixture
def client(etcd: EtcdProcess, prefix: str) -> Iterator[EtcdClient]:
    c = EtcdClient([etcd.endpoint], prefix)
    try:
        yield c
    finally:
        c.close()


def test_keys_under_a_prefix(client: EtcdClient, etcd: EtcdProcess) -> None:
    first = client.put("intents/drain/a", b"1")
    second = client.put("intents/drain/b", b"2")
    other = EtcdClient([etcd.endpoint], client._prefix.rstrip("/") + "x")  # a neighbour
    other.put("intents/drain/a", b"not ours")
    other.close()
    revision, items = client.range_all()
    assert revision >= second > first
    assert {k: (i.value, i.mod_revision) for k, i in items.items()} == {
        "intents/drain/a": (b"1", first), "intents/drain/b": (b"2", second)}
    assert client.delete("intents/drain/a") > second
    assert client.delete("intents/drain/a") == 0  # nothing left to delete


def test_delete_only_if_unchanged(client: EtcdClient) -> None:
    written = client.put("k", b"old")
    rewritten = client.put("k", b"new")  # someone wrote it again meanwhile
    assert client.delete("k", mod_revision=written) == 0
    assert client.range_all()[1]["k"].value == b"new"
    assert client.delete("k", mod_revision=rewritten) > 0
    assert client.range_all()[1] == {}


def test_watch_delivers_every_change_in_order(client: EtcdClient) -> None:
    start, _ = client.range_all()
    client.put("a", b"1")
    client.put("a", b"2")
    client.delete("a")
    seen: list[tuple[str, bytes | None]] = []
    for _, changes in client.watch(start + 1):
        seen += [(key, item.value if item else None) for key, item in changes]
        if len(seen) >= 3:
            break
    assert seen == [("a", b"1"), ("a", b"2"), ("a", None)]


def test_a_watch_from_a_compacted_revision_says_so(client: EtcdClient) -> None:
    start = client.put("a", b"1")
    latest = client.put("a", b"2")
    client.call("/v3/kv/compaction", {"revision": str(latest)})
    with pytest.raises(Compacted) as caught:
        next(iter(client.watch(start)))
    assert caught.value.revision == latest


def test_a_key_under_a_lease_goes_when_the_lease_is_not_renewed(client: EtcdClient) -> None:
    lease = client.grant(2)
    client.put("registries/r1", b"{}", lease=lease)
    assert client.keepalive(lease) > 0
    assert wait_until(lambda: "registries/r1" not in client.range_all()[1], WAIT_S)
    assert client.keepalive(lease) == 0  # gone: a registry grants a new one


def test_a_dead_endpoint_is_skipped(etcd: EtcdProcess, prefix: str) -> None:
    dead = f"127.0.0.1:{free_low_port()}"
    c = EtcdClient([dead, etcd.endpoint], prefix)
    try:
        assert c.put("k", b"v") > 0
        assert c.endpoint.endswith(etcd.endpoint)
    finally:
        c.close()
    nobody = EtcdClient([dead], prefix)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        nobody.put("k", b"v")
    nobody.close()


def test_users_and_passwords(tmp_path: Path) -> None:
    """etcd with authentication on: the right password works (and a token etcd no
    longer knows is replaced), a wrong one is refused with etcd's reason."""
    secured = EtcdProcess(tmp_path / "data").start()
    try:
        ctl = ["etcdctl", "--endpoints", secured.url]
        env = {"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}
        for argv in (["user", "add", "root:rootpw"], ["user", "add", "pd:pdpw"],
                     ["role", "add", "pdreg"],
                     ["role", "grant-permission", "pdreg", "--prefix=true", "readwrite",
                      "fleet/"],
                     ["user", "grant-role", "pd", "pdreg"], ["auth", "enable"]):
            subprocess.run([*ctl, *argv], check=True, capture_output=True, env=env)
        good = EtcdClient([secured.endpoint], "fleet", EtcdOptions(user="pd", password="pdpw"))
        assert good.put("k", b"v") > 0
        good._token = "expired-or-forged"  # what etcd answers a stale token with: retried
        assert good.range_all()[1]["k"].value == b"v"
        good.close()
        bad = EtcdClient([secured.endpoint], "fleet", EtcdOptions(user="pd", password="no"))
        with pytest.raises(EtcdRefused, match="authentication failed"):
            bad.put("k", b"v")
        bad.close()
        outside = EtcdClient([secured.endpoint], "other",
                             EtcdOptions(user="pd", password="pdpw"))
        with pytest.raises(EtcdRefused, match="permission denied"):
            outside.put("k", b"v")
        outside.close()
    finally:
        secured.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_tls_with_a_client_certificate(tmp_path: Path) -> None:
    files = make_certificates(tmp_path)
    secured = EtcdProcess(tmp_path / "data")
    secured.scheme = "https"
    secured.start("--cert-file", str(files["server"]), "--key-file",
                  str(files["server_key"]), "--trusted-ca-file", str(files["ca"]),
                  "--client-cert-auth")
    try:
        options = EtcdOptions(ca_file=str(files["ca"]), cert_file=str(files["client"]),
                              key_file=str(files["client_key"]))
        c = EtcdClient([secured.endpoint], "fleet", options)
        assert c.put("k", b"v") > 0
        c.close()
        anonymous = EtcdClient([secured.endpoint], "fleet",
                               EtcdOptions(ca_file=str(files["ca"])))
        with pytest.raises(StoreUnavailable):
            anonymous.put("k", b"v")  # no client certificate: the handshake fails
        anonymous.close()
    finally:
        secured.stop()


# --- StoreSync over etcd: what a registry holds --------------------------------------------


class _Loop:
    """The registry loop's admin queue, reduced to what StoreSync uses: actions run in
    order against one Membership (the test reads it under the same lock)."""

    def __init__(self) -> None:
        self.membership = fresh()
        self.lock = threading.Lock()

    def submit(self, action: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self.lock:
            future.set_result(action(self.membership, 0.0))
        return future


@pytest.fixture
def synced(etcd: EtcdProcess, prefix: str) -> Iterator[tuple[StoreSync, _Loop, EtcdClient]]:
    stats = StoreStats(kind="etcd")
    url = StoreUrl(StoreKind.ETCD, endpoints=(etcd.endpoint,), prefix=prefix)
    loop = _Loop()
    own = RegistryEntry(id="r1", control="127.0.0.1:1", events_port=2, epoch=3,
                        started_at=1.0)
    sync = StoreSync(EtcdStore(url, EtcdOptions(), stats), loop.submit, own, stats).start()
    raw = EtcdClient([etcd.endpoint], prefix)
    try:
        assert sync.wait_loaded(WAIT_S)
        yield sync, loop, raw
    finally:
        sync.close()
        raw.close()


def test_a_registry_follows_the_store(synced: tuple[StoreSync, _Loop, EtcdClient]) -> None:
    sync, loop, _ = synced
    loop.membership.join(spec("d", 1), READY)
    revision = sync.write(IntentKind.CORDON, "d", CordonIntent(at=1.0))
    assert sync.wait_applied(revision, WAIT_S)
    with loop.lock:
        assert loop.membership.get("d").cordoned
    assert wait_until(lambda: "r1" in sync.registries, WAIT_S)  # its own lease key
    assert sync.remove(IntentKind.CORDON, "d") > revision
    assert wait_until(lambda: not loop.membership.get("d").cordoned, WAIT_S)


def test_malicious_store_values_are_refused_counted_and_change_nothing(
        synced: tuple[StoreSync, _Loop, EtcdClient]) -> None:
    sync, loop, raw = synced
    loop.membership.join(spec("d", 1), READY)
    good = raw.put(intent_key(IntentKind.CORDON, "d"), encode(CordonIntent(at=1.0)))
    assert sync.wait_applied(good, WAIT_S)
    raw.put(intent_key(IntentKind.CORDON, "d"), b'{"at": "yesterday"}')  # wrong type
    raw.put(intent_key(IntentKind.DRAIN, "e"), b"{" + b" " * 5000 + b"}")  # oversized
    raw.put(intent_key(IntentKind.DRAIN, "-e"), b'{"incarnation": 1, "at": 1}')  # bad id
    raw.put("registries/r9", b"[]")
    last = raw.put(intent_key(IntentKind.DRAIN, "x"), b"garbage")
    assert sync.wait_applied(last, WAIT_S) or wait_until(
        lambda: sum(sync.stats.refused.values()) >= 5, WAIT_S)
    assert wait_until(lambda: sum(sync.stats.refused.values()) == 5, WAIT_S)
    assert sync.stats.refused == {"invalid": 2, "oversized": 1, "id": 1, "malformed": 1}
    with loop.lock:
        assert loop.membership.get("d").cordoned  # the last good value still stands
        assert len(loop.membership.intents) == 1
    assert "r9" not in sync.registries


def test_the_replica_set_loses_a_registry_that_stops(
        synced: tuple[StoreSync, _Loop, EtcdClient], etcd: EtcdProcess, prefix: str) -> None:
    sync, _, _ = synced
    stats = StoreStats(kind="etcd")
    url = StoreUrl(StoreKind.ETCD, endpoints=(etcd.endpoint,), prefix=prefix)
    other = StoreSync(EtcdStore(url, EtcdOptions(), stats), _Loop().submit,
                      RegistryEntry(id="r2", control="127.0.0.1:5", events_port=6, epoch=7,
                                    started_at=1.0), stats).start()
    assert wait_until(lambda: set(sync.registries) == {"r1", "r2"}, WAIT_S)
    other.close()  # a clean stop revokes its lease: gone at once, not a lease later
    assert wait_until(lambda: set(sync.registries) == {"r1"}, WAIT_S)


def test_a_compacted_watch_reads_everything_again(
        etcd: EtcdProcess, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd compacted the revision a watch resumes from: everything is read again (the
    half that etcd itself says so is test_a_watch_from_a_compacted_revision_says_so)."""
    stats = StoreStats(kind="etcd")
    url = StoreUrl(StoreKind.ETCD, endpoints=(etcd.endpoint,), prefix=prefix)
    store = EtcdStore(url, EtcdOptions(), stats)
    real_watch = store._client.watch
    calls = itertools.count()

    def watch_compacted_once(revision: int) -> Iterator[Any]:
        if next(calls) == 0:
            raise Compacted(revision + 1)
        return real_watch(revision)

    monkeypatch.setattr(store._client, "watch", watch_compacted_once)
    own = RegistryEntry(id="r3", control="127.0.0.1:1", events_port=2, epoch=3,
                        started_at=1.0)
    sync = StoreSync(store, _Loop().submit, own, stats).start()
    try:
        assert wait_until(lambda: stats.reloads["compacted"] == 1, WAIT_S)
        assert stats.reloads["start"] == 1 and stats.up
    finally:
        sync.close()
