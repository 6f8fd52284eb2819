"""Registry HA on etcd: what the store costs the hot path, and how fast an intent spreads.

    .venv/bin/python bench/bench_store.py [--quick] [--rounds N] [--registries N]

Every registry is a `pdreg registry` process and etcd a real one on loopback (Debian's
etcd-server 3.4), as deployed:

1. ingest: the signed heartbeat flood of bench_registry.py at a registry with `--store
   memory` and at one with `--store etcd://...`, in interleaved rounds; the registry
   process's CPU per heartbeat (all its threads: the store's included), and the ratio.
   Heartbeats never touch the store, so the two should be equal.
2. propagation: N registries on one etcd, one member registered at all of them; an
   operator cordons and uncordons it through each registry in turn (HTTP); the time
   from the request to each registry's event stream showing it, as a `MembershipView`
   subscribed to that registry sees it (p50/p99 to the registry that took the write, to
   the others, and to every registry).
3. a registry frozen (SIGSTOP): `pdreg status`'s fetch over all N registries, one of
   them frozen (the time, and that the frozen one is named); with `--baseline-src DIR`
   also the fetch of that source tree (e.g. `git archive main | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from bench_registry import Ingest, _drive, register_members  # noqa: E402
from etcd_process import EtcdProcess  # noqa: E402

from pdreg.cmd_status import fetch_fleet  # noqa: E402
from pdreg.testing import die_with_parent  # noqa: E402
from registry.client import LiveMember, MembershipView  # noqa: E402


@contextmanager
def registry(store: str, *, http: bool = True, lease_s: float = 300.0
             ) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """A `pdreg registry --store STORE` on OS-chosen ports: (control, HTTP URL, process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "registry", "--port", "0",
         "--events-port", "0", "--http-port", "0" if http else "-1", "--lease", str(lease_s),
         "--store", store],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        control = line.split("control ")[1].split()[0]
        url = line.split(" http ")[1].split()[0]
        yield control, url, proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=15)


def bench_ingest(store: str, seconds: float) -> Ingest:
    with registry(store, http=False) as (control, _, proc):
        return _drive(control, proc.pid, seconds, signed=True)


def bench_propagation(etcd: str, registries: int, samples: int) -> dict[str, list[float]]:
    """Seconds from an admin request to each registry's events showing it."""
    with ExitStack() as stack:
        started = [stack.enter_context(registry(etcd)) for _ in range(registries)]
        for control, _, _ in started:
            register_members(control, 1)  # m-0 at every registry
        views = [stack.enter_context(MembershipView(control)) for control, _, _ in started]
        for view in views:
            assert view.wait_for(lambda m: "m-0" in m, 30)
        seen = [threading.Event() for _ in views]
        arrived = [0.0] * len(views)
        want = {"cordoned": False}

        def listener(index: int) -> Callable[[Mapping[str, LiveMember]], None]:
            def on_change(members: Mapping[str, LiveMember]) -> None:
                member = members.get("m-0")
                if member is not None and member.record.cordoned is want["cordoned"] \
                        and not seen[index].is_set():
                    arrived[index] = time.perf_counter()
                    seen[index].set()
            return on_change

        for index, view in enumerate(views):
            view.add_listener(listener(index))
        taking: list[float] = []
        others: list[float] = []
        every: list[float] = []
        with httpx.Client(timeout=10.0) as http:
            for n in range(samples):
                writer = n % registries
                want["cordoned"] = n % 2 == 0
                for event in seen:
                    event.clear()
                url = f"{started[writer][1]}/v1/members/m-0/cordon"
                begun = time.perf_counter()
                response = http.post(url) if want["cordoned"] else http.delete(url)
                response.raise_for_status()
                for event in seen:
                    if not event.wait(10):
                        raise RuntimeError("a registry never showed the change")
                delays = [at - begun for at in arrived]
                taking.append(delays[writer])
                others += [d for i, d in enumerate(delays) if i != writer]
                every.append(max(delays))
        return {"taking": taking, "others": others, "every": every}


