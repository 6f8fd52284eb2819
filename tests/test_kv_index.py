"""The KV index against a model engine: over lost, duplicated and reordered batches and
failed replays, a member's index is exact (LIVE), a subset (UNKNOWN) or claims nothing."""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field

from hypothesis import example, given
from hypothesis import strategies as st

from router.kv.index import (
    DEFAULT_MAX_PENDING_BYTES,
    Applied,
    IndexState,
    KvIndex,
    MemberIndex,
)
from router.kv.keys import ROOT_KEY, block_keys, chain_key
from wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

BLOCK = 2
MASK = 2**64 - 1


def engine_hash(key: int) -> int:
    """The model engine's own block hash: deterministic per content, unlike our key."""
    return (key * 0x9E3779B97F4A7C15 + 1) & MASK


@dataclass
class Engine:
    """A prefix cache that publishes vLLM-format batches, with a bounded replay buffer."""

    buffer_steps: int
    held: dict[int, int] = field(default_factory=dict)  # engine hash -> content key
    payloads: list[bytes] = field(default_factory=list)
    history: list[dict[int, int]] = field(default_factory=list)  # held after batch i

    def store(self, parent_pick: int, blocks: list[tuple[int, ...]]) -> None:
        """A request computing `blocks` after a held parent (or the prompt start): each
        run of blocks not yet held is one BlockStored, as vLLM reports them."""
        parents = sorted(self.held)
        parent_hash = None if parent_pick == 0 or not parents else \
            parents[parent_pick % len(parents)]
        parent_key = ROOT_KEY if parent_hash is None else self.held[parent_hash]
        events: list[BlockStored] = []
        run: list[tuple[int, tuple[int, ...]]] = []
        run_parent = parent_hash
        for tokens in blocks:
            key = chain_key(parent_key, tokens)
            h = engine_hash(key)
            if h in self.held:
                if run:
                    events.append(_stored(run_parent, run))
                    run = []
                run_parent = h
            else:
                run.append((h, tokens))
                self.held[h] = key
            parent_key = key
        if run:
            events.append(_stored(run_parent, run))
        self._publish(events)

    def remove(self, picks: list[int]) -> None:
        hashes = sorted(self.held)
        gone = sorted({hashes[p % len(hashes)] for p in picks}) if hashes else []
        for h in gone:
            del self.held[h]
        self._publish([BlockRemoved(gone, "GPU")] if gone else [])

    def clear(self) -> None:
        self.held.clear()
        self._publish([AllBlocksCleared()])

    def _publish(self, events: list) -> None:
        batch = KVEventBatch(float(len(self.payloads)), events, 0)
        self.payloads.append(encode_batch(batch))
        self.history.append(dict(self.held))

    def replay(self, start: int) -> list[int]:
        first = max(0, len(self.payloads) - self.buffer_steps)
        return list(range(max(start, first), len(self.payloads)))


def _stored(parent: int | None, run: list[tuple[int, tuple[int, ...]]]) -> BlockStored:
    return BlockStored([h for h, _ in run], parent, [t for _, ts in run for t in ts], BLOCK,
                       None, "GPU", None)


tokens = st.tuples(*[st.integers(0, 2)] * BLOCK)  # a small alphabet: shared prefixes
engine_ops = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 20), st.lists(tokens, min_size=1, max_size=4)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 50), min_size=1, max_size=3)),
    st.tuples(st.just("clear")),
)
# publish the next op | deliver | drop | swap the next two | deliver a duplicate |
# serve the asked replay | let the asked replay time out
ACTIONS = ("publish", "deliver", "drop", "swap", "dup", "replay", "timeout")
actions = st.lists(st.sampled_from(ACTIONS), max_size=80)


def check(index: MemberIndex, engine: Engine, probes: list[list[int]]) -> None:
    applied = (index.next_seq or 0) - 1
    truth = engine.history[applied] if applied >= 0 and index.next_seq is not None else {}
    state = index.state
    if state is IndexState.LIVE:
        assert index.blocks == truth
    elif state is IndexState.UNKNOWN:
        assert index.blocks.items() <= truth.items()  # a subset, each with the right key
    else:
        assert all(index.cached_blocks(p) == 0 for p in probes)
        return
    true_keys = set(truth.values())
    for probe in probes:
        n = index.cached_blocks(probe)
        exact = next((i for i, k in enumerate(probe) if k not in true_keys), len(probe))
        if state is IndexState.LIVE:
            assert n == exact
        else:
            assert n <= exact  # never claims a block the engine lacks


