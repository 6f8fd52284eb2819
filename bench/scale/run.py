"""One measured run of `bench_scale.py`: a registry, the generator's fleet, subscribers
and a view, a window, and the figures (`Result`).

The order matters on a shared machine: the fleet registers first; routers (subscribers)
come once it is up (100 of them in one process could not take 100k joins each; in a
real fleet each has its own host); every member heartbeats once and the view syncs
before the window; the loop's own figures are scraped around the window, not in it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field

from bench.procs import cpu_s, registry_process, runq_s, thread_cpu_s
from bench.scale.generator import generator
from bench.scale.listeners import Heard, subscribers, view_process
from bench.scale.profile import profiled, py_spy
from bench.scale.registry_figures import (
    heartbeats_handled,
    loop_figures,
    scrape_during,
    sync_bytes,
)
from bench.scale.result import Result, result
from registry.client import request_snapshot

SCRAPE_SETTLE_S = 1.0  # after the scrape before the window: its backlog drains
REGISTERED_TIMEOUT_S = 600.0
CHILD_TIMEOUT_S = 120.0
AFTER_WINDOW_S = 2.0  # the last scrape's and the window's backlog drain before the Sync

__all__ = ["Result", "Settings", "run_one"]


@dataclass(frozen=True)
class Settings:
    """What one run measures (bench_scale.py's flags)."""

    members: int
    subscribers: int = 100
    churn_per_s: float = 0.0
    measure_s: float = 10.0
    per_model: bool = False
    warmup_s: float = 0.0
    profile: str = ""  # a directory: py-spy and GC logs of the registry
    scrape_every_s: float = 0.0
    nice_generator: int = 0
    sub_procs: int = 1
    # Scrape the loop's histograms of a baseline registry too (one before the capped
    # per-member series, before bde53e6, takes ~1.5 s per scrape at 100k: set False).
    baseline_figures: bool = True


@dataclass
class Window:
    """What the measured window gave, seen from outside the processes."""

    elapsed: float = 0.0
    registry_cpu: float = 0.0
    threads: dict[str, float] = field(default_factory=dict)  # % of a core per thread
    others_cpu: dict[str, float] = field(default_factory=dict)  # gen, sub
    waited: dict[str, float] = field(default_factory=dict)  # runnable, no CPU
    loop: dict[str, float] = field(default_factory=dict)  # the loop's own, over loop_span
    loop_span_s: float = 0.0
    scrapes: list[tuple[int, float]] = field(default_factory=list)


class _Run:
    """The child processes of one run and their queues (the registry is the caller's)."""

    def __init__(self, tree: str, address: str, pid: int, settings: Settings) -> None:
        self.tree, self.address, self.pid, self.settings = tree, address, pid, settings
        hello = request_snapshot(address, timeout_s=10)
        host = address.rpartition(":")[0]
        self.metrics_url = f"http://{host}:{hello.http_port}/metrics"
        self.events = f"{host}:{hello.events_port}"
        self.queues = {name: (mp.Queue(), mp.Queue()) for name in ("gen", "sub", "view")}
        self.figures = tree.startswith("this") or settings.baseline_figures

    def start(self) -> tuple[float, int, float]:
        """The generator, then (once the fleet is in) the subscribers and the view;
        (seconds to register, members not registered, the interval dictated)."""
        s = self.settings
        self.gen = mp.Process(target=generator, args=(self.address, s.members, s.churn_per_s,
                                                      *self.queues["gen"], s.nice_generator))
        self.gen.start()
        _, register_s, missing, interval = self.queues["gen"][1].get(
            timeout=REGISTERED_TIMEOUT_S)
        ready: mp.Queue = mp.Queue()
        procs = self.sub_procs = max(1, min(s.sub_procs, s.subscribers))
        self.sub_queues = [self.queues["sub"],
                           *((mp.Queue(), mp.Queue()) for _ in range(procs - 1))]
        share = [range(s.subscribers * j // procs, s.subscribers * (j + 1) // procs)
                 for j in range(procs)]
        self.subs = [mp.Process(target=subscribers, args=(self.events, share[j], s.per_model,
                                                          ready, *self.sub_queues[j]))
                     for j in range(procs)]
        for p in self.subs:
            p.start()
        for _ in self.subs:
            ready.get(timeout=60)
        self.view = mp.Process(target=view_process, args=(self.address, *self.queues["view"]))
        self.view.start()
        return register_s, missing, interval

    def window(self, label: str) -> Window:
        """Start, measure for measure_s (scraping /metrics meanwhile with scrape_every_s),
        end; CPU and run-queue figures of every process around it."""
        s, pid, w = self.settings, self.pid, Window()
        loop0 = loop_figures(self.metrics_url) if self.figures else {}
        loop_t0 = time.monotonic()
        if self.figures:
            time.sleep(SCRAPE_SETTLE_S)
        for name in self.queues:
            self.queues[name][0].put("start")
        spy = (py_spy(pid, s.measure_s, os.path.join(s.profile, f"{label}.txt"))
               if s.profile else None)
        watched = {"registry": [pid], "sub": [p.pid for p in self.subs]}
        others = {"gen": [self.gen.pid], "sub": [p.pid for p in self.subs]}
        waited0 = {name: sum(map(runq_s, pids)) for name, pids in watched.items()}
        others0 = {name: sum(map(cpu_s, pids)) for name, pids in others.items()}
        threads0 = thread_cpu_s(pid)
        cpu0, t0 = cpu_s(pid), time.monotonic()
        w.scrapes = scrape_during(self.metrics_url, s.measure_s, s.scrape_every_s)
        w.registry_cpu, w.elapsed = cpu_s(pid) - cpu0, time.monotonic() - t0
        threads = {name: round(100 * (t - threads0.get(name, 0.0)) / w.elapsed, 1)
                   for name, t in thread_cpu_s(pid).items()}
        w.threads = {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v}
        w.others_cpu = {name: sum(map(cpu_s, pids)) - others0[name]
                        for name, pids in others.items()}
        w.waited = {name: sum(map(runq_s, pids)) - waited0[name]
                    for name, pids in watched.items()}
        if spy is not None:
            spy.wait(timeout=60)
        for name in self.queues:
            self.queues[name][0].put("end")
        for q in self.sub_queues[1:]:
            q[0].put("end")
        w.loop = {k: v - loop0.get(k, 0.0)
                  for k, v in (loop_figures(self.metrics_url) if self.figures else {}).items()}
        w.loop_span_s = time.monotonic() - loop_t0  # the window, a little on either side
        return w

    def collect(self) -> tuple[tuple, Heard, float, tuple]:
        """The children's reports: the generator's, the subscribers' (merged; the bytes
        are the all-topics subscriber's), their longest GC, the view's."""
        _, *from_gen = self.queues["gen"][1].get(timeout=CHILD_TIMEOUT_S)
        heard, sub_gc_max_ms = Heard(), 0.0
        for j, q in enumerate(self.sub_queues):
            nbytes, messages, arrivals, own, suspects, pauses = q[1].get(
                timeout=CHILD_TIMEOUT_S)
            sub_gc_max_ms = max(sub_gc_max_ms, pauses["gc_max_ms"])
            if j == 0:
                heard.nbytes, heard.messages = nbytes, messages
            for k, times in arrivals.items():
                heard.arrivals.setdefault(k, []).extend(times)
            for k, times in own.items():
                heard.own.setdefault(k, []).extend(times)
            heard.wrongly_suspect.update(suspects)
        from_view = self.queues["view"][1].get(timeout=CHILD_TIMEOUT_S)
        for p in (self.gen, *self.subs, self.view):
            p.join(timeout=30)
        return tuple(from_gen), heard, sub_gc_max_ms, from_view


def run_one(tree: str, src: str, extra: tuple[str, ...], settings: Settings) -> Result:
    """One run of the registry of source tree `src` (labelled `tree`, run with the
    extra flags `extra`) under `settings`."""
    s = settings
    label = f"{tree}-{s.members}"
    with profiled(src, s.profile, label) as run_src, registry_process(
            1.0, 3.0, src=run_src, extra=("--max-members", str(2 * s.members + 1000),
                                          "--http-port", "0", *extra)) as (address, pid):
        run = _Run(tree, address, pid, s)
        register_s, missing, interval = run.start()
        # Every member heartbeats once, the view syncs, the registration backlog drains.
        time.sleep(max(2.0, 1.5 * interval, s.warmup_s))
        window = run.window(label)
        from_gen, heard, sub_gc_max_ms, from_view = run.collect()
        # Scraped after the window (a registry before the cap: ~10 MB, ~1.5 s at 100k).
        time.sleep(AFTER_WINDOW_S)
        handled = heartbeats_handled(run.metrics_url)
        t_sync = time.perf_counter()
        raw = sync_bytes(address)
        snapshot_s = time.perf_counter() - t_sync
    return result(tree, s, (register_s, missing, interval), window, from_gen, heard,
                  sub_gc_max_ms, from_view, handled, (snapshot_s, len(raw)), run.sub_procs)
