"""`StoreSync`: the store's side of a registry, beside its busy loop.

    store thread   Store.run: loaded / changed / status ─► decode, bound ─► loop's admin
                   queue (`submit`): Membership.apply_intent, in revision order
    HTTP threads   write / remove (an admin write: the store first, at most a request's
                   timeout, StoreUnavailable -> 503) ─► wait_applied (read your writes)
    sweep thread   every SWEEP_PERIOD_S: expired intents deleted from the store

The loop stays the only writer of membership and never waits on the store: store I/O
runs on these threads, and what it brings reaches the loop the way admin actions always
have. Heartbeats never touch the store. A write takes effect here the same way as
everywhere else: from the store's report of it (`changed`), so every registry acts alike.

What is held here besides: the replica set (`registries`) and the intents with their
revisions (`intents`), each an immutable mapping swapped whole for the HTTP side to read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Final

from registry.store.base import Change, Item, Store, StoreUnavailable
from registry.store.memory import FileStore, MemoryStore
from registry.store.metrics import StoreStats
from registry.store.records import (
    BadRecord,
    Intent,
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
from registry.store.url import EtcdOptions, StoreKind, StoreUrl

__all__ = ["HeldIntent", "StoreSync", "open_store"]

logger = logging.getLogger(__name__)

SWEEP_PERIOD_S: Final = 60.0
# Intents held at most (a store with more is misused or hostile: each is up to 4 KiB and
# the loop consults them on every registration); beyond it new ones are refused.
MAX_INTENTS: Final = 100_000
Action = Callable[[Any, float], Any]  # (Membership, now) -> anything, run on the loop
HeldIntent = tuple[Intent, int]  # the intent and the revision that wrote it


def open_store(url: StoreUrl, options: EtcdOptions, stats: StoreStats) -> Store:
    """The store `url` names (ValueError: a file store whose file cannot be read)."""
    if url.kind is StoreKind.ETCD:
        from registry.store.etcd_store import EtcdStore  # httpx only when etcd is used

        return EtcdStore(url, options, stats)
    if url.kind is StoreKind.FILE:
        return FileStore(url)
    return MemoryStore(url)


class StoreSync:
    def __init__(self, store: Store, submit: Callable[[Action], Future[Any]],
                 own: RegistryEntry, stats: StoreStats, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.own = own
        self.stats = stats
        self._submit = submit
        self._clock = clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._applied = threading.Condition()
        self._applied_revision = 0
        self._loads_reported = 0
        # Swapped whole (the HTTP side reads them); written by one caller at a time.
        self.registries: Mapping[str, RegistryEntry] = {}
        self.intents: Mapping[tuple[IntentKind, str], HeldIntent] = {}

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> StoreSync:
        own = (registry_key(self.own.id), encode(self.own))
        for name, target, args in (("pdreg-store", self.store.run, (self, own, self._stop)),
                                   ("pdreg-store-sweep", self._sweep_loop, ())):
            thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def wait_loaded(self, timeout_s: float) -> bool:
        """Whether the store reported everything it holds within `timeout_s` (handed to
        the loop's queue: the registry applies it before its loop takes any message)."""
        with self._applied:
            return self._applied.wait_for(lambda: self._loads_reported > 0, timeout_s)

    def close(self) -> None:
        """Stop the threads (the registry leaves the replica set at once). Safe twice."""
        self._stop.set()
        self.store.close()
        for thread in self._threads:
            thread.join(timeout=1.0)  # a watch may sit in a read; its thread is a daemon

    # --- what the HTTP side calls --------------------------------------------------------

    def write(self, kind: IntentKind, member_id: str, intent: Intent) -> int:
        """Store `intent`; its revision. StoreUnavailable says why it could not be."""
        return self._counted(lambda: self.store.put(intent_key(kind, member_id),
                                                    encode(intent)))

    def remove(self, kind: IntentKind, member_id: str) -> int:
        """Delete the intent; its revision, 0 when none was held."""
        return self._counted(lambda: self.store.delete(intent_key(kind, member_id)))

    def wait_applied(self, revision: int, timeout_s: float) -> bool:
        """Whether this registry applied `revision` within `timeout_s`."""
        with self._applied:
            return self._applied.wait_for(lambda: self._applied_revision >= revision,
                                          timeout_s)

    def _counted(self, write: Callable[[], int]) -> int:
        try:
            revision = write()
        except StoreUnavailable:
            self.stats.writes["unavailable"] += 1
            raise
        self.stats.writes["ok"] += 1
        return revision

    # --- StoreSink: what the store reports -------------------------------------------------

    def loaded(self, revision: int, items: Mapping[str, Item]) -> None:
        intents: dict[tuple[IntentKind, str], HeldIntent] = {}
        registries: dict[str, RegistryEntry] = {}
        for key, item in items.items():
            self._take(key, item, intents, registries)
        self._swap(intents, registries)
        now = self._clock()
        held = {key: intent for key, (intent, _) in intents.items() if _live(intent, now)}
        logger.info("[store] loaded revision=%d intents=%d registries=%d", revision,
                    len(held), len(registries))

        def replace(membership: Any, now: float) -> None:
            membership.reload_intents(held, now)

        self._apply(revision, replace, reload=True)
        with self._applied:
            self._loads_reported += 1
            self._applied.notify_all()

    def changed(self, revision: int, changes: Sequence[Change]) -> None:
        self.stats.watch_events += len(changes)
        intents, registries = dict(self.intents), dict(self.registries)
        applied: list[tuple[IntentKind, str, Intent | None]] = []
        now = self._clock()
        for key, item in changes:
            name = self._take(key, item, intents, registries)
            if isinstance(name, tuple):
                held = intents.get(name)
                live = held[0] if held is not None and _live(held[0], now) else None
                applied.append((*name, live))  # the loop's table skips what it holds
        self._swap(intents, registries)

        def apply(membership: Any, now: float) -> None:
            for kind, member_id, intent in applied:
                membership.apply_intent(kind, member_id, intent, now)

        self._apply(revision, apply, reload=False)

    def status(self, up: bool, reason: str = "") -> None:
        if up != self.stats.up:
            if up:
                logger.info("[store] %s reachable", self.store.url)
            else:
                logger.warning("[store] %s unreachable: %s (membership and routing go "
                               "on; admin writes answer 503)", self.store.url, reason)
        self.stats.up, self.stats.reason = up, reason

    # --- internals ---------------------------------------------------------------------

    def _take(self, key: str, item: Item | None,
              intents: dict[tuple[IntentKind, str], HeldIntent],
              registries: dict[str, RegistryEntry]) -> tuple[IntentKind, str] | str | None:
        """Fold one key into `intents`/`registries`: what it names, or None when it was
        ignored or refused (a refused value changes nothing; it is counted)."""
        try:
            name = parse_key(key)
            if name is None:
                return None
            if isinstance(name, str):
                if item is None:
                    registries.pop(name, None)
                else:
                    registries[name] = decode_registry(item.value)
                return name
            if item is None:
                intents.pop(name, None)
                return name
            intent = decode_intent(name[0], item.value)
            if len(intents) >= MAX_INTENTS and name not in intents:
                raise BadRecord("cap", f"{MAX_INTENTS} intents held already")
            intents[name] = (intent, item.mod_revision)
            return name
        except BadRecord as exc:
            self.stats.refused[exc.reason] += 1
            logger.warning("[store] refused key %r: %s", key[:200], exc)
            return None

    def _swap(self, intents: dict[tuple[IntentKind, str], HeldIntent],
              registries: dict[str, RegistryEntry]) -> None:
        self.intents, self.registries = intents, registries
        self.stats.intents = Counter(kind.value for kind, _ in intents)
        self.stats.registries = len(registries)

    def _apply(self, revision: int, action: Action, *, reload: bool) -> None:
        """Run `action` on the loop; `revision` counts as applied once it ran."""
        def done(_: Future[Any]) -> None:
            with self._applied:
                # A reload may go back (an etcd that lost its data): it is the truth now.
                self._applied_revision = revision if reload else max(
                    self._applied_revision, revision)
                self.stats.applied_revision = self._applied_revision
                self._applied.notify_all()

        self._submit(action).add_done_callback(done)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_PERIOD_S):
            self.sweep()

    def sweep(self) -> int:
        """Delete expired intents from the store (only if unchanged since: any registry
        may sweep at the same time); how many went."""
        now = self._clock()
        swept = 0
        for (kind, member_id), (intent, revision) in list(self.intents.items()):
            if _live(intent, now) or not self.stats.up:
                continue
            try:
                swept += bool(self.store.delete(intent_key(kind, member_id),
                                                mod_revision=revision))
            except StoreUnavailable:
                return swept
        self.stats.swept += swept
        return swept


def _live(intent: Intent, now: float) -> bool:
    """Whether `intent` still stands at unix time `now` (an expired one is moot: the loop
    does not hold it, and a sweep deletes it from the store)."""
    expiry = expires_at(intent)
    return expiry is None or expiry > now
