"""An immutable mapping whose next version costs the changes, not a copy of everything.

`MembershipView` hands readers (a router's every request) an immutable view, swapped by
reference. Copying a 100k-member dict per update cost a router about a fifth of a core, so
a version is a shared `base` dict plus a small `overlay` of what changed since it was
built (a removed key maps to `_GONE`). `updated()` copies only the overlay; once the
overlay outgrows a share of the base it is folded in (one full copy per that many changed
keys, so a change costs O(1) amortized plus the overlay's size).

Neither dict is ever mutated after a `FrozenMap` holds it, so any thread may read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final, Generic, TypeVar

__all__ = ["FrozenMap"]

V = TypeVar("V")

OVERLAY_MIN: Final = 256  # below this many changed keys, never fold (a fold is a full copy)
OVERLAY_SHARE: Final = 16  # fold once the overlay holds more than base/OVERLAY_SHARE keys


class _Gone:
    __slots__ = ()


_GONE: Final = _Gone()


class FrozenMap(Mapping[str, V], Generic[V]):
    __slots__ = ("_base", "_len", "_overlay")

    def __init__(self, base: dict[str, V] | None = None) -> None:
        self._base: dict[str, V] = dict(base) if base else {}
        self._overlay: dict[str, V | _Gone] = {}
        self._len = len(self._base)

    def __getitem__(self, key: str) -> V:
        value = self._overlay.get(key, self)
        if value is self:
            return self._base[key]
        if isinstance(value, _Gone):
            raise KeyError(key)
        return value  # type: ignore[return-value]

    def get(self, key: str, default: V | None = None) -> V | None:  # type: ignore[override]
        """Mapping's `get` without its two Python calls (the view's merge and a
        router's table look up every changed member)."""
        value = self._overlay.get(key, self)
        if value is self:
            return self._base.get(key, default)
        if isinstance(value, _Gone):
            return default
        return value  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        value = self._overlay.get(key, self)  # type: ignore[call-overload]
        if value is self:
            return key in self._base
        return not isinstance(value, _Gone)

    def __iter__(self) -> Iterator[str]:
        overlay = self._overlay
        if not overlay:
            yield from self._base
            return
        for key in self._base:
            if key not in overlay:
                yield key
        for key, value in overlay.items():
            if not isinstance(value, _Gone):
                yield key

    def __len__(self) -> int:
        return self._len

    def values(self) -> Iterator[V]:  # type: ignore[override]
        """The values, without a lookup per key (readers walk every member)."""
        overlay = self._overlay
        if not overlay:
            yield from self._base.values()
            return
        for key, value in self._base.items():
            if key not in overlay:
                yield value
        for changed in overlay.values():
            if not isinstance(changed, _Gone):
                yield changed

    def items(self) -> Iterator[tuple[str, V]]:  # type: ignore[override]
        overlay = self._overlay
        if not overlay:
            yield from self._base.items()
            return
        for key, value in self._base.items():
            if key not in overlay:
                yield key, value
        for key, changed in overlay.items():
            if not isinstance(changed, _Gone):
                yield key, changed

    def updated(self, changes: Mapping[str, V | None]) -> FrozenMap[V]:
        """A new version with `changes` applied (None removes a key); self is unchanged."""
        overlay = dict(self._overlay)
        length = self._len
        base = self._base
        for key, value in changes.items():
            # `key in self` without its Python call (a router at 100k members makes
            # ~20,000 changes a second): the copy's entry is still self's, as each key
            # of `changes` comes once.
            held = overlay.get(key, self)
            present = key in base if held is self else held is not _GONE
            if value is None:
                if not present:
                    continue
                length -= 1
                if key in base:
                    overlay[key] = _GONE
                else:
                    del overlay[key]
            else:
                if not present:
                    length += 1
                overlay[key] = value
        new = FrozenMap.__new__(FrozenMap)
        if len(overlay) > max(OVERLAY_MIN, len(base) // OVERLAY_SHARE):
            # A copy and an update in C, then the few removals: 4-7x faster at 100k
            # members than filtering the base key by key (a router following 100k
            # members folds about once a second; it was a third of its view's CPU).
            # (`_GONE` never goes in: the collector would track the new base for good.)
            folded = base.copy()
            gone = [k for k, v in overlay.items() if v is _GONE]
            if gone:
                folded.update({k: v for k, v in overlay.items() if v is not _GONE})
                for key in gone:
                    del folded[key]
            else:
                folded.update(overlay)
            new._base, new._overlay = folded, {}
        else:
            new._base, new._overlay = base, overlay
        new._len = length
        return new

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self.items())!r})"
