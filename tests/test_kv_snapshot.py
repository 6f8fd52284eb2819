"""The KV index's published snapshot: what the reporter, /v1/kv and /metrics read.

The feed writes the index and publishes after each turn; readers on other threads walk
the snapshot, never the table being changed (the reporter used to skip a tick when
the table changed under it). A publish costs the members touched since the last one.
"""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from router.kv.index import KvIndex
from router.kv.routing import KvRouting
from router.metrics import RouterMetrics
from wire.kv_events import BlockStored, KVEventBatch

IDS = ("p0", "p1", "p2")


def stored(n: int) -> KVEventBatch:
    """One block of 2 tokens, distinct per n, stored at the prompt's start."""
    return KVEventBatch(float(n), [BlockStored(block_hashes=[n + 1], parent_block_hash=None,
                                               token_ids=[n, n + 1], block_size=2,
                                               lora_id=None, medium=None, lora_name=None)])


def recount(index: KvIndex) -> dict:
    return {member_id: m.stats() for member_id, m in index.members.items()}


ops = st.one_of(
    st.tuples(st.just("track"), st.sampled_from(IDS), st.integers(1, 3)),
    st.tuples(st.just("forget"), st.sampled_from(IDS), st.just(0)),
    st.tuples(st.just("batch"), st.sampled_from(IDS), st.integers(0, 6)),
    st.tuples(st.just("replay_done"), st.sampled_from(IDS), st.integers(0, 1)),
    st.tuples(st.just("publish"), st.just(""), st.just(0)),
)


@given(st.lists(ops, max_size=60))
def test_the_snapshot_is_the_table_as_of_the_last_publish(sequence):
    index = KvIndex()
    published = recount(index)
    touched: set[str] = set()
    for kind, member_id, n in sequence:
        member = index.members.get(member_id)
        if kind != "publish":
            touched.add(member_id)
        if kind == "track":
            started = index.track(member_id, n)
            if started is not None:
                started.start_sync()
        elif kind == "forget":
            index.forget(member_id)
        elif kind == "batch" and member is not None:
            member.apply(n, stored(n))
            index.touched(member_id)  # as the feed does for every socket it reads
        elif kind == "replay_done" and member is not None:
            member.replay_done(complete=bool(n))
            index.touched(member_id)
        elif kind == "publish":
            before = index.published.members
            index.publish()
            after = index.published.members
            published = recount(index)
            # Only what was touched is rebuilt; everything else is the same object.
            assert all(after[key] is before[key] for key in set(before) - touched)
            touched.clear()
        # Between publishes readers see the last one, whatever the writer does meanwhile.
        assert dict(index.published.members.items()) == published
        assert index.published.totals()[2] >= 0


def test_status_reads_the_published_snapshot():
    routing = KvRouting(RouterMetrics(), allows=lambda address: True)
    index = routing.index
    member = index.track("p0", 7)
    assert member is not None
    member.start_sync()
    member.replay_done(complete=True)
    member.apply(0, stored(0))
    assert routing.status(time.time()) == []  # not published yet
    index.publish()
    (row,) = routing.status(time.time())
    assert (row["id"], row["incarnation"], row["state"], row["blocks"]) == ("p0", 7, "live", 1)
    index.forget("p0")
    assert [r["id"] for r in routing.status(time.time())] == ["p0"]
    index.publish()
    assert routing.status(time.time()) == []


def test_a_reader_thread_never_trips_over_the_writer():
    """The writer tracks, fills and forgets members as fast as it can while another
    thread reads status, as the reporter does: every read is one whole publish."""
    routing = KvRouting(RouterMetrics(), allows=lambda address: True)
    index = routing.index
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        n = 0
        while not stop.is_set():
            member_id = f"p{n % 50}"
            member = index.track(member_id, n)
            if member is not None:
                member.start_sync()
                member.replay_done(complete=True)
                member.apply(0, stored(n))
                index.touched(member_id)
            if n % 7 == 0:
                index.forget(f"p{(n * 3) % 50}")
            index.publish()
            n += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        for _ in range(300):
            try:
                rows = routing.status(time.time())
            except BaseException as exc:  # any failure is the finding
                errors.append(exc)
                break
            ids = [r["id"] for r in rows]
            assert ids == sorted(set(ids))
            assert all(r["state"] == "live" and r["blocks"] == 1 for r in rows)
    finally:
        stop.set()
        thread.join(5)
    assert not errors
