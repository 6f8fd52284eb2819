"""Which prefix-cache blocks each engine holds, learnt from its own KV events. Pure.

No sockets, no clock of its own: the feed (router/kv/follow.py) hands it numbered batches
(wire/kv_events.py) and replay results and acts on what it answers. Blocks are keyed
by token content (router/kv/keys.py), and each member's engine hashes map to those
keys, so `BlockRemoved` works whatever the engine hashes with.

Rules, per member (ZeroMQ Guide ch. 5, applied to an engine's event stream):

- A new member, or a new incarnation of one, starts empty and SYNCING: the feed asks its
  replay socket for everything from seq 0 (engines count from 0 per process), which is the
  full history while the engine's replay buffer still holds it.
- The batch with the next seq applies; one already applied is a duplicate: drop it.
- A later seq means batches were missed (or reordered): hold it (bounded) and answer GAP
  once, so the feed asks a replay from the first missing seq. While a hole is open the
  member is REPLAYING and claims no blocks: a removal in the hole would make it lie.
- A replay that ends with the hole still open and brought nothing new, or one that timed
  out, cannot fill it: the member's blocks are dropped and it becomes UNKNOWN. A replay
  that made progress but left a hole is asked again from the new first missing seq.
- UNKNOWN is a lower bound, never a guess: it holds only blocks stored since and not
  removed, so it never claims a block the engine lacks. `AllBlocksCleared` makes the
  member exact (LIVE) again: the engine holds nothing, and so do we.
- A store whose parent we do not hold, a removal of a block we do not hold, malformed
  token counts, or too many blocks mean our picture is incomplete: the member stays a
  lower bound (UNKNOWN) with what it has; nothing is added that cannot be keyed.
- Only the device tier (medium None or "GPU") and KV cache group 0 are indexed: those
  are the blocks a prefill skips computing.
- Memory is bounded per member (`max_blocks`) and for held-back batches (`MAX_PENDING`,
  and `max_pending_bytes` of their payloads): a member whose held batches would pass the
  bytes cap is not waited for: its history is dropped at once (UNKNOWN, `OVERFLOW`) and
  the batch applies to the emptied index. A publisher that keeps a hole open while it
  streams large batches behind it costs the router this much, and only its own index.

So, after any sequence of batches, lost, duplicated or reordered: a LIVE member's blocks
equal the engine's after the last batch applied, an UNKNOWN member's are a subset, and a
SYNCING or REPLAYING member claims none (tests/test_kv_index.py checks this against a
model with Hypothesis).

Other threads read `published`, an `IndexSnapshot` the writer (the feed, on the router's
event loop) swaps by reference after each turn (`publish`): the reporter, /v1/kv and
/metrics walk that, never the table the writer is changing. A publish costs the members
touched since the last.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Final

import msgspec

from registry.frozen_map import FrozenMap
from router.kv.keys import ROOT_KEY, block_keys, block_salt, chain_key
from wire.kv_events import NO_EXTRA_KEYS, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["Applied", "IndexSnapshot", "IndexState", "KvIndex", "MemberIndex", "MemberStats"]

logger = logging.getLogger(__name__)

MAX_PENDING: Final = 1024  # batches held back while a hole is open, per member
# Payload bytes held back while a hole is open, per member (`--kv-gap-bytes`): a replay
# answers within seconds, and a busy engine sends ~1 MB of events in that time.
DEFAULT_MAX_PENDING_BYTES: Final = 8 * 1024 * 1024
DEFAULT_MAX_BLOCKS: Final = 1_000_000  # per member: ~1M blocks x 128 tokens = 128M tokens
_DEVICE_MEDIA: Final = (None, "GPU")

BlockHash = int | bytes


class IndexState(enum.Enum):
    SYNCING = "syncing"  # subscribed; the first replay has not answered yet
    LIVE = "live"  # every batch since the engine's start (or a clear) applied: exact
    REPLAYING = "replaying"  # a hole is open: no claim until it closes
    UNKNOWN = "unknown"  # history lost: only blocks seen stored since (a lower bound)


class Applied(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already applied (a replay overlapping the live stream)
    HELD = "held"  # beyond a hole; applied when the hole closes
    GAP = "gap"  # beyond a hole: ask a replay from `replay_from`
    DROPPED = "dropped"  # beyond a hole and over MAX_PENDING (a later replay brings it)
    OVERFLOW = "overflow"  # beyond a hole and over the bytes cap: history dropped, applied


@dataclass(frozen=True, slots=True)
class MemberStats:
    """What `pdreg status` shows of one member's index."""

    state: IndexState
    blocks: int
    next_seq: int | None
    last_batch_ts: float  # the engine's wall-clock stamp of the last batch applied; 0 = none
    gaps: int
    replays: int
    losses: int  # times history was lost (became UNKNOWN)
    incarnation: int = 0
    block_size: int = 0  # tokens per block, as registered or learnt (0: not known)


