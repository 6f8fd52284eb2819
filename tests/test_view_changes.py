"""What a view says changed: a reader that copies only those ids holds what the view holds.

A router's table follows the ids each view update changed (registry/view_changes.py)
instead of comparing every member. If the view ever left one out, the router would
route on a stale member (one gone, one draining) until the next full read, so: after any
sequence of updates, for every version a reader may have read, the ids said to have
changed since cover every member that differs, and a reader too far behind is told to
read the members whole.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from raw_member import RawMember

from pdreg.testing import wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from registry.view_changes import WHOLE_OVER, ChangeTrail
from wire.protocol import Load, MemberState

KEYS = list("abcdef")
WAIT_S = 10.0  # generous: other test processes share two cores

MODEL_OF = {key: "x" if key in "abc" else "y" for key in KEYS}
# An update: key -> a new value, or None to remove it; and whether each key's change is
# a load (listed apart, under its model, as a view lists a digest's).
updates = st.tuples(st.dictionaries(st.sampled_from(KEYS),
                                    st.one_of(st.none(), st.integers(0, 3)),
                                    min_size=1, max_size=4),
                    st.sets(st.sampled_from(KEYS)))


@given(st.lists(updates, max_size=30), st.integers(1, 8), st.sampled_from([WHOLE_OVER, 1]))
def test_a_reader_at_any_version_learns_every_key_that_differs(history, max_steps,
                                                               whole_over):
    """Membership changes from `since`, loads per model from `loads`, between any two
    versions a reader may have read: together they cover every key that differs. A
    reader is told to read whole only when it is too far behind, or when a step since
    changed more than half the members (and more than `whole_over`)."""
    versions: list[dict[str, int]] = [{}]
    whole: set[int] = set()  # the versions whose step changed more than half
    trail: ChangeTrail[int] = ChangeTrail({}, max_steps=max_steps, whole_over=whole_over)
    for update, as_loads in history:
        current = dict(versions[-1])
        for key, value in update.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        versions.append(current)
        if len(update.keys() - as_loads) > max(whole_over, len(current) // 2):
            whole.add(len(versions) - 1)
        loads: dict[str, list[str]] = {}
        for key in sorted(as_loads & update.keys()):
            loads.setdefault(MODEL_OF[key], []).append(key)
        assert trail.publish(current, update.keys() - as_loads, loads) == len(versions) - 1
    latest = len(versions) - 1
    for version, seen in enumerate(versions):
        changes = trail.since(version)
        assert changes.version == latest and changes.members == versions[-1]
        behind = latest - version > max_steps
        assert (changes.changed is None) == (behind or any(v > version for v in whole))
        if changes.changed is None:
            assert not behind or trail.loads("x", version, latest) is None
            continue
        for upto in range(version, latest + 1):  # a model read at any later version
            differs = {k for k in KEYS if seen.get(k) != versions[upto].get(k)}
            listed = set(trail.since(version).changed)
            for model in ("x", "y"):
                loads = trail.loads(model, version, upto)
                assert loads is not None
                assert {MODEL_OF[k] for k in loads} <= {model}
                listed |= loads
            assert differs <= listed


@pytest.fixture
def registry(registry_factory) -> RegistryServer:
    """Members here heartbeat only when the test says: nobody expires meanwhile."""
    return registry_factory(heartbeat_interval_s=1.0, lease_s=60.0)


@pytest.fixture
def view(registry: RegistryServer):
    with MembershipView(registry.control_address) as v:
        assert v.wait_for(lambda _: v.synced, WAIT_S)
        yield v


def test_a_reader_following_a_real_views_changes_holds_its_members(registry, view):
    """Joins, a load digest, a state change and a bye through a real registry: a copy
    kept from `changes()` alone (the first read whole) equals the view's members."""
    held: dict[str, object] = {}
    version = -1

    def follow() -> bool:
        nonlocal version
        changes = view.changes(version)
        if changes.changed is None:
            held.clear()
            held.update(changes.members)
        else:
            loaded = (view.loads(model, version, changes.version) for model in ("tiny",))
            for member_id in changes.changed.union(*loaded):
                if member_id in changes.members:
                    held[member_id] = changes.members[member_id]
                else:
                    held.pop(member_id, None)
        version = changes.version
        return held == dict(view.members())

    a = RawMember(registry.control_address, "prefill-a")
    b = RawMember(registry.control_address, "decode-b")
    try:
        a.register()
        b.register()
        follow()
        assert wait_until(lambda: follow() and len(held) == 2, WAIT_S)
        before = version
        a.heartbeat(Load(running=7))
        assert wait_until(lambda: follow() and held["prefill-a"].load.running == 7, WAIT_S)
        # A digest's load is listed apart, under the member's model, not as a change.
        assert "prefill-a" not in view.changes(before).changed
        assert view.loads("tiny", before, version) == {"prefill-a"}
        a.heartbeat(state=MemberState.DRAINING)
        assert wait_until(lambda: follow() and held["prefill-a"].record.state
                          is MemberState.DRAINING, WAIT_S)
        b.bye()
        assert wait_until(lambda: follow() and set(held) == {"prefill-a"}, WAIT_S)
    finally:
        a.close()
        b.close()
