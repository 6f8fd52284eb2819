"""What routers' KV index reports cost the registry (registry/kv_reports.py), at scale.

Drives the registry's own decode + store path in one process, as the loop runs it: a
`KvIndexReport` of one message's worth of entries (the agent's 16 KiB budget) decoded
with the control decoder and applied. Measures, for R routers x M members:
- memory held per (router, member) entry (tracemalloc, after a full load);
- loop time per entry: a refresh (nothing moved) and a change;
- a router's departure (its entries dropped, summaries recomputed) and a sweep;
then prints the cost per second at the reporter's rates (REFRESH_TICKS, one report per
router and interval). The machine is shared and noisy, so the same run also times the
registry's heartbeat path (decode, proof, `Membership.heartbeat`) as a yardstick: costs are
given in heartbeat equivalents too, a ratio that holds on a quiet machine.

    .venv/bin/python bench/bench_kv_reports.py --routers 100 --members 10000
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Callable

from registry import sessions
from registry.kv_reports import VIEW_CHUNK, KvReports
from registry.membership import Membership
from router.kv.reporter import REFRESH_MAX_PER_TICK, REFRESH_TICKS
from wire.protocol import (
    Endpoints,
    Heartbeat,
    KvIndexEntry,
    KvIndexReport,
    KvIndexState,
    Load,
    MemberSpec,
    MemberState,
    Role,
    control_decoder,
    make_encoder,
)

ENTRIES_PER_MESSAGE = 300  # ~16 KiB at 30-character ids (engine_agent.link budget)


def member_ids(n: int) -> list[str]:
    return [f"prefill-10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}-8000" for i in range(n)]


def messages(router: str, ids: list[str], blocks: int, session: bytes) -> list[bytes]:
    encode = make_encoder().encode
    out = []
    for seq, start in enumerate(range(0, len(ids), ENTRIES_PER_MESSAGE), 1):
        entries = [KvIndexEntry(m, 1, KvIndexState.LIVE, blocks + i, 20)
                   for i, m in enumerate(ids[start:start + ENTRIES_PER_MESSAGE])]
        out.append(sessions.seal(session, encode(KvIndexReport(router, 1, seq, entries))))
    return out


def heartbeat_us(members: int = 2000, rounds: int = 5) -> float:
    """Loop time of one heartbeat (decode, proof, transition), the registry's unit of work."""
    membership = Membership(1)
    encode, decoder = make_encoder().encode, control_decoder()
    payloads = []
    for i in range(members):
        spec = MemberSpec(id=f"decode-{i}", incarnation=1, role=Role.DECODE, model="m",
                          protocol="reference", endpoints=Endpoints(http="http://h:1"))
        session = membership.register(spec, MemberState.READY, Load(), 0.0,
                                      nonce=sessions.new_nonce()).session
        payloads.append([sessions.seal(session, encode(Heartbeat(
            spec.id, 1, seq, MemberState.READY, Load(running=seq % 3))))
            for seq in range(1, rounds + 1)])
    started = time.perf_counter()
    for r in range(rounds):
        for beats in payloads:
            payload = beats[r]
            beat = decoder.decode(payload)
            membership.heartbeat(beat, payload, 1.0 + r)
    return 1e6 * (time.perf_counter() - started) / (members * rounds)


def memory_held(routers: list[str], first: list[list[bytes]],
                current: Callable[[str], int | None]) -> int:
    """Bytes a full load holds, on a store of its own: tracemalloc slows every
    allocation, so the timed load runs without it."""
    decoder = control_decoder()
    kv = KvReports()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for router, payloads in zip(routers, first, strict=True):
        for payload in payloads:
            kv.admit(router, 1, 0.0, 1e-9)
            kv.apply(router, decoder.decode(payload).entries, current, 0.0)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return held