@dataclass(frozen=True, slots=True)
class IndexSnapshot:
    """Every tracked member's stats as the writer last published them. Immutable: any
    thread may hold and walk it."""

    members: Mapping[str, MemberStats]
    retired: tuple[int, int, int]  # gaps, replays, losses of members no longer tracked

    def totals(self) -> tuple[int, int, int]:
        """Gaps, replays and losses (became unknown) since the start, every member."""
        members = list(self.members.values())
        return (self.retired[0] + sum(m.gaps for m in members),
                self.retired[1] + sum(m.replays for m in members),
                self.retired[2] + sum(m.losses for m in members))


class MemberIndex:
    """One member's blocks. See the module docstring for the rules."""

    def __init__(self, member_id: str, incarnation: int,
                 max_blocks: int = DEFAULT_MAX_BLOCKS,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.member_id = member_id
        self.incarnation = incarnation
        self.max_blocks = max_blocks
        self.max_pending_bytes = max_pending_bytes
        self.next_seq: int | None = 0  # None: take whatever seq comes next (history lost)
        self.synced = False  # the first replay has answered (or failed)
        self.exact = True  # every batch since the engine's start or a clear applied
        self.block_size = 0  # learnt from BlockStored
        self.blocks: dict[BlockHash, int] = {}  # engine hash -> our content key
        self.keys: dict[int, int] = {}  # content key -> how many engine hashes map to it
        # Engine hashes stored more than once (two requests computed the same block at
        # once: vLLM caches both and reports each store and each eviction): extra copies.
        self.copies: dict[BlockHash, int] = {}
        self.pending: dict[int, KVEventBatch] = {}
        self.pending_sizes: dict[int, int] = {}  # seq -> payload bytes (held batches)
        self.pending_bytes = 0
        self.replay_outstanding = False
        self.replay_from = 0  # first seq the outstanding replay was asked from
        self.last_batch_ts = 0.0
        self.gaps = self.replays = self.losses = 0

    @property
    def state(self) -> IndexState:
        if not self.synced:
            return IndexState.SYNCING
        if self.pending:
            return IndexState.REPLAYING
        return IndexState.LIVE if self.exact else IndexState.UNKNOWN

    # --- the stream ---------------------------------------------------------------------

    def apply(self, seq: int, batch: KVEventBatch, size: int = 0) -> Applied:
        """One batch, as numbered by the engine; `size`: its payload's bytes."""
        if self.next_seq is None:
            self.next_seq = seq  # history already lost: start from whatever comes
        if seq < self.next_seq:
            return Applied.DUPLICATE
        if seq > self.next_seq:
            return self._hold(seq, batch, size)
        self._apply_in_order(batch)
        self._drain()
        return Applied.APPLIED

    def replay_done(self, complete: bool) -> Applied:
        """The replay asked for answered its end marker (`complete`) or timed out.
        Answers GAP when another replay should be asked (progress made, hole still open)."""
        if not self.replay_outstanding:
            return Applied.DUPLICATE
        self.replay_outstanding = False
        if not self.synced:
            self.synced = True
            if not complete and self.next_seq == 0 and not self.pending:
                # No replay socket: we cannot know what the engine stored before we came.
                self._lose("no replay on subscribe")
                return Applied.APPLIED
        if not self.pending:
            return Applied.APPLIED
        assert self.next_seq is not None  # pending is only filled once a seq is expected
        if complete and self.next_seq > self.replay_from:
            return self._ask_replay()
        self._lose("replay could not fill the gap")
        return Applied.APPLIED

    def start_sync(self) -> Applied:
        """Subscribed: ask the replay for the engine's history from seq 0."""
        self.replay_outstanding = True
        self.replay_from = 0
        return Applied.GAP

    # --- queries ------------------------------------------------------------------------

    @property
    def answers(self) -> bool:
        """What it holds can be claimed: LIVE (exact) or UNKNOWN (a lower bound); not
        while SYNCING or REPLAYING."""
        return self.synced and not self.pending

    def cached_blocks(self, keys: Sequence[int]) -> int:
        """How many of a prompt's leading blocks (`keys`, in order) this member holds."""
        if self.pending or not self.synced:
            return 0  # a hole (or no history yet): claim nothing rather than guess
        # takewhile walks the keys in C: half the cost of a Python loop (it runs for
        # every candidate prefill of every request).
        return len(list(takewhile(self.keys.__contains__, keys)))

    def stats(self) -> MemberStats:
        return MemberStats(self.state, len(self.blocks), self.next_seq, self.last_batch_ts,
                           self.gaps, self.replays, self.losses, self.incarnation,
                           self.block_size)

    # --- rules --------------------------------------------------------------------------

    def lose(self, why: str) -> None:
        """Give up on this member's history (a batch we could not apply): UNKNOWN, empty,
        no replay awaited; it holds what it is seen storing from now on."""
        self.synced = True
        self.replay_outstanding = False
        self._clear_pending()
        self._lose(why)

    def _hold(self, seq: int, batch: KVEventBatch, size: int) -> Applied:
        if seq not in self.pending:
            if len(self.pending) >= MAX_PENDING:
                return Applied.DROPPED
            if self.pending_bytes + size > self.max_pending_bytes:
                # Do not wait for a replay with this much held: a publisher that keeps
                # a hole open would make the router hold whatever it streams behind it.
                self.lose(f"over {self.max_pending_bytes} bytes held behind a gap")
                self.apply(seq, batch)
                return Applied.OVERFLOW
            self.pending[seq] = batch
            self.pending_sizes[seq] = size
            self.pending_bytes += size
        if self.replay_outstanding:
            return Applied.HELD
        self.gaps += 1
        return self._ask_replay()

    def _ask_replay(self) -> Applied:
        assert self.next_seq is not None
        self.replay_outstanding = True
        self.replay_from = self.next_seq
        self.replays += 1
        logger.info("[kv-index] %s: gap at seq %d: replay", self.member_id, self.next_seq)
        return Applied.GAP

    def _drain(self) -> None:
        while self.next_seq in self.pending:
            self.pending_bytes -= self.pending_sizes.pop(self.next_seq, 0)
            self._apply_in_order(self.pending.pop(self.next_seq))

    def _clear_pending(self) -> None:
        self.pending.clear()
        self.pending_sizes.clear()
        self.pending_bytes = 0

    def _lose(self, why: str) -> None:
        """History is gone: drop every block; keep only what comes from now on."""
        logger.warning("[kv-index] %s: index unknown (%s)", self.member_id, why)
        self.losses += 1
        self.exact = False
        self._clear()
        self.next_seq = min(self.pending) if self.pending else None
        self._drain()
        # Anything still held lies beyond another hole: the next batch asks for it.
        self._clear_pending()

    def _clear(self) -> None:
        self.blocks.clear()
        self.keys.clear()
        self.copies.clear()

    def _apply_in_order(self, batch: KVEventBatch) -> None:
        assert self.next_seq is not None
        self.next_seq += 1
        self.last_batch_ts = batch.ts
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self._clear()
                self.exact = True  # the engine holds nothing, and neither do we

    def _stored(self, event: BlockStored) -> None:
        if event.medium not in _DEVICE_MEDIA or event.group_idx not in (None, 0):
            return
        hashes = event.block_hashes
        size = event.block_size
        if len(event.token_ids) != len(hashes) * size:
            self._incomplete(f"BlockStored with {len(event.token_ids)} tokens for "
                             f"{len(hashes)} blocks of {size}")
            return
        if event.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            found = self.blocks.get(event.parent_block_hash)
            if found is None:
                self._incomplete("BlockStored whose parent we do not hold")
                return
            parent = found
        self.block_size = size
        lora = event.lora_name if event.lora_name is not None else event.lora_id
        extra = event.extra_keys
        tokens = event.token_ids
        plain = extra is None or all(_no_extra(e) for e in extra)
        if lora is None and event.cache_salt is None and plain:
            keys = block_keys(tokens, size, parent)  # plain blocks: one conversion
        else:
            keys = []
            for i in range(len(hashes)):
                # LoRA, multimodal hashes, cache salt (vLLM: extra_keys; SGLang:
                # cache_salt): such a block never matches a plain prompt's key.
                extra_i = extra[i] if extra is not None and i < len(extra) else None
                salt = block_salt(lora, None if _no_extra(extra_i) else extra_i,
                                  event.cache_salt)
                parent = chain_key(parent, tokens[i * size:(i + 1) * size], salt)
                keys.append(parent)
        blocks, counts, copies = self.blocks, self.keys, self.copies  # the feed's hot loop
        for block_hash, key in zip(hashes, keys, strict=True):
            if block_hash in blocks:
                copies[block_hash] = copies.get(block_hash, 0) + 1
            elif len(blocks) >= self.max_blocks:
                self._incomplete(f"over {self.max_blocks} blocks")
                return
            else:
                blocks[block_hash] = key
                counts[key] = counts.get(key, 0) + 1

    def _removed(self, event: BlockRemoved) -> None:
        if event.medium not in _DEVICE_MEDIA or event.group_idx not in (None, 0):
            return
        blocks, counts, copies = self.blocks, self.keys, self.copies
        for block_hash in event.block_hashes:
            if copies:  # rare: blocks stored twice
                extra = copies.get(block_hash, 0)
                if extra:
                    if extra == 1:
                        del copies[block_hash]
                    else:
                        copies[block_hash] = extra - 1
                    continue
            key = blocks.pop(block_hash, None)
            if key is None:
                if self.exact:
                    self._incomplete("BlockRemoved of a block we do not hold")
                continue
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]

    def _incomplete(self, why: str) -> None:
        if self.exact:
            logger.warning("[kv-index] %s: index incomplete (%s); now a lower bound",
                           self.member_id, why)
            self.exact = False


