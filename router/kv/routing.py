"""Everything the `kv` policy adds to a router, behind one object the router calls at
three seams: membership changed (`on_members`), a request is admitted (`affinity`), a
request's first pair was chosen (`picked`, with the pair and its prediction). Built
only with `--policy kv`.

- `on_members`: follow the ready members that publish KV events (router/kv/feed.py) and
  note, per model, its tokenizer (`--tokenizer MODEL=PATH`, else what members register)
  and its block sizes: only those of ready members it follows (a joining member that
  never becomes routable adds none), at most `--kv-max-block-sizes` per model, those of
  the most members first, since every prompt is keyed once per size; and each model's
  prompt limit (its engines' context, its tokenizer's characters per token), past which
  a request gets a 400 before its body is decoded (router/kv/limits.py). Given the
  members that changed, it costs those (and their models' publishers), not the fleet.
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
- `observed`: the engine's own count of the prompt tokens it found cached, against the
  pair's prediction: a member that keeps falling short is distrusted (router/kv/trust.py),
  counted in `pdreg_router_kv_distrusts{member}`, shown in /v1/kv and `pdreg status
  --router`, and warned of in /ready.

`warnings` (a /ready source, so also logged when it appears: at start-up, not at the
first request) names every model paired as peak_ewma and why, and distrusted members.

Why a model falls back (`why`): `no_events` (none of its members publishes KV events:
zero configuration, the common case without `--kv-events-config`), `no_block_size`,
`no_tokenizer`, `tokenizer_error`; per request: `not_tokenized` (a shape we do not
tokenize: tools, several prompts), `multimodal` (images, audio, video or embeddings: the
engine's block hashes take theirs, which we cannot compute), `no_index` (its publishers
are syncing or replaying), `too_long` (over `--kv-max-prompt-tokens`, or its text over
MAX_CHARS_PER_TOKEN characters per token of it, or a chat of over MAX_CHAT_MESSAGES
messages: the engine would refuse it, and tokenizing it would cost every other request),
`busy` (a long prompt while the long-prompt threads, or this client's share of them, are
taken: router/kv/long_prompts.py). A request naming a LoRA adapter (a member's
`adapters`) or carrying `cache_salt` is keyed with them (router/kv/keys.py), as the
engine keys it. A model the fleet does not serve is labelled `unknown` (clients name it;
the label set stays the fleet's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from registry.client import LiveMember
from router.choice import NO_AFFINITY, Affinity
from router.kv.feed import KvFeed
from router.kv.index import DEFAULT_MAX_PENDING_BYTES, KvIndex
from router.kv.key_cache import PrefixKeyCache
from router.kv.keys import multimodal, request_keys
from router.kv.limits import ModelLimit, PromptLimits
from router.kv.long_prompts import MAX_IN_FLIGHT, PER_CLIENT, LongPromptGate
from router.kv.metrics import KvCollector
from router.kv.policy import (
    DEFAULT_DISAGG_MIN_UNCACHED_TOKENS,
    KvAffinity,
    KvPairer,
    make_kv_pairer,
)
from router.kv.publishers import MAX_BLOCK_SIZES, ModelKv, Publishers
from router.kv.tokenizer import ByteTokenizer, PromptTokenizer, TokenizerSet, prompt_ids
from router.kv.trust import CacheTrust, Verdict
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.policies import DEFAULT_STALE_LOAD_S, prompt_key
from router.readiness import ReadyWarning
from router.table import Pair

__all__ = ["MAX_BLOCK_SIZES", "KvOptions", "KvRouting"]

logger = logging.getLogger(__name__)

# Prompts longer than this (characters, or token ids) are tokenized and keyed in a worker
# thread: a 100k-token prompt takes milliseconds the event loop must not stall for.
OFF_LOOP_CHARS: Final = 8192
# ...unless they need no tokenizer.json: the client's own ids, or the byte tokenizer's
# (built in C). Keying 32k tokens costs 0.1-0.8 ms (bench/RESULTS.md), and a thread hop
# costs 50-100 us of CPU: below this, keying on the loop is cheaper for everyone.
CHEAP_OFF_LOOP_TOKENS: Final = 32_768
# Longer prompts are not matched (`too_long`): the engine refuses a prompt over its
# context, and a 4 MB prompt costs 0.3-0.4 s of tokenizing. 128k: today's long contexts.
DEFAULT_MAX_PROMPT_TOKENS: Final = 131_072
# A text prompt is tokenized only up to this many characters per token allowed: real
# tokenizers average 3-5 characters per token of prose (bytes: 1), so a longer text
# is surely over the limit and is not worth tokenizing to find out.
MAX_CHARS_PER_TOKEN: Final = 8
MAX_CHAT_MESSAGES: Final = 4096  # a chat template renders in Python, holding the GIL


@dataclass(frozen=True, slots=True)
class KvOptions:
    """What `pdreg router` is told of the `kv` policy (`RouterConfig.kv`)."""

    # (model, tokenizer path or hub name): --tokenizer MODEL=PATH, else what members register
    tokenizers: tuple[tuple[str, str], ...] = ()
    # A prompt the chosen decode holds part of and would compute fewer tokens of than
    # this itself skips the prefill leg (conditional disaggregation); 0: never.
    disagg_min_uncached_tokens: int = DEFAULT_DISAGG_MIN_UNCACHED_TOKENS
    gap_bytes: int = DEFAULT_MAX_PENDING_BYTES  # held behind a gap per member (index.py)
    max_block_sizes: int = MAX_BLOCK_SIZES  # distinct block sizes keyed per model
    # Prompts over this many tokens are not matched (`--kv-max-prompt-tokens`): set it
    # to the model's context length.
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    # Long prompts tokenized at once, and per client address (router/kv/long_prompts.py).
    long_prompt_threads: int = MAX_IN_FLIGHT
    long_prompts_per_client: int = PER_CLIENT


class KvRouting:
    def __init__(self, metrics: RouterMetrics, options: KvOptions = KvOptions(), *,
                 allows: Callable[[str], bool],
                 stale_after_s: float = DEFAULT_STALE_LOAD_S,
                 tokenizer_set: TokenizerSet | None = None,
                 latency: LatencyTracker | None = None) -> None:
        """`latency`: the router's tracker, which its outcomes feed (the fallback and the
        decodes are `peak_ewma`'s choice). `tokenizer_set`: tests hand in their own."""
        self.metrics = metrics
        self.index = KvIndex(max_pending_bytes=options.gap_bytes)
        self.feed = KvFeed(self.index, allows=allows)
        self.trust = CacheTrust()  # members whose reports contradict their events
        # member id -> monotonic time its distrust ends: replaced whole (never mutated) on
        # the loop, so the reporter's thread reads it through `status` safely.
        self._distrusted_until: Mapping[str, float] = {}
        self.pairer: KvPairer = make_kv_pairer(
            self.index, stale_after_s=stale_after_s, latency=latency,
            disagg_min_uncached_tokens=options.disagg_min_uncached_tokens, trust=self.trust)
        self.tokenizers = tokenizer_set or TokenizerSet(dict(options.tokenizers))
        self.key_cache = PrefixKeyCache()  # prompts sharing a prefix key it once
        self.max_prompt_tokens = options.max_prompt_tokens
        self.long_prompts = LongPromptGate(options.long_prompt_threads,
                                           options.long_prompts_per_client)
        # Long prompts' own threads (the loop's default executor serves DNS and others).
        self._long_threads = ThreadPoolExecutor(self.long_prompts.max_in_flight,
                                                thread_name_prefix="kv-tokenize")
        # Who publishes what, per model (decodes only under conditional disaggregation)
        self.publishers = Publishers(options.max_block_sizes,
                                     follow_decodes=bool(options.disagg_min_uncached_tokens))
        self._matching: dict[str, str] = {}  # model -> "" (exact) or why it falls back
        self.limits = PromptLimits()  # prompts surely over their model's context: 400
        self._logged: set[tuple[str, str]] = set()
        metrics.registry.register(KvCollector(self.index, self.feed))

    def close(self) -> None:
        self.feed.close()
        self._long_threads.shutdown(wait=False, cancel_futures=True)

    # --- seams --------------------------------------------------------------------------

    def on_members(self, members: Mapping[str, LiveMember],
                   moved: Collection[str] | None = None) -> None:
        """Membership changed: `moved`, the ids that joined, left or have a new record
        (None: every member, read whole). Costs those ids, and the publishers of the
        models they belong to (router/kv/publishers.py)."""
        change = self.publishers.update(members, moved)
        if change.fleet:
            fleet = self.publishers.fleet
            self._matching = {m: why for m, why in self._matching.items() if m in fleet}
        if change.follow is not None:
            self.feed.update(change.follow)
        self._update_limits()

    async def affinity(self, body: Mapping[str, Any], model: str,
                       client: str = "") -> Affinity:
        """`client`: the sender's address, whose long prompts are tokenized one at a
        time (router/kv/long_prompts.py)."""
        self.feed.drain()  # the choice reads the index: what reached us applies first
        info = self.publishers.models.get(model)
        if info is None:  # client-named models label metrics only when the fleet serves them
            known = model in self.publishers.fleet
            return self._inexact(model if known else "unknown", "no_events")
        block_sizes = info.block_sizes or self._learnt_block_sizes(info)
        if not block_sizes:
            return self._inexact(model, "no_block_size")
        salt = body.get("cache_salt")
        if salt is not None and not (isinstance(salt, str) and salt):
            return self._inexact(model, "not_tokenized")  # the engine refuses it anyway
        if multimodal(body):  # the engine hashes the images: we cannot
            return self._inexact(model, "multimodal")
        scope = (model if model in self.publishers.adapters else None, salt)
        tokenizer = self.tokenizers.get(model, info.tokenizer_source)
        size, messages = _size(body)
        if size > self.max_prompt_tokens * MAX_CHARS_PER_TOKEN or messages > MAX_CHAT_MESSAGES:
            return self._inexact(model, "too_long")  # not worth tokenizing to find out
        started = time.perf_counter()
        try:
            cheap = tokenizer is None or isinstance(tokenizer, ByteTokenizer) \
                or isinstance(body.get("prompt"), list)
            if size > (CHEAP_OFF_LOOP_TOKENS if cheap else OFF_LOOP_CHARS):
                if not self.long_prompts.enter(client):
                    return self._inexact(model, "busy")
                try:
                    loop = asyncio.get_running_loop()
                    keyed = await loop.run_in_executor(
                        self._long_threads, _key, tokenizer, body, block_sizes,
                        self.key_cache, self.max_prompt_tokens, scope)
                finally:
                    self.long_prompts.leave(client)
            else:
                keyed = _key(tokenizer, body, block_sizes, self.key_cache,
                             self.max_prompt_tokens, scope)
        except Exception:  # a tokenizer that fails on odd input must not fail the request
            logger.exception("[kv] tokenizing a %s prompt failed; peak_ewma for it", model)
            return self._inexact(model, "tokenizer_error")
        self.metrics.tokenize_seconds.labels(model).observe(time.perf_counter() - started)
        if isinstance(keyed, str):
            return self._inexact(model, keyed)
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

    def observed(self, pair: Pair, reported_tokens: int) -> None:
        """The engine that computed `pair`'s prompt found `reported_tokens` of it cached;
        `pair` carries what the policy predicted. A member that keeps falling short is
        distrusted (router/kv/trust.py): counted, logged, shown in /v1/kv and /ready."""
        if not pair.exact:
            return  # predicted from load alone: no claim to check
        verdict = self.trust.observe(pair.prefill.id, pair.cached_tokens, reported_tokens,
                                     time.monotonic())
        if verdict is Verdict.IGNORED:
            return
        self.metrics.kv_cache_reports.labels(
            "kept" if verdict is Verdict.KEPT else "short").inc()
        if verdict is Verdict.DISTRUSTED:
            now = time.monotonic()
            self._distrusted_until = {m: now + left
                                      for m, left in self.trust.distrusted(now).items()}
            self.metrics.kv_distrusts.labels(pair.prefill.id).inc()
            left = self._distrusted_until[pair.prefill.id] - now
            logger.warning("[kv] distrust id=%s for %.0fs: its engine keeps finding far "
                           "fewer prompt tokens cached than its KV events claim (last: "
                           "%d of %d); scored as holding nothing", pair.prefill.id, left,
                           reported_tokens, pair.cached_tokens)

    def warnings(self) -> list[ReadyWarning]:
        """For /ready: models whose requests are not matched exactly (paired as
        peak_ewma, and why), and members whose KV events are distrusted."""
        out = [ReadyWarning("requests for a model cannot be matched to the engines' KV "
                            "caches exactly; its prefills are chosen as peak_ewma",
                            f"model {model}: {p['why']}{_HINTS.get(p['why'], '')}")
               for model, p in self.models().items() if p["pairing"] == "peak_ewma"]
        distrusted = sorted(self.trust.distrusted(time.monotonic()))
        if distrusted:
            out.append(ReadyWarning(
                "members whose engines keep finding far fewer prompt tokens cached than "
                "their KV events claim are scored as holding nothing",
                "distrusted: " + ", ".join(distrusted)))
        return out

    def report(self, now_wall: float) -> dict[str, Any]:
        """/v1/kv: `members` (`status`) and `models` (`models`)."""
        return {"members": self.status(now_wall), "models": self.models()}

    def models(self) -> dict[str, dict[str, Any]]:
        """Per model the fleet serves: how its last request was paired (`exact`, or
        `peak_ewma` and why; `pending` before its first request when some member
        publishes), and how many members publish KV events (/v1/kv)."""
        out: dict[str, dict[str, Any]] = {}
        for model in sorted(self.publishers.fleet):
            info = self.publishers.models.get(model)
            why = "no_events" if info is None else self._matching.get(model)
            pairing = "pending" if why is None else "peak_ewma" if why else "exact"
            out[model] = {"pairing": pairing, "why": why or "",
                          "publishers": len(info.members) if info is not None else 0}
        return out

    def status(self, now_wall: float) -> list[dict[str, Any]]:
        """Per member: index state, blocks, event lag; for /kv and `pdreg status`. From
        the index's published snapshot: any thread may call it (the reporter does)."""
        out = []
        now, distrusted = time.monotonic(), self._distrusted_until
        for member_id, s in sorted(self.index.published.members.items()):
            until = distrusted.get(member_id, 0.0)
            left = until - now if until > now else None
            out.append({"id": member_id, "incarnation": s.incarnation,
                        "state": s.state.value, "blocks": s.blocks, "next_seq": s.next_seq,
                        "lag_s": round(max(0.0, now_wall - s.last_batch_ts), 3)
                        if s.last_batch_ts else None,
                        "gaps": s.gaps, "replays": s.replays, "unknown": s.losses,
                        "distrusted_s": round(left, 1) if left is not None else None})
        return out

    def _update_limits(self) -> None:
        """Each model's prompt limit, where its context and tokenizer bound are known."""
        limits = {}
        for model in self.publishers.fleet:
            context = self.publishers.context_length(model)
            if context is None:
                continue
            info = self.publishers.models.get(model)
            tokenizer = self.tokenizers.get(model, info.tokenizer_source if info else "")
            per_token = tokenizer.max_chars_per_token if tokenizer is not None else None
            if per_token:
                limits[model] = ModelLimit(context, per_token)
        self.limits.update(limits)

    def _learnt_block_sizes(self, info: ModelKv) -> tuple[int, ...]:
        """Block sizes the members' events showed (a spec that did not say)."""
        stats = self.index.published.members
        return self.publishers.commonest(s.block_size for m in info.members
                                         if (s := stats.get(m)) is not None and s.block_size)

    def _inexact(self, model: str, why: str) -> Affinity:
        self.metrics.kv_inexact_requests.labels(model, why).inc()
        if why not in PER_REQUEST:
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


