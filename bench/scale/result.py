"""The figures of one `bench_scale.py` run (`Result`), computed from what the window,
the generator, the subscribers and the view reported."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.scale.fleet import gc_text
from bench.scale.listeners import Heard
from bench.tables import nearest_rank

if TYPE_CHECKING:
    from bench.scale.run import Settings, Window


@dataclass
class Result:
    """One run's figures, as bench_scale.py prints them (a JSON line, and the table)."""

    tree: str
    members: int
    subscribers: int
    per_model: bool
    churn_per_s: float
    interval_s: float
    register_s: float
    not_registered: int
    offered_per_s: float
    sent_total: int  # heartbeats the generator sent, the whole run
    handled_total: int  # heartbeats the registry handled, the whole run (its own counter)
    answered_per_s: float  # OK replies the generator read back
    refused: int
    registry_core_pct: float
    registry_us_per_heartbeat: float
    registry_us_per_delivered_msg: float
    propagation_p50_ms: float
    propagation_p99_ms: float
    probes_lost: int
    pub_bytes_per_router_per_s: float
    pub_msgs_per_router_per_s: float
    view_core_pct: float
    view_members: int
    wrongly_suspect: int
    snapshot_ms: float
    snapshot_mb: float
    # time the process's threads waited for a CPU while runnable (schedstat), % of the window
    registry_runq_wait_pct: float = 0.0
    subscribers_runq_wait_pct: float = 0.0
    turns_per_s: int = 0  # loop turns a second in the window (the registry's own count)
    turns_over_25ms: int = 0  # loop turns in the window that took longer (the registry's own)
    turns_over_100ms: int = 0
    snapshot_builds: int = 0  # HTTP snapshots built in the window
    snapshot_build_ms_mean: float = 0.0
    scrapes: int = 0  # /metrics scrapes inside the window (--scrape-every)
    scrape_kb: float = 0.0
    scrape_ms_max: float = 0.0
    # The probe's propagation to the first subscriber that got it (the registry, libzmq and
    # one socket: no fan-out queueing), and the subscriber processes' own part of each
    # arrival: time spent on other sockets since the poll returned.
    first_p50_ms: float = 0.0
    first_p99_ms: float = 0.0
    sub_own_p99_ms: float = 0.0
    sub_procs: int = 1
    # The probe heartbeat's reply, read back by the generator: its way into the registry
    # and through the control queue (plus the generator's own delay in reading it).
    probe_reply_p50_ms: float = 0.0
    probe_reply_p99_ms: float = 0.0
    probe_series_ms: list[float] = field(default_factory=list)  # (JSON only)
    # % of a core per registry thread (the loop vs libzmq's I/O threads), JSON only
    registry_threads_pct: dict[str, float] = field(default_factory=dict)
    generator_core_pct: float = 0.0  # the bench's own share of the machine
    subscribers_core_pct: float = 0.0
    generator_us_per_heartbeat: float = 0.0  # its CPU over the heartbeats it sent
    # How late the generator sent each heartbeat after it was due (the machine or a pause
    # holding it back, and then a burst of overdue heartbeats): p50/p99/max, how many over
    # 10 ms, its longest gap between two ticks, its garbage collections (count, longest),
    # and per second of the window the latest one (JSON only).
    generator_late_p50_ms: float = 0.0
    generator_late_p99_ms: float = 0.0
    generator_late_max_ms: float = 0.0
    generator_late_over_10ms: int = 0
    generator_gap_max_ms: float = 0.0
    generator_gc: str = ""
    generator_late_per_s_ms: list[float] = field(default_factory=list)
    # The longest garbage collection in the window: the subscriber processes, the view's
    subscribers_gc_max_ms: float = 0.0
    view_gc: str = ""


@dataclass
class _Probes:
    """The probe events of the window: per arrival at a subscriber its delay (ms), per
    probe the delay to its first subscriber and its last one, the subscriber processes'
    own part, the replies to the probe's heartbeats, and arrivals that never came."""

    lat: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    series: list[float] = field(default_factory=list)
    replied: list[float] = field(default_factory=list)
    lost: int = 0


def _probes(marks: dict, probes: list[float], probe_replies: list[float], heard: Heard,
            subscribers: int) -> _Probes:
    start, end = int(marks["start"]["probes"]), int(marks["end"]["probes"])
    out = _Probes()
    for k in range(start, end):
        got = heard.arrivals.get(k, [])
        out.lost += subscribers - len(got)
        out.lat.extend(1e3 * (t - probes[k]) for t in got)
        if got:
            out.first.append(1e3 * (min(got) - probes[k]))
        out.series.append(round(1e3 * (max(got) - probes[k]), 1) if got else math.nan)
        out.own.extend(1e3 * t for t in heard.own.get(k, []))
    out.replied = sorted(1e3 * (probe_replies[k] - probes[k])
                         for k in range(start, min(len(probe_replies), end)))
    out.lat.sort()
    out.first.sort()
    out.own.sort()
    return out


