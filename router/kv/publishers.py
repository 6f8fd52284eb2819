"""Who publishes KV events, per model: what the `kv` policy follows and keys prompts for.

Kept from the view's changes: a change costs the members that changed and their models'
publishers, never a walk of the fleet (a router of every model at 100k members sees
several changes a second). Per model: its tokenizer (the first publisher by id that names
one), its block sizes (those of the ready members followed, the commonest first, at most
`max_block_sizes`: every prompt is keyed once per size, so joining members that never
become routable cannot multiply that), and its publishers' ids. A member serves its
base model and its LoRA adapters (`served`): an adapter shares its base model's
tokenizer and events. Per model also the longest context its engines registered
(`context_length`): a prompt surely longer is refused (router/kv/limits.py). Pure: no
I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from registry.client import LiveMember
from router.kv.feed import FeedMember
from router.table import served
from wire.protocol import MemberState, Role

__all__ = ["MAX_BLOCK_SIZES", "ModelKv", "Publishers", "PublishersChange"]

# Block sizes a model's prompts are keyed for (`--kv-max-block-sizes`): a fleet mid-way
# through a change of --block-size has two; each one more costs a keying of every prompt.
MAX_BLOCK_SIZES: Final = 4


@dataclass(frozen=True, slots=True)
class ModelKv:
    tokenizer_source: str  # "" = none registered
    block_sizes: tuple[int, ...]  # as registered; empty: learnt from the events
    members: tuple[str, ...]  # its members that publish KV events


@dataclass(frozen=True, slots=True)
class _Publisher:
    """What a member that publishes KV events registered."""

    tokenizer: str
    block_size: int
    follow: FeedMember | None  # None: not ready, not followed


@dataclass(frozen=True, slots=True)
class PublishersChange:
    """What one `update` changed: `fleet`, whether the set of models served did;
    `follow`, the members to follow now (None: the same as before)."""

    fleet: bool
    follow: list[FeedMember] | None


class Publishers:
    def __init__(self, max_block_sizes: int = MAX_BLOCK_SIZES, *,
                 follow_decodes: bool = False) -> None:
        """`follow_decodes`: a decode's cache matters only to conditional
        disaggregation."""
        self.max_block_sizes = max_block_sizes
        self.follow_decodes = follow_decodes
        self.models: dict[str, ModelKv] = {}  # models with members that publish
        self.fleet: frozenset[str] = frozenset()  # every model the fleet serves
        self.adapters: frozenset[str] = frozenset()  # of those, LoRA adapters' names
        self._by_model: dict[str, dict[str, _Publisher]] = {}  # model -> id -> kv
        self._publisher_models: dict[str, tuple[str, ...]] = {}  # id -> models, of those
        self._engine_models: dict[str, tuple[str, ...]] = {}  # id -> models, every engine
        self._engines: Counter[str] = Counter()  # model (or adapter) -> engine members
        # model -> its engine members' context lengths (0: one did not say), and per id
        self._lengths: dict[str, Counter[int]] = {}
        self._length_of: dict[str, int] = {}
        self._adapter_count: Counter[str] = Counter()  # adapter -> engine members

    def update(self, members: Mapping[str, LiveMember],
               moved: Collection[str] | None = None) -> PublishersChange:
        """Membership changed: `moved`, the ids that joined, left or have a new record
        (None: every member, read whole). Costs those ids, and the publishers of the
        models they belong to."""
        whole = moved is None
        if moved is None:
            self._by_model.clear()
            self._publisher_models.clear()
            self._engine_models.clear()
            self._engines.clear()
            self._adapter_count.clear()
            self._lengths.clear()
            self._length_of.clear()
            self.models.clear()
            moved = members.keys()
        dirty: set[str] = set()  # models whose publishers changed
        fleet_changed = False
        for member_id in moved:
            fleet_changed |= self._drop(member_id, dirty)
            member = members.get(member_id)
            if member is not None:
                fleet_changed |= self._add(member, dirty)
        for model in dirty:
            self._model_changed(model)
        if fleet_changed or whole:
            self.fleet = frozenset(self._engines)
            self.adapters = frozenset(self._adapter_count)
        follow = None
        if dirty or whole:  # a member serving a base model and adapters is followed once
            follow = list({p.follow.id: p.follow for held in self._by_model.values()
                           for p in held.values() if p.follow is not None}.values())
        return PublishersChange(fleet_changed or whole, follow)

    def _add(self, member: LiveMember, dirty: set[str]) -> bool:
        """Take `member` in; whether the fleet's set of models changed."""
        spec = member.record.spec
        if spec.role is Role.API_SERVER:
            return False
        models = served(spec)  # an adapter shares its base model's tokenizer and events
        self._engine_models[spec.id] = models
        self._length_of[spec.id] = spec.max_model_len
        changed = False
        for model in models:
            self._engines[model] += 1
            self._lengths.setdefault(model, Counter())[spec.max_model_len] += 1
            changed |= self._engines[model] == 1
        self._adapter_count.update(spec.adapters)
        kv = spec.kv_events
        if kv is not None and (spec.role is not Role.DECODE or self.follow_decodes):
            follow = (FeedMember(spec.id, spec.incarnation, kv)
                      if member.record.state is MemberState.READY else None)
            publisher = _Publisher(kv.tokenizer, kv.block_size, follow)
            for model in models:
                self._by_model.setdefault(model, {})[spec.id] = publisher
            self._publisher_models[spec.id] = models
            dirty.update(models)
        return changed

    def _drop(self, member_id: str, dirty: set[str]) -> bool:
        """Forget what `member_id` was; whether the fleet's set of models changed."""
        for model in self._publisher_models.pop(member_id, ()):
            held = self._by_model[model]
            del held[member_id]
            if not held:
                del self._by_model[model]
            dirty.add(model)
        models = self._engine_models.pop(member_id, ())
        length = self._length_of.pop(member_id, 0)
        changed = False
        for model in models:
            self._engines[model] -= 1
            lengths = self._lengths[model]
            lengths[length] -= 1
            if not lengths[length]:
                del lengths[length]
                if not lengths:
                    del self._lengths[model]
            if not self._engines[model]:
                del self._engines[model]
                changed = True
                self._adapter_count.pop(model, None)
            elif model in self._adapter_count:
                self._adapter_count[model] -= 1
        return changed

    def _model_changed(self, model: str) -> None:
        """What `model`'s publishers registered: its tokenizer (the first by id that
        names one) and block sizes (those of the ready members followed, the commonest
        first, at most `max_block_sizes`)."""
        held = self._by_model.get(model)
        if not held:
            self.models.pop(model, None)
            return
        ids = tuple(sorted(held))
        source = next((held[i].tokenizer for i in ids if held[i].tokenizer), "")
        sizes = self.commonest(p.block_size for p in held.values()
                                if p.block_size and p.follow is not None)
        self.models[model] = ModelKv(source, sizes, ids)

    def context_length(self, model: str) -> int | None:
        """The longest context (tokens) any engine member of `model` registered; None
        when one said nothing (it may take any length) or none serves it."""
        lengths = self._lengths.get(model)
        if not lengths or 0 in lengths:
            return None
        return max(lengths)

    def commonest(self, sizes: Iterable[int]) -> tuple[int, ...]:
        """The block sizes most members have, at most `max_block_sizes` (ties: the
        smaller size), in order: a few members cannot multiply the keying of prompts."""
        ranked = sorted(Counter(sizes).items(), key=lambda kv: (-kv[1], kv[0]))
        return tuple(sorted(size for size, _ in ranked[:self.max_block_sizes]))
