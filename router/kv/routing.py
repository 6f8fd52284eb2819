"""Everything the `kv` policy adds to a router, behind one object the router calls at
three seams: membership changed (`on_members`), a request is admitted (`affinity`), a
request's first pair was chosen (`picked`, with the pair and its prediction). Built
only with `--policy kv`.

- `on_members`: follow the ready members that publish KV events (router/kv/feed.py) and
  note, per model, its tokenizer (`--tokenizer MODEL=PATH`, else what members register)
  and its block sizes; given the members that changed, it costs those (and their
  models' publishers), not the fleet.
- `affinity`: the prompt's exact token ids (the client's, else tokenized: off the event
  loop when long) and its block keys per block size -> a `KvAffinity`. A model or
  request we cannot match exactly gets a plain `Affinity` instead, and its prefill is
  chosen as `peak_ewma` chooses (router/kv/policy.py), counted in
  `pdreg_router_kv_inexact_requests{model,why}`, shown in `pdreg_router_kv_exact{model}`
  and in `models()` (/v1/kv, `pdreg status --router`), and logged once per model and why.
- `picked`: count routed and predicted-cached prompt tokens per model (the pair carries
  the prediction: `Pair.cached_tokens`); a request matched exactly whose eligible
  prefills had no index that could answer (`Pair.exact` false: why `no_index`) fell
  back too.

Why a model falls back (`why`): `no_events` (none of its members publishes KV events:
zero configuration, the common case without `--kv-events-config`), `no_block_size`,
`no_tokenizer`, `tokenizer_error`; per request: `not_tokenized` (a shape we do not
tokenize: tools, images, several prompts), `no_index` (its publishers are syncing or
replaying). A model the fleet does not serve is labelled `unknown` (clients name it;
the label set stays the fleet's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from registry.client import LiveMember
from router.choice import NO_AFFINITY, Affinity
from router.kv.feed import FeedMember, KvFeed
from router.kv.index import KvIndex
from router.kv.keys import block_keys
from router.kv.metrics import KvCollector
from router.kv.policy import KvAffinity, KvPairer, make_kv_pairer
from router.kv.tokenizer import PromptTokenizer, TokenizerSet, prompt_ids
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.policies import DEFAULT_STALE_LOAD_S, prompt_key
from router.table import Pair
from wire.protocol import MemberState, Role

__all__ = ["KvOptions", "KvRouting"]

logger = logging.getLogger(__name__)

# Prompts longer than this (characters, or token ids) are tokenized and keyed in a worker
# thread: a 100k-token prompt takes milliseconds the event loop must not stall for.
OFF_LOOP_CHARS: Final = 8192


@dataclass(frozen=True, slots=True)
class KvOptions:
    """What `pdreg router` is told of the `kv` policy (`RouterConfig.kv`)."""

    # (model, tokenizer path or hub name): --tokenizer MODEL=PATH, else what members register
    tokenizers: tuple[tuple[str, str], ...] = ()
    # A prompt the chosen decode would compute fewer tokens of than this itself skips
    # the prefill leg (conditional disaggregation); 0: never.
    disagg_min_uncached_tokens: int = 0


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


class KvRouting:
    def __init__(self, metrics: RouterMetrics, options: KvOptions = KvOptions(), *,
                 allows: Callable[[str], bool],
                 stale_after_s: float = DEFAULT_STALE_LOAD_S,
                 tokenizer_set: TokenizerSet | None = None,
                 latency: LatencyTracker | None = None) -> None:
        """`latency`: the router's tracker, which its outcomes feed (the fallback and the
        decodes are `peak_ewma`'s choice). `tokenizer_set`: tests hand in their own."""
        self.metrics = metrics
        self.index = KvIndex()
        self.feed = KvFeed(self.index, allows=allows)
        self.pairer: KvPairer = make_kv_pairer(
            self.index, stale_after_s=stale_after_s, latency=latency,
            disagg_min_uncached_tokens=options.disagg_min_uncached_tokens)
        self.tokenizers = tokenizer_set or TokenizerSet(dict(options.tokenizers))
        self._models: dict[str, ModelKv] = {}  # models with members that publish
        self._fleet: frozenset[str] = frozenset()  # every model the fleet serves
        # What `on_members` follows, per member, so a change costs its members alone:
        self._publishers: dict[str, dict[str, _Publisher]] = {}  # model -> id -> kv
        self._publisher_model: dict[str, str] = {}  # id -> model, of those
        self._engine_model: dict[str, str] = {}  # id -> model, every engine member
        self._engines: Counter[str] = Counter()  # model -> engine members
        self._matching: dict[str, str] = {}  # model -> "" (exact) or why it falls back
        self._logged: set[tuple[str, str]] = set()
        metrics.registry.register(KvCollector(self.index, self.feed))

    def close(self) -> None:
        self.feed.close()

    # --- seams --------------------------------------------------------------------------

    def on_members(self, members: Mapping[str, LiveMember],
                   moved: Collection[str] | None = None) -> None:
        """Membership changed: `moved`, the ids that joined, left or have a new record
        (None: every member, read whole). Costs those ids, and the publishers of the
        models they belong to."""
        whole = moved is None
        if moved is None:
            self._publishers.clear()
            self._publisher_model.clear()
            self._engine_model.clear()
            self._engines.clear()
            self._models.clear()
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
        if fleet_changed:
            self._fleet = frozenset(self._engines)
            self._matching = {m: why for m, why in self._matching.items()
                              if m in self._fleet}
        if dirty or whole:
            self.feed.update(p.follow for held in self._publishers.values()
                             for p in held.values() if p.follow is not None)

    def _add(self, member: LiveMember, dirty: set[str]) -> bool:
        """Take `member` in; whether the fleet's set of models changed."""
        spec = member.record.spec
        if spec.role is Role.API_SERVER:
            return False
        self._engine_model[spec.id] = spec.model
        self._engines[spec.model] += 1
        kv = spec.kv_events
        if kv is not None and (spec.role is not Role.DECODE
                               or self.pairer.disagg_min_uncached_tokens):
            # (a decode's cache matters only to conditional disaggregation)
            follow = (FeedMember(spec.id, spec.incarnation, kv)
                      if member.record.state is MemberState.READY else None)
            self._publishers.setdefault(spec.model, {})[spec.id] = _Publisher(
                kv.tokenizer, kv.block_size, follow)
            self._publisher_model[spec.id] = spec.model
            dirty.add(spec.model)
        return self._engines[spec.model] == 1

    def _drop(self, member_id: str, dirty: set[str]) -> bool:
        """Forget what `member_id` was; whether the fleet's set of models changed."""
        model = self._publisher_model.pop(member_id, None)
        if model is not None:
            held = self._publishers[model]
            del held[member_id]
            if not held:
                del self._publishers[model]
            dirty.add(model)
        model = self._engine_model.pop(member_id, None)
        if model is None:
            return False
        self._engines[model] -= 1
        if self._engines[model]:
            return False
        del self._engines[model]
        return True

    def _model_changed(self, model: str) -> None:
        """What `model`'s publishers registered: its tokenizer (the first by id that
        names one) and block sizes."""
        held = self._publishers.get(model)
        if not held:
            self._models.pop(model, None)
            return
        ids = tuple(sorted(held))
        source = next((held[i].tokenizer for i in ids if held[i].tokenizer), "")
        sizes = tuple(sorted({p.block_size for p in held.values() if p.block_size}))
        self._models[model] = ModelKv(source, sizes, ids)

    async def affinity(self, body: Mapping[str, Any], model: str) -> Affinity:
        info = self._models.get(model)
        if info is None:  # client-named models label metrics only when the fleet serves them
            return self._inexact(model if model in self._fleet else "unknown", "no_events")
        block_sizes = info.block_sizes or self._learnt_block_sizes(info)
        if not block_sizes:
            return self._inexact(model, "no_block_size")
        tokenizer = self.tokenizers.get(model, info.tokenizer_source)
        started = time.perf_counter()
        try:
            if _long(body):
                loop = asyncio.get_running_loop()
                keyed = await loop.run_in_executor(None, _key, tokenizer, body, block_sizes)
            else:
                keyed = _key(tokenizer, body, block_sizes)
        except Exception:  # a tokenizer that fails on odd input must not fail the request
            logger.exception("[kv] tokenizing a %s prompt failed; peak_ewma for it", model)
            return self._inexact(model, "tokenizer_error")
        self.metrics.tokenize_seconds.labels(model).observe(time.perf_counter() - started)
        if keyed is None:
            return self._inexact(model, "no_tokenizer" if tokenizer is None
                                 else "not_tokenized")
        n, keys = keyed
        # The cached-nowhere ring (router/kv/policy.py) keys on the prompt's first bytes.
        return KvAffinity(key=prompt_key("", body), prompt_tokens=n, keys=keys)

    def picked(self, model: str, affinity: Affinity, pair: Pair) -> None:
        """A request's first pair (not a retry's or a migration's)."""
        if not isinstance(affinity, KvAffinity):
            return  # not matched exactly: counted at admission (`_inexact`)
        self.metrics.prompt_tokens.labels(model).inc(affinity.prompt_tokens)
        self.metrics.prompt_tokens_cached.labels(model).inc(pair.cached_tokens)
        if pair.exact:
            self._note(model, "")
        else:
            self.metrics.kv_inexact_requests.labels(model, "no_index").inc()
            self._note(model, "no_index")

    def report(self, now_wall: float) -> dict[str, Any]:
        """/v1/kv: `members` (`status`) and `models` (`models`)."""
        return {"members": self.status(now_wall), "models": self.models()}

    def models(self) -> dict[str, dict[str, Any]]:
        """Per model the fleet serves: how its last request was paired (`exact`, or
        `peak_ewma` and why; `pending` before its first request when some member
        publishes), and how many members publish KV events (/v1/kv)."""
        out: dict[str, dict[str, Any]] = {}
        for model in sorted(self._fleet):
            info = self._models.get(model)
            why = "no_events" if info is None else self._matching.get(model)
            pairing = "pending" if why is None else "peak_ewma" if why else "exact"
            out[model] = {"pairing": pairing, "why": why or "",
                          "publishers": len(info.members) if info is not None else 0}
        return out

    def status(self, now_wall: float) -> list[dict[str, Any]]:
        """Per member: index state, blocks, event lag; for /kv and `pdreg status`. From
        the index's published snapshot: any thread may call it (the reporter does)."""
        out = []
        for member_id, s in sorted(self.index.published.members.items()):
            out.append({"id": member_id, "incarnation": s.incarnation,
                        "state": s.state.value, "blocks": s.blocks, "next_seq": s.next_seq,
                        "lag_s": round(max(0.0, now_wall - s.last_batch_ts), 3)
                        if s.last_batch_ts else None,
                        "gaps": s.gaps, "replays": s.replays, "unknown": s.losses})
        return out

    def _learnt_block_sizes(self, info: ModelKv) -> tuple[int, ...]:
        """Block sizes the members' events showed (a spec that did not say)."""
        stats = self.index.published.members
        return tuple(sorted({s.block_size for m in info.members
                             if (s := stats.get(m)) is not None and s.block_size}))

    def _inexact(self, model: str, why: str) -> Affinity:
        self.metrics.kv_inexact_requests.labels(model, why).inc()
        self._note(model, why)
        return NO_AFFINITY  # peak_ewma's choice needs no key

    def _note(self, model: str, why: str) -> None:
        """How `model` is paired now: exact (`why` ""), else peak_ewma and why. The gauge
        follows; the log says it once per model and reason, not once per request."""
        if self._matching.get(model) == why:
            return  # the usual case, once per request: nothing changed
        self.metrics.kv_exact.labels(model).set(0 if why else 1)
        if model == "unknown":
            return
        self._matching[model] = why
        if why and (model, why) not in self._logged:
            self._logged.add((model, why))
            logger.info("[kv] model %s: paired as peak_ewma (%s)%s", model, why,
                        _HINTS.get(why, ""))


_HINTS: Final = {
    "no_events": "; its engines publish no KV events (vLLM/SGLang --kv-events-config, "
                 "the reference engine --kv-events)",
    "no_tokenizer": "; no tokenizer for it here (--tokenizer MODEL=PATH)",
    "no_block_size": "; its members registered no block size and no events came yet",
}


def _long(body: Mapping[str, Any]) -> bool:
    prompt = body.get("prompt")
    if isinstance(prompt, str | list):
        return len(prompt) > OFF_LOOP_CHARS
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) \
            > OFF_LOOP_CHARS
    return False


def _key(tokenizer: PromptTokenizer | None, body: Mapping[str, Any],
         block_sizes: tuple[int, ...]) -> tuple[int, dict[int, list[int]]] | None:
    ids = prompt_ids(tokenizer, body)
    if ids is None:
        return None
    return len(ids), {size: block_keys(ids, size) for size in block_sizes}
