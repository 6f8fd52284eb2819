"""Plot bench/out/router.json (from bench_router.py): CPU per request, p99 latency, and
p99 TTFT / end to end with a slow prefill / decode.

Runs in .venv-peers (matplotlib lives there, not in the project's test venv):

    .venv-peers/bin/python bench/plots/plot_router.py bench/out/router.json bench/plots/router.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

PDREG_COLOR = "#1f77b4"
PEER_COLOR = "#999999"


def label(row: dict) -> str:
    return row["router"] if row["handshake"] == "-" else f"{row['router']}\n{row['handshake']}"


def bars(axis: plt.Axes, rows: list[dict], key: str, title: str, unit: str) -> None:
    rows = [r for r in rows if r.get(key) is not None]
    colors = [PDREG_COLOR if r["router"].startswith("pdreg") else PEER_COLOR for r in rows]
    values = [r[key] for r in rows]
    positions = range(len(rows))
    axis.bar(positions, values, color=colors)
    axis.set_xticks(list(positions), [label(r) for r in rows], fontsize=7, rotation=30,
                    ha="right")
    axis.set_title(title, fontsize=9)
    axis.set_ylabel(unit, fontsize=8)
    for x, value in zip(positions, values, strict=True):
        axis.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom", fontsize=7)


def main() -> int:
    data = json.loads(Path(sys.argv[1]).read_text())
    steady, slow = data["steady"], data["slow"]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    bars(axes[0], steady, "cpu_us_per_req", "router CPU per request (c=32)", "µs")
    bars(axes[1], steady, "p99_ms_c32", "p99 latency at c=32", "ms")
    bars(axes[2], [r for r in slow if r["slow"] == "prefill"], "ttft_p99_ms",
         "p99 TTFT, one prefill 10x slower (streaming)", "ms")
    bars(axes[3], [r for r in slow if r["slow"] == "decode"], "e2e_p99_ms",
         "p99 end to end, one decode 5x slower (streaming)", "ms")
    figure.tight_layout()
    figure.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
