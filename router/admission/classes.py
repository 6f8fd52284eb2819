"""Traffic classes and who a request belongs to: `--classes FILE` and the default.

A class is what a request is promised: a priority (higher goes first), a TTFT SLO, a
deadline in the router's queue, whether it may be shed at once when it would miss its
SLO, and the weight its tenants get in the fair queue. A tenant is who shares a class
with others fairly: the API key's name, or a header when the router has no keys.

The file is TOML (tomllib is in the standard library; pdreg has no YAML dependency):

    default = "standard"          # the class of a request that names none

    [classes.critical]
    priority = 2
    ttft_slo_ms = 500
    sheddable = false
    weight = 1.0

    [classes.batch]
    priority = 0
    ttft_slo_ms = 10000
    sheddable = true

    [keys.team-a]                 # an API key: its tenant is the table's name
    key_env = "TEAM_A_KEY"        # the key's value, from the environment (never in the file)
    class = "critical"            # the class its requests get unless they name one
    classes = ["critical", "standard"]   # the classes it may name (default: every one)
    weight = 2.0                  # its weight in the fair queue (default: its class's)

Without a file there is one class, `default`, with the SLO `--ttft-slo-ms` gives.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = [
    "DEFAULT_CLASS",
    "DEFAULT_TTFT_SLO_MS",
    "MAX_CLASSES",
    "ApiKey",
    "ClassBook",
    "TrafficClass",
    "default_book",
    "key_digest",
    "load_classes",
]

DEFAULT_TTFT_SLO_MS: Final = 1000.0  # one class, 1 s to the first token
DEFAULT_CLASS: Final = "default"
MAX_CLASSES: Final = 64  # classes label metrics: keep them few
MAX_NAME_LENGTH: Final = 64
_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, slots=True)
class TrafficClass:
    name: str
    priority: int = 0  # higher is served first
    ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS
    sheddable: bool = False  # 429 at once when the predicted TTFT misses the SLO
    weight: float = 1.0  # each tenant's share in the fair queue, relative to others'
    deadline_ms: float = 0.0  # longest wait in the queue (0: the SLO less the service)

    @property
    def ttft_slo_s(self) -> float:
        return self.ttft_slo_ms / 1000.0

    @property
    def deadline_s(self) -> float:
        return (self.deadline_ms or self.ttft_slo_ms) / 1000.0


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client key: its tenant, default class, the classes it may ask for, weight."""

    tenant: str
    klass: str
    allowed: frozenset[str]
    weight: float | None = None


@dataclass(frozen=True, slots=True)
class ClassBook:
    classes: Mapping[str, TrafficClass]
    default: str = DEFAULT_CLASS
    # sha256 of a key's value -> ApiKey: a lookup by digest leaks nothing of a key's
    # value through timing, and the values themselves are not kept.
    keys: Mapping[bytes, ApiKey] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default not in self.classes:
            raise ValueError(f"the default class {self.default!r} is not defined")

    def resolve(self, asked: str, key: ApiKey | None) -> TrafficClass | None:
        """The class a request gets: the one it names (`x-pdreg-priority`), if its key
        may name it, else its key's, else the default. None: it named a class that does
        not exist or that its key may not use (the caller answers 400/403)."""
        if not asked:
            return self.classes[key.klass if key is not None else self.default]
        klass = self.classes.get(asked)
        if klass is None or (key is not None and asked not in key.allowed):
            return None
        return klass

    def key_of(self, value: bytes) -> ApiKey | None:
        return self.keys.get(key_digest(value)) if self.keys else None

    def weight_of(self, klass: TrafficClass, key: ApiKey | None) -> float:
        if key is not None and key.weight is not None:
            return key.weight
        return klass.weight


def key_digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def default_book(ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS) -> ClassBook:
    """No file: one class, not sheddable, with the given SLO."""
    return ClassBook({DEFAULT_CLASS: TrafficClass(DEFAULT_CLASS, ttft_slo_ms=ttft_slo_ms)})


def load_classes(path: str | Path, env: Mapping[str, str] | None = None) -> ClassBook:
    """Parse a classes file; ValueError names what is wrong and where."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return book_of(data, os.environ if env is None else env, str(path))


def book_of(data: Mapping[str, Any], env: Mapping[str, str], where: str = "classes"
            ) -> ClassBook:
    tables = data.get("classes")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{where}: [classes.NAME] tables are required")
    if len(tables) > MAX_CLASSES:
        raise ValueError(f"{where}: at most {MAX_CLASSES} classes")
    classes = {name: _class_of(name, table, where) for name, table in tables.items()}
    default = data.get("default", next(iter(classes)))
    if default not in classes:
        raise ValueError(f"{where}: default class {default!r} is not defined")
    keys_table = data.get("keys", {})
    if not isinstance(keys_table, dict):
        raise ValueError(f"{where}: keys must be tables")
    keys: dict[bytes, ApiKey] = {}
    for tenant, table in keys_table.items():
        value, key = _key_of(tenant, table, classes, default, env, where)
        digest = key_digest(value.encode())
        if digest in keys:
            raise ValueError(f"{where}: keys.{tenant}: the same key as another tenant")
        keys[digest] = key
    return ClassBook(classes, default, keys)


def _name(name: object, where: str) -> str:
    if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not _NAME.match(name):
        raise ValueError(f"{where}: bad name {name!r} (letters, digits, _ . -; at most "
                         f"{MAX_NAME_LENGTH})")
    return name


def _number(table: Mapping[str, Any], field_name: str, default: float, where: str,
            minimum: float = 0.0) -> float:
    value = table.get(field_name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{where}.{field_name}: a finite number >= {minimum} is required")
    return float(value)


def _class_of(name: str, table: object, where: str) -> TrafficClass:
    here = f"{where}: classes.{_name(name, where)}"
    if not isinstance(table, dict):
        raise ValueError(f"{here}: a table is required")
    unknown = set(table) - {"priority", "ttft_slo_ms", "sheddable", "weight", "deadline_ms"}
    if unknown:
        raise ValueError(f"{here}: unknown fields {sorted(unknown)}")
    priority = table.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 1000:
        raise ValueError(f"{here}.priority: an integer in -1000..1000 is required")
    sheddable = table.get("sheddable", False)
    if not isinstance(sheddable, bool):
        raise ValueError(f"{here}.sheddable: true or false")
    slo = _number(table, "ttft_slo_ms", DEFAULT_TTFT_SLO_MS, here, minimum=1.0)
    weight = _number(table, "weight", 1.0, here, minimum=0.001)
    deadline = _number(table, "deadline_ms", 0.0, here)
    return TrafficClass(name, priority, slo, sheddable, weight, deadline)


def _key_of(tenant: str, table: object, classes: Mapping[str, TrafficClass], default: str,
            env: Mapping[str, str], where: str) -> tuple[str, ApiKey]:
    here = f"{where}: keys.{_name(tenant, where)}"
    if not isinstance(table, dict):
        raise ValueError(f"{here}: a table is required")
    variable = table.get("key_env")
    value = env.get(variable, "") if isinstance(variable, str) else ""
    if not value:
        raise ValueError(f"{here}.key_env: names an environment variable holding the key")
    klass = table.get("class", default)
    allowed = table.get("classes", list(classes))
    if not isinstance(allowed, list) or any(c not in classes for c in allowed) \
            or klass not in classes:
        raise ValueError(f"{here}: class and classes must name defined classes")
    weight = _number(table, "weight", 1.0, here, minimum=0.001) if "weight" in table else None
    return value, ApiKey(tenant, klass, frozenset(allowed) | {klass}, weight)
