"""The load an agent sends: its engine's callback, validated, or the last good one.

Struct constructors do not check constraints (NaN, ranges); the registry's decoder does,
so an invalid figure would get the whole heartbeat refused. A callback that raises or
returns something invalid costs one log line per failure streak, never a heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from wire.protocol import Load

__all__ = ["LoadReader"]

logger = logging.getLogger(__name__)


class LoadReader:
    def __init__(self, load: Callable[[], Load]) -> None:
        self._load_fn = load
        self._last_good = Load()
        self._failing = False  # log a failing callback once per failure streak

    def read(self) -> Load:
        """The callback's load, validated; the last good one if it raises or is invalid."""
        try:
            load = msgspec.convert(msgspec.to_builtins(self._load_fn()), Load)
        except Exception as exc:
            if not self._failing:
                logger.warning("[agent] load callback failed (%s: %s); sending the last "
                               "good load", type(exc).__name__, exc)
            self._failing = True
            return self._last_good
        self._failing = False
        self._last_good = load
        return load
