"""The stores of one registry: `memory` (today's behaviour) and `file:PATH`.

Both keep everything in this process and tell the sink of every write as it is made
(there is nobody else to watch). `file:PATH` also writes the intents to PATH on every
change, atomically (a temporary file in the same directory, fsync, rename, fsync of the
directory), so a registry that restarts, however it stopped, finds either the old file
or the new one, never half of one. The registry's own entry is not written: it describes
this run only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from registry.store.base import Item, StoreSink, StoreUnavailable
from registry.store.records import INTENTS
from registry.store.url import StoreKind, StoreUrl

__all__ = ["FileStore", "MemoryStore"]

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 64 * 1024 * 1024  # a file larger than this is refused at start


class MemoryStore:
    """Intents in this process only: a restart forgets them (`--store memory`)."""

    def __init__(self, url: StoreUrl | None = None) -> None:
        self.url = url or StoreUrl(StoreKind.MEMORY)
        self._lock = threading.Lock()  # writes come from the HTTP side's threads
        self._items: dict[str, Item] = {}
        self._revision = 0
        self._sink: StoreSink | None = None

    def run(self, sink: StoreSink, own: tuple[str, bytes], stop: threading.Event) -> None:
        with self._lock:
            self._sink = sink
            self._revision += 1
            self._items[own[0]] = Item(own[1], self._revision)
            sink.loaded(self._revision, dict(self._items))
        sink.status(True)
        stop.wait()

    def put(self, key: str, value: bytes) -> int:
        with self._lock:
            revision = self._revision + 1
            items = {**self._items, key: Item(value, revision)}
            self._commit(items, revision, (key, items[key]))
            return revision

    def delete(self, key: str, *, mod_revision: int = 0) -> int:
        with self._lock:
            held = self._items.get(key)
            if held is None or (mod_revision and held.mod_revision != mod_revision):
                return 0
            revision = self._revision + 1
            items = {k: v for k, v in self._items.items() if k != key}
            self._commit(items, revision, (key, None))
            return revision

    def close(self) -> None:
        pass

    def _commit(self, items: dict[str, Item], revision: int,
                change: tuple[str, Item | None]) -> None:
        """Make `items` the state at `revision` (persisted first, where persisted), and
        tell the sink. Called with the lock held."""
        self._persist(items, revision)
        self._items, self._revision = items, revision
        if self._sink is not None:
            self._sink.changed(revision, [change])

    def _persist(self, items: Mapping[str, Item], revision: int) -> None:
        pass  # memory only


class FileStore(MemoryStore):
    """Intents in a file that survives restarts (`--store file:PATH`); one registry."""

    def __init__(self, url: StoreUrl) -> None:
        super().__init__(url)
        self._path = Path(url.path)
        self._revision, self._items = _read(self._path)

    def _persist(self, items: Mapping[str, Item], revision: int) -> None:
        intents = {key: item.value.decode() for key, item in items.items()
                   if key.startswith(INTENTS)}
        body = json.dumps({"revision": revision, "items": intents}, indent=1,
                          sort_keys=True).encode()
        try:
            _write_atomically(self._path, body)
        except OSError as exc:
            raise StoreUnavailable(f"cannot write {self._path}: {exc.strerror or exc}") \
                from None


def _read(path: Path) -> tuple[int, dict[str, Item]]:
    """(revision, items) from `path`; nothing yet if it does not exist. ValueError (the
    registry refuses to start) if it cannot be read as a store file."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"--store file:{path}: larger than {MAX_FILE_BYTES} bytes")
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return 0, {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--store file:{path}: cannot read it ({exc}); move it away to "
                         f"start with no intents") from None
    revision = raw.get("revision") if isinstance(raw, dict) else None
    items = raw.get("items") if isinstance(raw, dict) else None
    if not isinstance(revision, int) or not isinstance(items, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in items.items()):
        raise ValueError(f"--store file:{path}: not a pdreg store file (expected "
                         f'{{"revision": N, "items": {{KEY: VALUE}}}})')
    # Each value is checked later, like an etcd value (registry.store.records).
    return revision, {key: Item(value.encode(), revision) for key, value in items.items()}


def _write_atomically(path: Path, body: bytes) -> None:
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