class Loop:
    """The registry loop's path for KV reports: decode, proof, admit, apply."""

    def __init__(self, session: bytes, current: Callable[[str], int | None]) -> None:
        self.kv = KvReports()
        self.session, self.current = session, current
        self.decoder = control_decoder()
        gc.collect()

    def ingest(self, router: str, payloads: list[bytes]) -> float:
        """Seconds of loop time to take `payloads` from `router`."""
        started = time.perf_counter()
        for payload in payloads:
            message = self.decoder.decode(payload)
            sessions.verify(self.session, payload, message.proof)
            self.kv.admit(router, 1, time.monotonic(), 1e-9)  # (the rate is not measured here)
            self.kv.apply(router, message.entries, self.current, time.monotonic())
        return time.perf_counter() - started

    def departure(self, routers: list[str], members: int) -> tuple[float, float]:
        """A router restarts: everything it said goes (at its first report), and the
        members' summaries are republished VIEW_CHUNK a report (the other routers'
        reports). (Loop seconds in all, the longest single report.)"""
        started = time.perf_counter()
        self.kv.admit(routers[-1], 2, 0.0, 1.0)
        longest_s = depart_s = time.perf_counter() - started
        for turn in range(members // VIEW_CHUNK + 2):
            started = time.perf_counter()
            self.kv.apply(routers[turn % len(routers)], [], self.current, 10.0 + turn)
            took = time.perf_counter() - started
            depart_s += took
            longest_s = max(longest_s, took)
        return depart_s, longest_s

    def sweep(self, routers: list[str]) -> float:
        started = time.perf_counter()
        self.kv.sweep(1e9, self.current, dict.fromkeys(routers, 1).get)
        return time.perf_counter() - started


def _print(args: argparse.Namespace, held: int, loaded_s: float, refresh_us: float,
           change_us: float, departure: tuple[float, float], sweep_s: float) -> None:
    entries = args.routers * args.members
    beat_us = heartbeat_us()
    # entries/s at a 1 s interval (router/kv/reporter.py's rolling refresh)
    refresh_rate = args.routers * min(REFRESH_MAX_PER_TICK, args.members / REFRESH_TICKS)
    print(f"{args.routers} routers x {args.members} members = {entries:,} entries")
    print(f"  memory held: {held / 2**20:.1f} MiB ({held / entries:.0f} B per entry)")
    print(f"  first load: {1e6 * loaded_s / entries:.2f} us per entry "
          f"(= {1e6 * loaded_s / entries / beat_us:.2f} heartbeats)")
    print(f"  refresh (unchanged): {refresh_us:.2f} us per entry "
          f"(decode, proof, compare)")
    print(f"  change: {change_us:.2f} us per entry (plus summary and view update)")
    print(f"  a router's departure: {1e3 * departure[0]:.0f} ms of loop in all, at most "
          f"{1e3 * departure[1]:.0f} ms in one report; a sweep: {1e3 * sweep_s:.1f} ms")
    print(f"  yardstick: a heartbeat costs {beat_us:.2f} us in this run: a refreshed entry "
          f"= {refresh_us / beat_us:.2f} heartbeats, a changed one "
          f"{change_us / beat_us:.2f}")
    print(f"  rolling refresh alone: {refresh_rate:,.0f} entries/s -> "
          f"{refresh_rate * refresh_us / 1e4:.1f}% of the loop's core "
          f"(= {refresh_rate * refresh_us / beat_us:,.0f} heartbeats/s)")
    print(f"  messages: {args.routers} per second at most (one per router and interval)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, default=100)
    parser.add_argument("--members", type=int, default=10_000)
    args = parser.parse_args()
    ids = member_ids(args.members)
    current = dict.fromkeys(ids, 1).get
    routers = [f"api_server-10.1.{r // 256}.{r % 256}-8000" for r in range(args.routers)]
    session = sessions.new_session()
    first = [messages(r, ids, 100, session) for r in routers]
    held = memory_held(routers, first, current)
    loop = Loop(session, current)
    loaded_s = sum(loop.ingest(r, p) for r, p in zip(routers, first, strict=True))
    assert loop.kv.held == args.routers * args.members
    # A refresh that restates unchanged figures, and one where every figure moved.
    sample = routers[: max(1, args.routers // 10)]
    refresh_s = sum(loop.ingest(r, first[i]) for i, r in enumerate(sample))
    moved = [messages(r, ids, 5000, session) for r in sample]
    change_s = sum(loop.ingest(r, p) for r, p in zip(sample, moved, strict=True))
    sampled = len(sample) * args.members
    departure = loop.departure(routers, args.members)
    sweep_s = loop.sweep(routers)
    _print(args, held, loaded_s, 1e6 * refresh_s / sampled, 1e6 * change_s / sampled,
           departure, sweep_s)


if __name__ == "__main__":
    main()
