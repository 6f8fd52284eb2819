"""Figures into what bench/RESULTS.md quotes: percentiles, Markdown tables, JSON files.

Two percentile rules are in use, each kept by the benchmarks whose earlier figures were
taken with it (so a new run compares with RESULTS.md): `nearest_rank` (the value at
index q x n of the sorted samples: the fleet-scale figures) and `p99`/`percentiles`
(Python's `statistics.quantiles`, interpolated: the router and KV figures). A new
benchmark uses `percentiles`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The value at index q x n of already sorted samples (NaN without any)."""
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def percentiles(values: Sequence[float]) -> list[float]:
    """The 99 cut points of `statistics.quantiles` (index 49 is p50, 98 is p99); zeros
    for fewer than three samples."""
    return statistics.quantiles(values, n=100) if len(values) > 2 else [0.0] * 99


def p99(values: Sequence[float]) -> float:
    """`statistics.quantiles`' p99 (the one value of a single sample)."""
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]],
                   align: str = "") -> list[str]:
    """A Markdown table's lines. `align` has a letter per column, `l` or `r` (numbers);
    columns beyond it are left-aligned."""
    marks = ["---:" if (align[i:i + 1] == "r") else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]],
                align: str = "") -> None:
    print("\n".join(markdown_table(header, rows, align)), flush=True)


def write_json(path: Path, data: Any) -> Path:
    """`data` as indented JSON at `path` (its directory made first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path