def _no_extra(entry: object) -> bool:
    """A block's extra_keys entry that adds nothing: None, or msgpack nil as decoded."""
    return entry is None or (isinstance(entry, msgspec.Raw) and bytes(entry) == NO_EXTRA_KEYS)


class KvIndex:
    """Every tracked member's `MemberIndex`, by member id."""

    def __init__(self, max_blocks_per_member: int = DEFAULT_MAX_BLOCKS,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.max_blocks = max_blocks_per_member
        self.max_pending_bytes = max_pending_bytes
        self.members: dict[str, MemberIndex] = {}
        self._retired = [0, 0, 0]  # gaps, replays, losses of members no longer tracked
        self.published = IndexSnapshot(FrozenMap(), (0, 0, 0))
        self._touched: set[str] = set()  # members changed since the last publish

    def track(self, member_id: str, incarnation: int) -> MemberIndex | None:
        """Start indexing a member; a new incarnation starts from nothing. Returns the new
        index (whose `start_sync` the feed calls) or None if it was already tracked."""
        current = self.members.get(member_id)
        if current is not None and current.incarnation == incarnation:
            return None
        if current is not None:
            self._retire(current)
        index = MemberIndex(member_id, incarnation, self.max_blocks, self.max_pending_bytes)
        self.members[member_id] = index
        self._touched.add(member_id)
        return index

    def forget(self, member_id: str) -> None:
        gone = self.members.pop(member_id, None)
        if gone is not None:
            self._retire(gone)
            self._touched.add(member_id)

    def touched(self, member_id: str) -> None:
        """The writer changed `member_id`'s index (a batch, a replay, a deadline)."""
        self._touched.add(member_id)

    @property
    def unpublished(self) -> bool:
        """Members changed since the last publish."""
        return bool(self._touched)

    def publish(self) -> None:
        """Writer only: swap in a snapshot with the members touched since the last one."""
        if not self._touched:
            return
        members = self.members
        changes = {member_id: index.stats() if (index := members.get(member_id)) else None
                   for member_id in self._touched}
        self._touched.clear()
        self.published = IndexSnapshot(self.published.members.updated(changes),
                                       (self._retired[0], self._retired[1], self._retired[2]))

    def _retire(self, index: MemberIndex) -> None:
        self._retired[0] += index.gaps
        self._retired[1] += index.replays
        self._retired[2] += index.losses

    def retain(self, member_ids: Iterable[str]) -> list[str]:
        """Forget members not in `member_ids`; returns those forgotten."""
        keep = set(member_ids)
        gone = [m for m in self.members if m not in keep]
        for member_id in gone:
            self.forget(member_id)
        return gone

    def get(self, member_id: str, incarnation: int) -> MemberIndex | None:
        index = self.members.get(member_id)
        if index is None or index.incarnation != incarnation:
            return None
        return index

    def cached_blocks(self, member_id: str, incarnation: int, keys: Sequence[int]) -> int:
        index = self.get(member_id, incarnation)
        return 0 if index is None else index.cached_blocks(keys)

    def total_blocks(self) -> int:
        return sum(len(m.blocks) for m in self.members.values())