@given(st.lists(engine_ops, max_size=30), actions, st.integers(1, 6),
       st.lists(st.lists(tokens, min_size=1, max_size=4), max_size=4),
       st.one_of(st.none(), st.integers(0, 400)))
@example([("store", 0, [(1, 1)]), ("remove", [0]), ("store", 0, [(2, 2)])],
         ["publish", "replay", "publish", "publish", "drop", "drop", "deliver", "replay"],
         1, [], None)  # a removal lost in a hole the replay cannot fill: the old block must go
@example([("store", 0, [(1, 1)]), ("store", 0, [(2, 2)]), ("store", 0, [(0, 0)])],
         ["publish", "replay", "drop", "publish", "publish", "drop", "deliver"],
         1, [], None)  # a hole is open: no claim, not even on blocks held before it
def test_index_is_exact_a_subset_or_silent(ops, schedule, buffer_steps, prompts,
                                           gap_bytes):
    """...whatever the cap on bytes held behind a gap (`gap_bytes`; None: the
    default), which is never passed."""
    engine = Engine(buffer_steps)
    cap = DEFAULT_MAX_PENDING_BYTES if gap_bytes is None else gap_bytes
    index = MemberIndex("p", 1, max_pending_bytes=cap)
    chains = prompts + [op[2] for op in ops if op[0] == "store"]
    probes = [block_keys([t for b in p for t in b], BLOCK) for p in chains]
    assert index.start_sync() is Applied.GAP
    queue: list[int] = []  # seqs published, not yet delivered (the SUB socket's view)
    remaining = list(ops)
    for action in schedule:
        if action == "publish" and remaining:
            op = remaining.pop(0)
            getattr(engine, op[0])(*op[1:])
            queue.append(len(engine.payloads) - 1)
        elif action in ("deliver", "dup") and queue:
            seq = queue[0] if action == "dup" else queue.pop(0)
            payload = engine.payloads[seq]
            index.apply(seq, decode_batch(payload), len(payload))
        elif action == "drop" and queue:
            queue.pop(0)
        elif action == "swap" and len(queue) > 1:
            queue[0], queue[1] = queue[1], queue[0]
        elif action == "replay" and index.replay_outstanding:
            for seq in engine.replay(index.replay_from):
                payload = engine.payloads[seq]
                index.apply(seq, decode_batch(payload), len(payload))
            index.replay_done(complete=True)
        elif action == "timeout" and index.replay_outstanding:
            index.replay_done(complete=False)
        check(index, engine, probes)
        assert index.pending_bytes == sum(index.pending_sizes.values()) <= cap
        assert index.pending_sizes.keys() == index.pending.keys()


@given(st.lists(engine_ops, min_size=1, max_size=30), st.randoms(use_true_random=False))
def test_reordering_alone_ends_exact(ops, rng):
    """Nothing lost, everything replayable: the index ends LIVE and equal to the engine."""
    engine = Engine(buffer_steps=1000)
    index = MemberIndex("p", 1)
    index.start_sync()
    for op in ops:
        getattr(engine, op[0])(*op[1:])
    seqs = list(range(len(engine.payloads)))
    rng.shuffle(seqs)
    for seq in seqs:
        index.apply(seq, decode_batch(engine.payloads[seq]))
    while index.replay_outstanding:
        for seq in engine.replay(index.replay_from):
            index.apply(seq, decode_batch(engine.payloads[seq]))
        index.replay_done(complete=True)
    assert index.state is IndexState.LIVE
    assert index.blocks == engine.history[-1]