# Why one request was not matched, while the model's others are: counted, but the model
# stays exact (its gauge, /ready and status speak of the model, not of one prompt).
PER_REQUEST: Final = frozenset({"too_long", "busy", "multimodal", "not_tokenized",
                                "tokenizer_error"})

_HINTS: Final = {
    "no_events": "; its engines publish no KV events (vLLM/SGLang --kv-events-config, "
                 "the reference engine by default unless --no-kv-events)",
    "no_tokenizer": "; no tokenizer for it here (--tokenizer MODEL=PATH)",
    "no_block_size": "; its members registered no block size and no events came yet",
}


def _size(body: Mapping[str, Any]) -> tuple[int, int]:
    """A request's prompt before tokenizing: its characters (token ids for a prompt of
    ids; a chat's contents summed) and its chat messages."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str | list):
        return len(prompt), 0
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_CHAT_MESSAGES:
            return 0, len(messages)  # too many already: not worth a walk on the loop
        return sum(_content_size(m.get("content")) for m in messages
                   if isinstance(m, dict)), len(messages)
    return 0, 0


def _content_size(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # parts: their texts (other parts are not tokenized)
        return sum(len(p["text"]) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _key(tokenizer: PromptTokenizer | None, body: Mapping[str, Any],
         block_sizes: tuple[int, ...], cache: PrefixKeyCache, max_tokens: int,
         scope: tuple[str | None, str | None] = (None, None)
         ) -> tuple[int, dict[int, list[int]]] | str:
    """The prompt's length and block keys per block size, or why it is not matched.
    `scope`: the request's LoRA adapter and cache salt, which salt its block keys (such
    prompts are keyed whole: the prefix key cache holds plain keys only)."""
    ids: Sequence[int] | None = prompt_ids(tokenizer, body)
    if ids is None:
        return "no_tokenizer" if tokenizer is None else "not_tokenized"
    if len(ids) > max_tokens:
        return "too_long"
    if scope != (None, None):
        return len(ids), {size: request_keys(ids, size, *scope) for size in block_sizes}
    return len(ids), {size: cache.keys(ids, size) for size in block_sizes}
