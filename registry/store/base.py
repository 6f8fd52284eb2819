"""The interface every store kind implements, and what it reports to the registry.

A store is a small revisioned key-value space under one prefix. It is written from the
HTTP side (admin writes: `put`, `delete`, which block for at most a few seconds and raise
`StoreUnavailable`), and it tells a `StoreSink` what it holds (`run`, on the store's own
thread): everything once (`loaded`), then every change in revision order (`changed`),
everything again whenever it cannot vouch for the changes in between (a reconnection, a
compacted watch), and whether it is reachable (`status`). Keys are relative to the
prefix. While `run` lasts, the store keeps the registry's own entry (`own`) present,
under a lease where the store has leases, so that a dead registry's entry disappears.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from registry.store.url import StoreUrl

__all__ = ["Change", "Item", "Store", "StoreSink", "StoreUnavailable"]


@dataclass(frozen=True, slots=True)
class Item:
    value: bytes
    mod_revision: int  # the revision that last wrote it (for compare-and-delete)


Change = tuple[str, Item | None]  # (key, its new item, or None: deleted)


class StoreUnavailable(Exception):
    """The store could not take a write (unreachable, timed out, refused); the message
    says why, and is what an admin write answers with (HTTP 503)."""


class StoreSink(Protocol):
    def loaded(self, revision: int, items: Mapping[str, Item]) -> None:
        """Everything under the prefix at `revision` (replaces whatever was held)."""

    def changed(self, revision: int, changes: Sequence[Change]) -> None:
        """What changed at `revision` (after the last `loaded` or `changed`)."""

    def status(self, up: bool, reason: str = "") -> None:
        """Whether the store is reachable now, and if not, why."""


class Store(Protocol):
    url: StoreUrl

    def run(self, sink: StoreSink, own: tuple[str, bytes], stop: threading.Event) -> None:
        """Report to `sink` until `stop` is set, keeping `own` (key, value) present; never
        raises (an unreachable store is a `status`, retried)."""

    def put(self, key: str, value: bytes) -> int:
        """Write `value` at `key`; the revision it got."""

    def delete(self, key: str, *, mod_revision: int = 0) -> int:
        """Delete `key` (only if last written at `mod_revision`, when given); the revision
        of the deletion, 0 when nothing was deleted."""

    def close(self) -> None:
        """Release connections; `run` returns soon after. Safe twice."""
