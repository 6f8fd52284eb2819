"""Plot bench/out/overload.json (from bench_overload.py): goodput and critical p99 TTFT
against the offered load, one line per router.

Runs in .venv-peers (matplotlib lives there, not in the project's test venv):

    .venv-peers/bin/python bench/plots/plot_overload.py bench/out/overload.json \
        bench/plots/overload.png
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def main(source: str, target: str) -> int:
    data = json.loads(Path(source).read_text())
    routers: dict[str, list[dict]] = {}
    for cell in data["cells"]:
        routers.setdefault(cell["router"], []).append(cell)
    figure, (goodput, critical) = plt.subplots(1, 2, figsize=(11, 4))
    for name, cells in routers.items():
        cells.sort(key=lambda c: c["load"])
        loads = [c["load"] for c in cells]
        style = "-o" if name.startswith("pdreg") else "--s"
        goodput.plot(loads, [c["goodput_rps"] for c in cells], style, label=name)
        critical.plot(loads, [c["critical_p99_s"] if not math.isnan(c["critical_p99_s"])
                              else None for c in cells], style, label=name)
    goodput.axhline(data["capacity_rps"], color="#999999", linewidth=0.8)
    goodput.set(title="goodput (requests within their class SLO)", xlabel="offered load "
                "(x capacity)", ylabel="requests/s", xscale="log")
    critical.set(title="critical class: p99 TTFT", xlabel="offered load (x capacity)",
                 ylabel="seconds", xscale="log", yscale="log")
    for axis in (goodput, critical):
        axis.set_xticks(sorted({c["load"] for c in data["cells"]}))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(target, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