def _ms(values: list[float], q: float) -> float:
    return round(nearest_rank(values, q), 1)


def result(tree: str, s: Settings, registered: tuple[float, int, float], w: Window,
           from_gen: tuple, heard: Heard, sub_gc_max_ms: float, from_view: tuple,
           handled: float, snapshot: tuple[float, int], sub_procs: int) -> Result:
    register_s, missing, interval = registered
    marks, probes, probe_replies, gen = from_gen
    view_core, view_members, view_pauses = from_view
    start, end = marks["start"], marks["end"]
    window = end["t"] - start["t"]
    p = _probes(marks, probes, probe_replies, heard, s.subscribers)
    answered = end["ok"] - start["ok"]
    sent = end["sent"] - start["sent"]
    cpu, elapsed = w.registry_cpu, w.elapsed
    loop = w.loop
    builds = loop.get("snapshot_builds", 0.0)
    return Result(
        tree=tree, members=s.members, subscribers=s.subscribers, per_model=s.per_model,
        churn_per_s=s.churn_per_s, interval_s=interval,
        register_s=round(register_s, 1), not_registered=missing,
        offered_per_s=round(sent / window), sent_total=int(end["sent"]),
        handled_total=int(handled), answered_per_s=round(answered / window),
        refused=int(end["other"] - start["other"]),
        registry_core_pct=round(100 * cpu / elapsed, 1),
        registry_us_per_heartbeat=round(1e6 * cpu / max(1, answered), 1),
        registry_us_per_delivered_msg=round(1e6 * cpu / max(1, heard.messages * s.subscribers),
                                            2),
        propagation_p50_ms=_ms(p.lat, 0.5), propagation_p99_ms=_ms(p.lat, 0.99),
        first_p50_ms=_ms(p.first, 0.5), first_p99_ms=_ms(p.first, 0.99),
        sub_own_p99_ms=_ms(p.own, 0.99), sub_procs=sub_procs,
        probe_series_ms=p.series, registry_threads_pct=w.threads,
        generator_core_pct=round(100 * w.others_cpu["gen"] / elapsed, 1),
        generator_us_per_heartbeat=round(1e6 * w.others_cpu["gen"] / max(1, sent), 1),
        generator_late_p50_ms=gen["late_p50_ms"], generator_late_p99_ms=gen["late_p99_ms"],
        generator_late_max_ms=gen["late_max_ms"], generator_late_over_10ms=gen["late_over"],
        generator_gap_max_ms=gen["gap_max_ms"], generator_gc=gc_text(gen),
        generator_late_per_s_ms=gen["late_per_s_ms"],
        subscribers_gc_max_ms=sub_gc_max_ms, view_gc=gc_text(view_pauses),
        subscribers_core_pct=round(100 * w.others_cpu["sub"] / elapsed, 1),
        probe_reply_p50_ms=_ms(p.replied, 0.5), probe_reply_p99_ms=_ms(p.replied, 0.99),
        probes_lost=p.lost, pub_bytes_per_router_per_s=round(heard.nbytes / elapsed),
        pub_msgs_per_router_per_s=round(heard.messages / elapsed),
        view_core_pct=round(100 * view_core, 1), view_members=view_members,
        wrongly_suspect=len(heard.wrongly_suspect), snapshot_ms=round(1e3 * snapshot[0], 1),
        snapshot_mb=round(snapshot[1] / 1e6, 2),
        registry_runq_wait_pct=round(100 * w.waited["registry"] / elapsed, 1),
        subscribers_runq_wait_pct=round(100 * w.waited["sub"] / elapsed, 1),
        turns_per_s=round(loop.get("turns", 0.0) / w.loop_span_s),
        turns_over_25ms=int(loop.get("turns_over_25ms", 0)),
        turns_over_100ms=int(loop.get("turns_over_100ms", 0)),
        snapshot_builds=int(builds),
        snapshot_build_ms_mean=round(1e3 * loop.get("snapshot_build_s", 0.0)
                                     / max(1.0, builds), 1),
        scrapes=len(w.scrapes),
        scrape_kb=round(max(b for b, _ in w.scrapes) / 1e3, 1) if w.scrapes else 0.0,
        scrape_ms_max=round(1e3 * max(t for _, t in w.scrapes), 1) if w.scrapes else 0.0)