def test_lost_history_is_unknown_until_a_clear():
    engine = Engine(buffer_steps=1)
    engine.store(0, [(1, 1), (2, 2)])
    engine.store(0, [(0, 0)])
    index = MemberIndex("p", 1)
    index.start_sync()
    for seq in engine.replay(0):  # the buffer kept only seq 1
        index.apply(seq, decode_batch(engine.payloads[seq]))
    index.replay_done(complete=True)
    assert index.state is IndexState.UNKNOWN and index.losses == 1
    assert index.cached_blocks(block_keys([0, 0], BLOCK)) == 1  # seen since: a lower bound
    assert index.cached_blocks(block_keys([1, 1, 2, 2], BLOCK)) == 0  # before: not claimed
    engine.clear()
    engine.store(0, [(1, 1)])
    for seq in (2, 3):
        index.apply(seq, decode_batch(engine.payloads[seq]))
    assert index.state is IndexState.LIVE
    assert index.cached_blocks(block_keys([1, 1, 2, 2], BLOCK)) == 1


def test_no_replay_socket_means_unknown():
    index = MemberIndex("p", 1)
    index.start_sync()
    index.replay_done(complete=False)
    assert index.state is IndexState.UNKNOWN


def test_duplicate_stores_need_as_many_removals():
    """vLLM reports each copy of a block two requests computed at once, and each eviction."""
    index = MemberIndex("p", 1)
    index.start_sync()
    index.replay_done(complete=True)
    key = chain_key(ROOT_KEY, (7, 7))
    stored = BlockStored([99], None, [7, 7], BLOCK, None, "GPU", None)
    index.apply(0, KVEventBatch(0.0, [stored, stored]))
    index.apply(1, KVEventBatch(0.0, [BlockRemoved([99], "GPU")]))
    assert index.cached_blocks([key]) == 1
    index.apply(2, KVEventBatch(0.0, [BlockRemoved([99], "GPU")]))
    assert index.cached_blocks([key]) == 0 and index.state is IndexState.LIVE


def test_other_tiers_groups_and_salted_blocks_do_not_count():
    index = MemberIndex("p", 1)
    index.start_sync()
    index.replay_done(complete=True)
    index.apply(0, KVEventBatch(0.0, [
        BlockStored([1], None, [5, 5], BLOCK, None, "CPU", None),
        BlockStored([2], None, [5, 5], BLOCK, None, "GPU", None, group_idx=1),
        BlockStored([3], None, [5, 5], BLOCK, None, "GPU", "my-lora"),
        BlockStored([4], None, [5, 5], BLOCK, None, "GPU", None, extra_keys=[["salt"]]),
        BlockStored([5], None, [5, 5], BLOCK, None, "GPU", None, cache_salt="tenant-a"),
        BlockStored([6], None, [5, 5], BLOCK, None, "CPU_PINNED", None),
    ]))
    assert index.cached_blocks(block_keys([5, 5], BLOCK)) == 0
    assert index.state is IndexState.LIVE


def test_incarnations_and_leaving():
    kv = KvIndex()
    first = kv.track("p", 1)
    assert first is not None and kv.track("p", 1) is None
    first.start_sync()
    first.replay_done(complete=True)
    first.apply(0, KVEventBatch(0.0, [BlockStored([9], None, [1, 1], BLOCK, None, None, None)]))
    key = block_keys([1, 1], BLOCK)
    assert kv.cached_blocks("p", 1, key) == 1
    second = kv.track("p", 2)  # restarted: its old blocks are gone
    assert second is not None and kv.cached_blocks("p", 1, key) == 0
    assert kv.cached_blocks("p", 2, key) == 0
    assert kv.retain([]) == ["p"] and kv.total_blocks() == 0


def test_memory_is_bounded_and_measured():
    """Blocks past the cap are not indexed (the member becomes a lower bound), and a block
    costs a bounded number of bytes (bench/RESULTS.md has the figure at 1M blocks)."""
    index = MemberIndex("p", 1, max_blocks=20_000)
    index.start_sync()
    index.replay_done(complete=True)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    parent = None
    for seq in range(250):  # 250 batches x 100 blocks: 25,000 stores, cap 20,000
        hashes = [seq * 1000 + i + 1 for i in range(100)]
        tokens = [seq % 7, seq] * 100
        index.apply(seq, KVEventBatch(0.0, [BlockStored(hashes, parent, tokens, BLOCK, None,
                                                        "GPU", None)]))
        parent = hashes[-1]
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(index.blocks) == 20_000 and index.state is IndexState.UNKNOWN
    assert used / len(index.blocks) < 400  # bytes per indexed block
