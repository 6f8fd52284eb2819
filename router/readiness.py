"""What /ready says besides ready or not: the warnings an operator must see.

`/ready` answers `{"status": ..., "warnings": [...]}`: 200 still means ready, whatever
the warnings; a warning is something the router cannot fix itself and will not refuse
to start for (members it may never send to, say), so it must not hide in a debug log.

A warning source is a callable answering the warnings that hold now (`ReadyWarning`s),
cheaply: it is asked on every /ready and every FOLLOW_S (router/app.py).
`Readiness.add(source)` is all a new source takes. Each time the sources are asked, a
warning that appeared is logged at WARNING and one that cleared at INFO: the log says it
at start and whenever it changes, not once per probe.

/ready is a probe anyone who reaches the port may call, so a warning's `detail` (member
ids, addresses: what /metrics keeps to its own port) goes only to clients the router
authorizes, as /v1/kv does, and to the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Readiness", "ReadyWarning", "WarningSource"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReadyWarning:
    text: str  # what is wrong and what it does, for anyone
    detail: str = ""  # which members, which addresses: for authorized clients and the log

    def full(self) -> str:
        return f"{self.text}: {self.detail}" if self.detail else self.text


WarningSource = Callable[[], Iterable[ReadyWarning]]


class Readiness:
    def __init__(self) -> None:
        self._sources: list[WarningSource] = []
        self._said: frozenset[ReadyWarning] = frozenset()
        self._failing: set[int] = set()  # sources (by index) whose failure was logged

    def add(self, source: WarningSource) -> None:
        self._sources.append(source)

    def warnings(self) -> list[ReadyWarning]:
        """The warnings that hold now, in the sources' order; logs what changed."""
        now: list[ReadyWarning] = []
        for i, source in enumerate(self._sources):
            try:
                now.extend(source())
            except Exception:  # a broken source must not break /ready, nor flood the log
                if i not in self._failing:
                    self._failing.add(i)
                    logger.exception("[router] a readiness warning source failed")
            else:
                self._failing.discard(i)
        current = frozenset(now)
        if current != self._said:
            for warning in now:
                if warning not in self._said:
                    logger.warning("[router] %s", warning.full())
            for warning in self._said - current:
                logger.info("[router] no longer: %s", warning.full())
            self._said = current
        return now
