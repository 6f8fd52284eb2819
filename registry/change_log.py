"""What the loop changed, for the dashboard's streams: each stream costs the changes.

A dashboard stream used to poll the loop's snapshot and compare a fingerprint of every
member, per stream and tick: O(members) each, at 100k members, for every open page. Now
the loop hands this log what it publishes anyway (membership events, load digest
entries, changes of the routers' KV summaries), and a stream sends what came since its
cursor. The full state goes out once, when a stream opens (or falls behind the log).

- Loop thread: `append` one chunk per publish call, a reference to a list it built
  anyway; nothing at all while no stream follows (`followers`).
- Readers (the HTTP thread): `since(cursor)` -> the chunks after it, or None when the
  log dropped some of them (bounded at MAX_CHANGES): the reader resynchronises from the
  snapshot. A chunk's JSON is rendered once, by its first reader, and shared.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["MAX_CHANGES", "ChangeLog", "Chunk"]

MAX_CHANGES: Final = 100_000  # held at most (100k members' loads at 5 s: ~5 s of them)


@dataclass(slots=True)
class Chunk:
    """Changes the loop made in one go: `kind` says what `items` holds."""

    seq: int  # the log position of its first change
    kind: str  # "events" (membership events), "loads" (LoadEntry), "kv" (id -> summary)
    items: Sequence[Any] | dict[str, Any]
    wall: float  # unix time it was appended (ages shown are as of then)
    text: str | None = field(default=None)  # its JSON ops, rendered once by a reader

    def rendered(self, render: Callable[[Chunk], str]) -> str:
        """Its JSON, rendered by the first reader (two at once both render: harmless)."""
        text = self.text
        if text is None:
            text = self.text = render(self)
        return text


class ChangeLog:
    def __init__(self, capacity: int = MAX_CHANGES) -> None:
        self.capacity = capacity
        self.followers = 0  # streams open: the loop appends only while this is above 0
        self.head = 0  # the position the next change gets
        self.meta: dict[str, Any] = {}  # epoch, version, interval...: swapped whole
        self._chunks: deque[Chunk] = deque()
        self._held = 0
        self._lock = threading.Lock()  # the loop appends while readers read

    def follow(self) -> int:
        """A stream opens: the position it reads from (take the snapshot after this)."""
        with self._lock:
            self.followers += 1
            return self.head

    def unfollow(self) -> None:
        """A stream closed (once per `follow`). The last one frees what is held."""
        with self._lock:
            self.followers -= 1
            if self.followers <= 0:
                self.followers = 0
                self._chunks.clear()
                self._held = 0

    def append(self, kind: str, items: Sequence[Any] | dict[str, Any], wall: float) -> None:
        """Loop thread: changes it made (the list is kept, not copied: do not change it)."""
        if not self.followers or not items:
            return
        with self._lock:
            self._chunks.append(Chunk(self.head, kind, items, wall))
            self.head += len(items)
            self._held += len(items)
            while self._held > self.capacity and len(self._chunks) > 1:
                self._held -= len(self._chunks.popleft().items)

    def since(self, cursor: int) -> tuple[list[Chunk], int] | None:
        """The chunks after `cursor` and the new cursor; None if some were dropped."""
        with self._lock:
            head = self.head
            if cursor >= head:
                return [], head
            chunks = self._chunks
            if not chunks or chunks[0].seq > cursor:
                return None
            out: list[Chunk] = []
            for chunk in reversed(chunks):  # newest first: costs what came since
                if chunk.seq < cursor:
                    break
                out.append(chunk)
        out.reverse()
        return out, head
