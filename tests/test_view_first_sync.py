"""A view starting against a registry whose membership keeps changing takes one snapshot.

It learns the event port from a Sync for the empty topic (a few routers' records),
subscribes, and only then asks for the snapshot it follows (registry/client.py). Taught
the port by that snapshot, it missed what changed before its subscription took hold and
took the whole snapshot again: at 100k members, a second 40 MB one at every start.
Real sockets: members join and leave without pause while the view starts.
"""

from __future__ import annotations

import itertools
import threading

from raw_member import RawMember, member_spec

from registry.client import MembershipView

WAIT_S = 10.0
CHANGES_AFTER_SYNC = 40  # joins the view must see after its snapshot, in order


class Churn:
    """A thread registering and retiring members without pause until stopped."""

    def __init__(self, address: str) -> None:
        self.members = [RawMember(address, spec=member_spec(f"decode-{i}", model="m"))
                        for i in range(8)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        incarnation = itertools.count(2)
        while not self._stop.is_set():
            for member in self.members:
                member.register()
            for member in self.members:
                member.bye()
                member.restart(next(incarnation))  # a bye is final for its incarnation

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        for member in self.members:
            member.close()


def test_a_view_starting_amid_changes_takes_one_snapshot(registry_factory) -> None:
    registry = registry_factory()
    joins = 0
    seen = threading.Condition()

    def count(members) -> None:
        nonlocal joins
        with seen:
            joins += "decode-0" in members
            seen.notify_all()
    with Churn(registry.control_address), MembershipView(registry.control_address) as view:
        view.add_listener(count)
        assert view.wait_for(lambda members: view.synced, WAIT_S)
        with seen:
            start = joins
            assert seen.wait_for(lambda: joins >= start + CHANGES_AFTER_SYNC, WAIT_S)
        assert [link.snapshots for link in view.links()] == [1]
