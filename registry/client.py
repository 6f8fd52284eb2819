"""Registry clients: `MembershipView` (the Clone pattern) for routers and the CLI.

INTERFACE STUB — the implementation lands with the registry core. Code against these
names; they will not change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from registry.protocol import Load, MemberRecord, Role

DEFAULT_REGISTRY = "127.0.0.1:7600"
REGISTRY_ENV = "PDREG_REGISTRY"


def parse_registries(text: str | Sequence[str] | None) -> list[str]:
    """`"h1:7600,h2:7600"` (or a list, or None -> $PDREG_REGISTRY or the default) -> list."""
    raise NotImplementedError


@dataclass(frozen=True, slots=True)
class LiveMember:
    """One member as a view sees it: the registry's record plus the freshest load."""

    record: MemberRecord
    load: Load
    load_at: float  # time.monotonic() when that load was measured (receipt - reported age)
    registry: str  # the control address it was learned from

    @property
    def id(self) -> str:
        return self.record.spec.id

    @property
    def role(self) -> Role:
        return self.record.spec.role

    @property
    def model(self) -> str:
        return self.record.spec.model

    @property
    def routable(self) -> bool:
        return self.record.routable


class MembershipView:
    """A local, eventually consistent copy of membership from one or more registries.

    A background thread subscribes to each registry's events, takes a snapshot, applies
    newer events and resynchronises on a version gap or a new epoch. While a registry is
    away the last view is kept. Several registries are merged: per id the newest
    incarnation wins.
    """

    def __init__(self, registries: str | Sequence[str] | None = None, *,
                 models: Sequence[str] = ()) -> None:
        raise NotImplementedError

    def start(self) -> MembershipView: ...
    def close(self) -> None: ...  # safe twice
    def __enter__(self) -> MembershipView: ...
    def __exit__(self, *exc: object) -> None: ...

    def members(self) -> Mapping[str, LiveMember]:
        """The current view (immutable; swapped by reference, so free to call per request)."""
        raise NotImplementedError

    def wait_for(self, predicate: Callable[[Mapping[str, LiveMember]], bool],
                 timeout: float) -> bool:
        """Block until predicate(members()) is true or timeout; returns whether it was."""
        raise NotImplementedError

    def add_listener(self, callback: Callable[[Mapping[str, LiveMember]], None]) -> None:
        """Call back (from the view's thread) after every change, with the new view."""
        raise NotImplementedError

    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        """Tell every registry that a member failed a request (it will suspect it)."""
        raise NotImplementedError
