"""The critical class's floor on bench_overload.py's fleet: what an ideal router would
show, simulated (no processes, a few seconds of CPU).

The ideal router knows every engine's state at once and costs nothing: 2 prefills, each
one prompt at a time for exactly `service` seconds (the bench's sim engines, serial);
Poisson arrivals in the bench's three classes; a prompt starts the moment a prefill is
free, highest priority first (non-preemptive: a critical request that finds both
prefills busy with lower-class prompts waits for the first to end); a request still
waiting at its class's deadline (its SLO less its service, as admission's) is refused.
TTFT = wait + service. Printed per load: the critical class's p99 TTFT as the bench
measures it (one cell of --duration seconds from an empty queue: the median over many
cells, and the 10th-90th percentile range) and in a long run, the share of critical
requests refused, and the same with no deadline for the critical class (it waits
without bound). With --headroom, lower classes may not take the last free prefill (kept
for a critical).

    .venv/bin/python bench/overload_floor.py [--capacity 3.9] [--duration 15]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_overload import CLASSES  # (share, TTFT SLO s) per class

PRIORITY = {name: -index for index, name in enumerate(CLASSES)}  # listed highest first
PREFILLS = 2


@dataclass
class Served:
    klass: str
    ttft_s: float | None  # None: refused at its deadline


def simulate(rate: float, duration_s: float, service_s: float, rng: random.Random, *,
             deadlines: bool = True, headroom: bool = False) -> list[Served]:
    names, shares = list(CLASSES), [share for share, _ in CLASSES.values()]
    arrivals, t = [], rng.expovariate(rate)
    while t < duration_s:
        arrivals.append((t, rng.choices(names, shares)[0]))
        t += rng.expovariate(rate)
    limit = {n: CLASSES[n][1] - service_s for n in names}
    if not deadlines:
        limit["critical"] = math.inf
    free = [0.0] * PREFILLS  # when each prefill is done with its prompt
    queue: list[tuple[float, str]] = []
    out: list[Served] = []
    now, index = 0.0, 0
    while index < len(arrivals) or queue:
        next_arrival = arrivals[index][0] if index < len(arrivals) else math.inf
        next_free = max(min(free), now) if queue else math.inf
        if headroom and queue and all(k != "critical" for _, k in queue):
            next_free = max(max(free), now)  # lower classes wait for both to be free
        if next_arrival <= next_free:
            now = next_arrival
            queue.append(arrivals[index])
            index += 1
        else:
            now = next_free
        while _start(queue, free, now, limit, out, service_s, headroom):
            pass
    return out


def _start(queue: list[tuple[float, str]], free: list[float], now: float,
           limit: dict[str, float], out: list[Served], service_s: float,
           headroom: bool) -> bool:
    """Start the next prompt on a free prefill; False when none can start now."""
    idle = [i for i, at in enumerate(free) if at <= now]
    for late in [w for w in queue if now - w[0] > limit[w[1]]]:
        queue.remove(late)
        out.append(Served(late[1], None))
    if not idle or not queue:
        return False
    arrived, klass = max(queue, key=lambda w: (PRIORITY[w[1]], -w[0]))
    if headroom and klass != "critical" and len(idle) < PREFILLS:
        return False
    queue.remove((arrived, klass))
    free[idle[0]] = now + service_s
    out.append(Served(klass, now - arrived + service_s))
    return True


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def critical(cells: list[list[Served]]) -> tuple[list[float], float]:
    """Per cell the critical p99 TTFT; the share of criticals refused over all."""
    p99s, refused, total = [], 0, 0
    for cell in cells:
        ttfts = [s.ttft_s for s in cell if s.klass == "critical" and s.ttft_s is not None]
        if ttfts:
            p99s.append(p99(ttfts))
        refused += sum(1 for s in cell if s.klass == "critical" and s.ttft_s is None)
        total += sum(1 for s in cell if s.klass == "critical")
    return sorted(p99s), refused / max(1, total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=float, default=3.9, help="requests/s measured")
    parser.add_argument("--service", type=float, default=0.0,
                        help="seconds a prompt (default: prefills / capacity)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds a cell")
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--loads", default="0.5,1,2,4")
    parser.add_argument("--headroom", action="store_true")
    args = parser.parse_args()
    service = args.service or PREFILLS / args.capacity
    rng = random.Random(1)
    print(f"service {service:.3f} s a prompt, {PREFILLS} prefills; cells of "
          f"{args.duration:g} s")
    for load in (float(x) for x in args.loads.split(",")):
        rate = load * args.capacity
        for deadlines in (True, False):
            cells = [simulate(rate, args.duration, service, rng, deadlines=deadlines,
                              headroom=args.headroom) for _ in range(args.cells)]
            p99s, refused = critical(cells)
            long_p99s, _ = critical([simulate(rate, 2000.0, service, rng,
                                              deadlines=deadlines, headroom=args.headroom)])
            good = statistics.mean(sum(1 for s in cell if s.ttft_s is not None
                                       and s.ttft_s <= CLASSES[s.klass][1]) for cell in cells)
            print(f"{load:g}x {'deadlines' if deadlines else 'no deadline'}: critical p99 "
                  f"{statistics.median(p99s):.2f} s ({p99s[len(p99s) // 10]:.2f}-"
                  f"{p99s[len(p99s) * 9 // 10]:.2f}), long run {long_p99s[0]:.2f} s; "
                  f"criticals refused {refused:.1%}; goodput "
                  f"{good / args.duration:.2f}/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
