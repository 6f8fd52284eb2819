"""The store's pure parts: `--store` URLs, keys and values, the intent rules, the table."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.store.intents import IntentTable, ban_left_s, drains, evicts
from registry.store.records import (
    EVICT_HOLD_S,
    INTENT_MAX_AGE_S,
    MAX_VALUE_BYTES,
    BadRecord,
    CordonIntent,
    DrainIntent,
    EvictIntent,
    IntentKind,
    RegistryEntry,
    decode_intent,
    decode_registry,
    encode,
    expires_at,
    intent_key,
    parse_key,
    registry_key,
)
from registry.store.url import StoreKind, StoreUrl, parse_store_url


@pytest.mark.parametrize(("text", "expected"), [
    ("memory", StoreUrl(StoreKind.MEMORY)),
    ("", StoreUrl(StoreKind.MEMORY)),
    ("file:/var/lib/pdreg/i.json", StoreUrl(StoreKind.FILE, path="/var/lib/pdreg/i.json")),
    ("file://tmp/x.json", StoreUrl(StoreKind.FILE, path="tmp/x.json")),
    ("etcd://10.0.0.1:2379", StoreUrl(StoreKind.ETCD, endpoints=("10.0.0.1:2379",))),
    ("etcd://a:2379,b:2379,a:2379/prod/fleet",
     StoreUrl(StoreKind.ETCD, endpoints=("a:2379", "b:2379"), prefix="prod/fleet")),
    ("etcd://[::1]:2379", StoreUrl(StoreKind.ETCD, endpoints=("[::1]:2379",))),
])
def test_store_urls(text: str, expected: StoreUrl) -> None:
    assert parse_store_url(text) == expected


@pytest.mark.parametrize("text", [
    "redis://x:1", "file:", "file:/tmp/", "etcd://", "etcd://host", "etcd://host:0",
    "etcd://host:99999", "etcd://ho st:1", "etcd://h:1/../x", "etcd://h:1/a b",
])
def test_bad_store_urls_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match="--store"):
        parse_store_url(text)


def test_only_etcd_is_shared() -> None:
    assert [parse_store_url(t).shared for t in ("memory", "file:/x", "etcd://h:1")] == [
        False, False, True]


@pytest.mark.parametrize(("key", "expected"), [
    ("intents/drain/decode-1", (IntentKind.DRAIN, "decode-1")),
    ("intents/cordon/prefill-10.0.0.1-8000", (IntentKind.CORDON, "prefill-10.0.0.1-8000")),
    ("registries/10.0.0.1:7600", "10.0.0.1:7600"),
    ("intents/frobnicate/x", None),  # a kind from a later version: ignored
    ("other/thing", None),
    ("registries/", None),
])
def test_keys(key: str, expected: object) -> None:
    assert parse_key(key) == expected


@pytest.mark.parametrize("key", ["intents/drain/", "intents/evict/-bad", "intents/drain/a b",
                                 "intents/cordon/" + "x" * 200])
def test_a_bad_member_id_in_a_key_is_refused(key: str) -> None:
    with pytest.raises(BadRecord) as caught:
        parse_key(key)
    assert caught.value.reason == "id"


def test_keys_and_values_round_trip() -> None:
    drain = DrainIntent(incarnation=7, at=1e9, by="r1")
    assert parse_key(intent_key(IntentKind.DRAIN, "d-1")) == (IntentKind.DRAIN, "d-1")
    assert decode_intent(IntentKind.DRAIN, encode(drain)) == drain
    entry = RegistryEntry(id="r1", control="h:7600", events_port=7601, http="http://h:7680",
                          epoch=3, started_at=1e9)
    assert parse_key(registry_key("r1")) == "r1"
    assert decode_registry(encode(entry)) == entry


@pytest.mark.parametrize(("value", "reason"), [
    (b"not json", "malformed"),
    (b'{"incarnation": "seven", "at": 1}', "invalid"),  # wrong type
    (b'{"incarnation": -1, "at": 1}', "invalid"),  # out of range
    (b'{"incarnation": 1, "at": 1e300}', "invalid"),  # unbounded time
    (b'{"at": 1}', "invalid"),  # missing field
    (b"[1, 2]", "invalid"),
    (b'{"incarnation": 1, "at": 1, "by": "' + b"x" * MAX_VALUE_BYTES + b'"}', "oversized"),
])
def test_bad_values_are_refused_with_a_reason(value: bytes, reason: str) -> None:
    with pytest.raises(BadRecord) as caught:
        decode_intent(IntentKind.DRAIN, value)
    assert caught.value.reason == reason


def test_unknown_fields_from_a_later_version_are_ignored() -> None:
    value = b'{"incarnation": 3, "at": 5, "note": "from a newer registry"}'
    assert decode_intent(IntentKind.DRAIN, value) == DrainIntent(incarnation=3, at=5)


@pytest.mark.parametrize(("intent", "expected"), [
    (CordonIntent(at=100.0), None),
    (DrainIntent(incarnation=1, at=100.0), 100.0 + INTENT_MAX_AGE_S),
    (EvictIntent(incarnation=1, at=100.0), 100.0 + EVICT_HOLD_S),
    (EvictIntent(incarnation=1, at=100.0, ban_until=100.0 + 5 * EVICT_HOLD_S),
     100.0 + 5 * EVICT_HOLD_S),
    (EvictIntent(incarnation=1, at=100.0, ban_until=1e10), 100.0 + INTENT_MAX_AGE_S),
])
def test_expiry(intent: DrainIntent | EvictIntent | CordonIntent, expected: float | None) -> None:
    assert expires_at(intent) == expected


@pytest.mark.parametrize(("drained", "incarnation", "expected"), [
    (None, 5, False),
    (5, 5, True),  # the drained process, registering again (a registry restarted)
    (5, 4, True),  # an older one
    (5, 6, False),  # a new process: a drain ends with the process it drained
])
def test_drain_rule(drained: int | None, incarnation: int, expected: bool) -> None:
    intent = DrainIntent(incarnation=drained, at=0.0) if drained is not None else None
    assert drains(intent, incarnation) is expected


@pytest.mark.parametrize(("incarnation", "registered_at", "expected"), [
    (5, 99.0, True),
    (5, 100.0, True),
    (5, 101.0, False),  # registered again after the eviction: its agent came back
    (6, 99.0, False),  # a newer process
    (0, 99.0, False),
])
def test_evict_rule(incarnation: int, registered_at: float, expected: bool) -> None:
    intent = EvictIntent(incarnation=5, at=100.0)
    assert evicts(intent, incarnation, registered_at) is expected
    assert not evicts(None, incarnation, registered_at)


@pytest.mark.parametrize(("ban_until", "now", "left"), [
    (0.0, 100.0, 0.0), (150.0, 100.0, 50.0), (150.0, 200.0, 0.0)])
def test_ban_left(ban_until: float, now: float, left: float) -> None:
    assert ban_left_s(EvictIntent(incarnation=0, at=90.0, ban_until=ban_until), now) == left
    assert ban_left_s(None, now) == 0.0


_kinds = st.sampled_from(list(IntentKind))
_ids = st.sampled_from(["a", "b", "c"])
_intents = st.builds(lambda n: CordonIntent(at=float(n)), st.integers(0, 3))
_steps = st.lists(st.one_of(
    st.tuples(st.just("set"), _kinds, _ids, st.none() | _intents),
    st.tuples(st.just("replace"), st.dictionaries(st.tuples(_kinds, _ids), _intents,
                                                  max_size=5)),
), max_size=30)


@given(_steps)
def test_the_table_holds_what_the_store_said_and_reports_every_change(steps: list) -> None:
    """Checked against a plain dict: after any history the table holds exactly what
    the store said last, and replaying the changes a reload reported onto the old
    contents gives the new ones."""
    table = IntentTable()
    model: dict[tuple[IntentKind, str], object] = {}
    for step in steps:
        if step[0] == "set":
            _, kind, member_id, intent = step
            changed = table.set(kind, member_id, intent)
            before = model.get((kind, member_id))
            assert changed == (before != intent)
            if intent is None:
                model.pop((kind, member_id), None)
            else:
                model[(kind, member_id)] = intent
        else:
            new = dict(step[1])
            changes = table.replace(new)
            replayed = dict(model)
            for kind, member_id, intent in changes:
                if intent is None:
                    replayed.pop((kind, member_id))
                else:
                    replayed[(kind, member_id)] = intent
            assert replayed == new
            differing = {k for k in set(model) | set(new) if model.get(k) != new.get(k)}
            assert sorted((k, i) for k, i, _ in changes) == sorted(differing)  # each once
            model = new
        assert {(k, i): v for k, i, v in table.items()} == model
        assert len(table) == len(model)
        for kind in IntentKind:
            assert table.count(kind) == sum(1 for k, _ in model if k is kind)


def test_values_are_readable_json() -> None:
    """What `etcdctl get` shows an operator."""
    assert msgspec.json.decode(encode(CordonIntent(at=1.5, by="r1"))) == {"at": 1.5,
                                                                           "by": "r1"}
