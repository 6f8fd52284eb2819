"""`bench_scale.py --deadband MEMBERS:INTERVAL`: how many load-digest entries a fleet
whose loads wobble on every heartbeat makes per deadband setting. Pure state and
simulated time (no sockets), so the figure does not depend on the machine's load."""

from __future__ import annotations

import heapq
import random

import msgspec

from bench.scale.fleet import MODELS, Member, member_spec
from registry import sessions
from registry.deadband import MAX_AGE_INTERVALS, MAX_AGE_S, Deadband
from registry.detector import DetectorConfig
from registry.membership import Membership
from wire.protocol import Heartbeat, Load, MemberState, make_encoder

DIGEST_PERIOD_S = 0.1


def deadband_entries(members: int, interval_s: float, seconds: float) -> list[dict[str, object]]:
    """Load-digest entries per second that `members` heartbeating every `interval_s` with
    the generator's random walk make, per deadband setting."""
    settings = [("every change (--load-max-age 0)", Deadband(max_age_s=0.0)),
                (f"band, max age {MAX_AGE_S:g} s", Deadband(max_age_s=MAX_AGE_S)),
                (f"band, max age {MAX_AGE_S:g} s or {MAX_AGE_INTERVALS:g} intervals",
                 Deadband(max_age_s=MAX_AGE_S, max_age_intervals=MAX_AGE_INTERVALS))]
    return [{"members": members, "interval_s": interval_s, "deadband": label,
             "heartbeats_per_s": round(members / interval_s),
             "digest_entries_per_s": round(_entries(members, interval_s, seconds, band)
                                           / seconds)}
            for label, band in settings]


def _entries(members: int, interval_s: float, seconds: float, band: Deadband) -> int:
    """Digest entries over `seconds` of simulated time, counted after two intervals and
    2 s (every member registered and heartbeating)."""
    encode = make_encoder().encode
    rng = random.Random(7)
    m = Membership(7, DetectorConfig(heartbeat_interval_s=interval_s,
                                     lease_s=3 * interval_s, tick_period_s=0.1),
                   deadband=band)
    fleet = []
    for i in range(members):
        member = Member(member_spec(f"d{i}", f"m{i % MODELS}", i), b"",
                        running=rng.randrange(64), kv=rng.random())
        member.session = m.register(member.spec, MemberState.READY, Load(member.running),
                                    0.0, nonce=sessions.new_nonce()).session
        fleet.append(member)
    due = [(rng.random() * interval_s, i) for i in range(members)]
    heapq.heapify(due)
    t, entries, counted_from = 0.0, 0, 2 * interval_s + 2.0
    while t < counted_from + seconds:
        t += DIGEST_PERIOD_S
        while due[0][0] <= t:
            when, i = heapq.heappop(due)
            member = fleet[i]
            member.seq += 1
            member.running = max(0, member.running + rng.choice((-2, -1, 0, 0, 1, 2)))
            member.kv = min(1.0, max(0.0, member.kv + rng.uniform(-0.01, 0.01)))
            payload = sessions.seal(member.session, encode(Heartbeat(
                member.spec.id, 1, member.seq, MemberState.READY,
                Load(member.running, 0, round(member.kv, 4)))))
            m.heartbeat(msgspec.msgpack.decode(payload, type=Heartbeat), payload, when)
            heapq.heappush(due, (when + interval_s, i))
        digests = m.take_load_digests(t)
        if t >= counted_from:
            entries += sum(map(len, digests.values()))
        m.take_events()
    return entries
