"""`--store etcd://...`: the intents and the replica set in etcd, shared by every registry.

Two threads, neither the registry's loop:
- the watch (`run`): read everything under the prefix (`loaded`), then watch from the
  next revision and hand each change on (`changed`). On any break: the store is down
  (`status`), retried with backoff; when etcd answers again, everything is read again
  (etcd may have lost or compacted what happened meanwhile) and the watch resumes. A
  watch whose revision was compacted reloads at once.
- the lease (`_keep_own`): this registry's entry lives under a lease of LEASE_TTL_S,
  renewed every third of it. A lease etcd no longer has (it expired while etcd or this
  registry was away) is granted anew and the entry written again. A registry that dies
  stops renewing, and its entry disappears when the lease runs out; one that stops
  cleanly revokes it, and its entry is gone at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Final

from registry.store.base import StoreSink, StoreUnavailable
from registry.store.etcd import REQUEST_TIMEOUT_S, Compacted, EtcdClient
from registry.store.metrics import StoreStats
from registry.store.url import EtcdOptions, StoreUrl

__all__ = ["LEASE_TTL_S", "EtcdStore"]

logger = logging.getLogger(__name__)

LEASE_TTL_S: Final = 10  # a dead registry leaves the replica set this long after it died
RETRY_MIN_S: Final = 0.25  # after etcd failed, first retry; doubled up to RETRY_MAX_S
RETRY_MAX_S: Final = 2.0


class EtcdStore:
    def __init__(self, url: StoreUrl, options: EtcdOptions, stats: StoreStats) -> None:
        self.url = url
        self.stats = stats
        self._client = EtcdClient(url.endpoints, url.prefix, options)
        self._closed = threading.Event()
        self._lease_thread: threading.Thread | None = None

    def put(self, key: str, value: bytes) -> int:
        return self._client.put(key, value)

    def delete(self, key: str, *, mod_revision: int = 0) -> int:
        return self._client.delete(key, mod_revision=mod_revision)

    def close(self) -> None:
        """Call after setting `run`'s stop: the lease is revoked first (at most a request's
        timeout), then the connections close, which ends a watch in progress."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._lease_thread is not None:
            self._lease_thread.join(timeout=REQUEST_TIMEOUT_S + 1.0)
        self._client.close()

    def run(self, sink: StoreSink, own: tuple[str, bytes], stop: threading.Event) -> None:
        self._lease_thread = threading.Thread(target=self._keep_own, args=(own, stop),
                                              name="pdreg-store-lease", daemon=True)
        self._lease_thread.start()
        delay_s = RETRY_MIN_S
        reason = "start"
        while not stop.is_set():
            try:
                revision, items = self._client.range_all()
                self.stats.reloads[reason] += 1
                sink.loaded(revision, items)
                sink.status(True)
                delay_s = RETRY_MIN_S
                self._watch(sink, revision + 1, stop)
            except Compacted as exc:
                logger.warning("[store] %s; reading everything again", exc)
                reason = "compacted"
            except StoreUnavailable as exc:
                if stop.is_set():
                    break
                if self._closed.is_set():
                    break
                sink.status(False, str(exc))
                reason = "reconnect"
                stop.wait(delay_s)
                delay_s = min(RETRY_MAX_S, 2 * delay_s)

    def _watch(self, sink: StoreSink, revision: int, stop: threading.Event) -> None:
        """Hand every change from `revision` on to `sink` until `stop` or a break."""
        while not stop.is_set():
            for changed_at, changes in self._client.watch(revision):
                sink.changed(changed_at, changes)
                revision = changed_at + 1
                if stop.is_set():
                    return
            # The watch was idle for a while: open it again from where it was.

    def _keep_own(self, own: tuple[str, bytes], stop: threading.Event) -> None:
        """Keep this registry's entry under a live lease until `stop`; then revoke it."""
        key, value = own
        lease = 0
        written = False
        while not stop.is_set():
            try:
                if lease and self._client.keepalive(lease):
                    self.stats.lease_renewals += 1
                else:
                    lease = self._client.grant(LEASE_TTL_S)
                    self.stats.lease_grants += 1
                    written = False
                if not written:  # a new lease, or etcd was away: write the entry again
                    self._client.put(key, value, lease=lease)
                    written = True
                self.stats.lease_held = True
                stop.wait(LEASE_TTL_S / 3)
            except StoreUnavailable as exc:
                self.stats.lease_held = False
                self.stats.lease_failures += 1
                written = False
                logger.debug("[store] lease: %s", exc)
                stop.wait(RETRY_MIN_S)
        if lease:
            # Gone from the replica set at once (if etcd does not answer, the lease runs
            # out by itself).
            with contextlib.suppress(StoreUnavailable):
                self._client.revoke(lease)