_TIMED_FETCH = """
import sys, time
from pdreg.cmd_status import fetch_members
started = time.perf_counter()
fetch_members(sys.argv[1])
print(time.perf_counter() - started)
"""


def bench_frozen_status(etcd: str, registries: int, rounds: int,
                        sources: dict[str, str]) -> dict[str, list[float]]:
    """Seconds `pdreg status`'s fetch over every registry takes with the first frozen,
    per source tree (this one, and a baseline's), each in a fresh process."""
    with ExitStack() as stack:
        started = [stack.enter_context(registry(etcd)) for _ in range(registries)]
        started[0][2].send_signal(signal.SIGSTOP)
        names = ",".join(control for control, _, _ in started)
        fleet = fetch_fleet(names)
        assert list(fleet.unreachable) == [started[0][0]], fleet.unreachable
        times: dict[str, list[float]] = {name: [] for name in sources}
        for _ in range(rounds):  # interleaved
            for name, src in sources.items():
                out = subprocess.run([sys.executable, "-c", _TIMED_FETCH, names], cwd=src,
                                     env={**os.environ, "PYTHONPATH": src},
                                     capture_output=True, text=True, check=True)
                times[name].append(float(out.stdout.split()[-1]))
        started[0][2].send_signal(signal.SIGCONT)
        return times


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="ingest rounds, interleaved (default 3, quick 1); medians shown")
    parser.add_argument("--registries", type=int, default=3)
    parser.add_argument("--samples", type=int, default=None,
                        help="propagation samples (default 200, quick 20)")
    parser.add_argument("--baseline-src", metavar="DIR", default=None,
                        help="also time `pdreg status`'s fetch from this source tree (e.g. "
                             "main before the change) with a registry frozen")
    args = parser.parse_args()
    if shutil.which("etcd") is None:
        print("etcd is not installed (apt-get install etcd-server)", file=sys.stderr)
        return 2
    seconds = 2.0 if args.quick else 8.0
    rounds = args.rounds or (1 if args.quick else 3)
    samples = args.samples or (20 if args.quick else 200)
    with tempfile.TemporaryDirectory() as tmp:
        etcd_process = EtcdProcess(Path(tmp) / "etcd").start()
        try:
            store = f"etcd://{etcd_process.endpoint}/bench"
            print(f"registry store benchmarks (etcd {etcd_process.endpoint}, loopback; "
                  f"load average {os.getloadavg()[0]:.1f})")
            figures: dict[str, list[Ingest]] = {"memory": [], "etcd": []}
            for _ in range(rounds):  # interleaved, so a noisy minute hits both
                figures["memory"].append(bench_ingest("memory", seconds))
                figures["etcd"].append(bench_ingest(store, seconds))
            cpu = {name: statistics.median(r.cpu_us_per_heartbeat for r in results)
                   for name, results in figures.items()}
            for name, results in figures.items():
                print(f"  ingest, --store {name:6}: "
                      f"{statistics.median(r.heartbeats_per_s for r in results):9,.0f} "
                      f"heartbeats/s, {cpu[name]:5.1f} us CPU each [per round: "
                      f"{', '.join(f'{r.cpu_us_per_heartbeat:.1f}' for r in results)}]")
            print(f"  etcd / memory CPU per heartbeat: {cpu['etcd'] / cpu['memory']:.2f}")
            prop = bench_propagation(store, args.registries, samples)
            for name, values in prop.items():
                print(f"  propagation ({name}, {args.registries} registries, {samples} "
                      f"writes): p50 {1e3 * statistics.median(values):.1f} ms, p99 "
                      f"{1e3 * _p(values, 0.99):.1f} ms, max {1e3 * max(values):.1f} ms")
            sources = {"this tree": ROOT}
            if args.baseline_src:
                sources["--baseline-src"] = args.baseline_src
            frozen = bench_frozen_status(store, args.registries, 3 if args.quick else 5,
                                         sources)
            for name, times in frozen.items():
                print(f"  status over {args.registries} registries, one frozen ({name}): "
                      f"{', '.join(f'{t:.2f}' for t in times)} s")
            print(f"  (load average at the end {os.getloadavg()[0]:.1f})")
        finally:
            etcd_process.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
