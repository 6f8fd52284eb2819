"""The demo's story, as data: one `Step(name, title, run)` per act.

    start             registry, router, 2 prefill + 2 decode engines, steady traffic
    scale_up          +1 prefill +1 decode; each gets traffic within 1 s of being ready
    drain_prefill     admin drain; the router stops picking it; SIGTERM once idle
    kill_decode       kill -9 of the decode holding the most streams mid-answer; at least
                      one migrates, no request fails; gone within the lease
    restart_registry  the registry restarts on its ports; membership is whole again
    scale_down        SIGTERM the newest prefill and decode; they drain, say bye, exit 0
"""

from __future__ import annotations

import time
from typing import Final

import httpx

from pdreg.demo.observer import Observer, member
from pdreg.demo.stage import (
    WAIT_TIMEOUT_S,
    Stage,
    Step,
    StepFailed,
    StepResult,
    absent,
    routable,
    state_of,
)
from pdreg.demo.traffic import HeldStreams, TrafficGenerator

__all__ = ["DRAIN_PROPAGATION_S", "LEASE_MARGIN_S", "READY_TO_TRAFFIC_LIMIT_S",
           "REJOIN_LIMIT_S", "STEPS"]

READY_TO_TRAFFIC_LIMIT_S: Final = 1.0  # a new member must be picked this soon after ready
DRAIN_PROPAGATION_S: Final = 1.0  # after the registry says draining, the router stops picking
LEASE_MARGIN_S: Final = 0.5  # detector tick + sampling period, on top of the lease
REJOIN_LIMIT_S: Final = 5.0  # after a registry restart, every member is back within this
QUIET_S: Final = 1.0  # "drained" = no pick for this long and no load reported
# The kill's streams: long enough to be mid-answer when the kill comes (a sim decode
# writes a token every 10 ms: 2 s), short enough not to slow the demo.
HELD_STREAM_TOKENS: Final = 200


def start(stage: Stage, step: StepResult) -> None:
    cluster = stage.cluster
    cluster.start_registry()
    cluster.start_router()
    stage.observer = Observer(cluster.registry_url, cluster.router_url).start()
    ids = cluster.start_engines(["prefill", "prefill", "decode", "decode"])
    stage.wait("every engine routable", lambda m: routable(m, ids))
    stage.traffic = TrafficGenerator(cluster.router_url, model=cluster.config.model,
                                     clients=stage.config.clients,
                                     max_tokens=stage.config.max_tokens).start()
    stage.settle()
    step.measures["startup_s"] = time.monotonic() - step.started
    stage.display.endpoints(stage.endpoints())


def scale_up(stage: Stage, step: StepResult) -> None:
    new_ids = stage.cluster.start_engines(["prefill", "decode"])
    stage.wait("new engines routable", lambda m: routable(m, new_ids))
    observer = stage.watch()
    for member_id in new_ids:
        stage.wait_until(f"{member_id} picked by the router",
                         lambda i=member_id: observer.timeline(i).first_pick_at is not None)
        timeline = observer.timeline(member_id)
        assert timeline.first_pick_at is not None and timeline.routable_at is not None
        delay = max(0.0, timeline.first_pick_at - timeline.routable_at)
        role = member_id.split("-", 1)[0]
        step.measures[f"ready_to_first_request_{role}_s"] = delay
        step.check(f"{member_id} got traffic within {READY_TO_TRAFFIC_LIMIT_S:.0f} s of "
                   "being ready", delay <= READY_TO_TRAFFIC_LIMIT_S, f"{delay:.2f} s")
    stage.settle()
    stage.check_no_failures(step)


def drain_prefill(stage: Stage, step: StepResult) -> None:
    cluster = stage.cluster
    victim = cluster.engine_ids("prefill")[0]
    observer = stage.watch()
    response = httpx.post(f"{cluster.registry_url}/v1/members/{victim}/drain",
                          headers=cluster.admin_headers, timeout=10.0)
    step.check(f"registry accepted drain of {victim}", response.is_success,
               f"HTTP {response.status_code}")
    stage.wait(f"{victim} draining", lambda m: state_of(m, victim) == "draining")
    draining_at = time.monotonic()

    def idle() -> bool:
        timeline = observer.timeline(victim)
        quiet = time.monotonic() - max(timeline.last_pick_at or 0.0, draining_at)
        seen = member(observer.members() or [], victim)
        return quiet >= QUIET_S and seen is not None and not (seen.load.running
                                                              or seen.load.waiting)
    stage.wait_until(f"{victim} idle", idle)
    late = max(0.0, (observer.timeline(victim).last_pick_at or 0.0) - draining_at)
    step.measures["drain_to_last_request_s"] = late
    step.check(f"router stopped picking {victim} within {DRAIN_PROPAGATION_S:.0f} s",
               late <= DRAIN_PROPAGATION_S, f"last pick {late:.2f} s after draining")
    managed = cluster.retire(victim)
    managed.terminate()
    code = managed.wait(cluster.config.drain_timeout_s + 10)
    step.check(f"{victim} exited cleanly", code == 0, f"exit code {code}")
    stage.wait(f"{victim} left the registry", lambda m: absent(m, victim))
    stage.settle()
    stage.check_no_failures(step)


def kill_decode(stage: Stage, step: StepResult) -> None:
    """kill -9 of a decode that is provably mid-answer: more streams than the steady
    clients could put on any one decode are under way (each has its first token), so
    the decode holding the most of them holds at least one of these."""
    cluster = stage.cluster
    observer = stage.watch()
    decodes = cluster.engine_ids("decode")
    held = HeldStreams(cluster.router_url, model=cluster.config.model,
                       count=len(decodes) * stage.config.clients + 1,
                       max_tokens=HELD_STREAM_TOKENS).start()
    if not held.wait_started(WAIT_TIMEOUT_S):
        raise StepFailed(f"{held.count} streams did not all start within "
                         f"{WAIT_TIMEOUT_S:.0f} s")
    observer.sample_now()
    migrations_before = observer.migrations()
    in_flight = observer.in_flight()
    victim = max(decodes, key=lambda d: in_flight.get(d, 0.0))
    managed = cluster.retire(victim)
    kill_at = stage.kill_at = time.monotonic()
    managed.kill()
    lease = cluster.config.lease_s
    stage.wait(f"{victim} expired", lambda m: absent(m, victim))
    gone_at = observer.timeline(victim).gone_at or time.monotonic()
    step.measures["kill_to_gone_s"] = gone_at - kill_at
    step.check(f"{victim} out of the registry within the lease ({lease:.1f} s)",
               gone_at - kill_at <= lease + LEASE_MARGIN_S, f"{gone_at - kill_at:.2f} s")
    reads = held.wait_done(WAIT_TIMEOUT_S)
    stage.settle()
    last_pick = observer.timeline(victim).last_pick_at
    step.measures["kill_to_last_request_s"] = max(0.0, (last_pick or kill_at) - kill_at)
    observer.sample_now()
    migrated = int(observer.migrations() - migrations_before)
    records = stage.records()
    failed = [r.error for r in records if not r.ok and r.finished >= kill_at]
    failed += [r.error or "" for r in reads if r.error is not None]
    in_flight_count = sum(r.in_flight_at(kill_at) for r in records) + len(reads)
    step.measures["in_flight_at_kill_count"] = in_flight_count
    step.measures["migrated_count"] = migrated
    step.measures["failed_count"] = len(failed)
    step.check(f"{victim} held a stream mid-answer when killed",
               in_flight.get(victim, 0.0) >= 1, f"{in_flight.get(victim, 0.0):.0f} open")
    step.check("its streams migrated to another decode", migrated >= 1,
               f"{migrated} migrated")
    step.check("no client request failed", not failed,
               f"{len(failed)} failed of {in_flight_count} in flight, {migrated} migrated: "
               + "; ".join(failed[:3]) if failed else
               f"{in_flight_count} in flight at the kill, {migrated} migrated")


def restart_registry(stage: Stage, step: StepResult) -> None:
    cluster = stage.cluster
    expected = [*cluster.engines]  # member ids that must come back
    stopped_at = time.monotonic()
    cluster.restart_registry()
    restarted_at = time.monotonic()
    step.measures["registry_downtime_s"] = restarted_at - stopped_at
    stage.wait("every engine back and routable", lambda m: routable(m, expected))
    rejoin = time.monotonic() - restarted_at
    step.measures["rejoin_s"] = rejoin
    step.check(f"membership whole again within {REJOIN_LIMIT_S:.0f} s",
               rejoin <= REJOIN_LIMIT_S, f"{rejoin:.2f} s after the restart")
    stage.settle()
    stage.check_no_failures(step)


def scale_down(stage: Stage, step: StepResult) -> None:
    cluster = stage.cluster
    victims = [cluster.engine_ids("prefill")[-1], cluster.engine_ids("decode")[-1]]
    observer = stage.watch()
    stopping = [(victim, cluster.retire(victim)) for victim in victims]
    term_at = time.monotonic()
    for _, managed in stopping:
        managed.terminate()
    for victim, managed in stopping:
        code = managed.wait(cluster.config.drain_timeout_s + 10)
        step.check(f"{victim} drained and exited cleanly", code == 0, f"exit code {code}")
    stage.wait("stopped engines left the registry",
               lambda m: all(absent(m, v) for v in victims))
    for victim in victims:
        gone = (observer.timeline(victim).gone_at or time.monotonic()) - term_at
        step.measures[f"sigterm_to_gone_{victim.split('-', 1)[0]}_s"] = gone
    stage.settle()
    stage.check_no_failures(step)


STEPS: Final = (
    Step("start", "Start a registry, a router and 2 prefill + 2 decode engines", start),
    Step("scale_up", "Scale up to 3 prefill + 3 decode", scale_up),
    Step("drain_prefill", "Drain one prefill (admin API), stop it once idle", drain_prefill),
    Step("kill_decode", "kill -9 one decode mid-answer (its streams migrate)", kill_decode),
    Step("restart_registry", "Restart the registry", restart_registry),
    Step("scale_down", "Scale down: SIGTERM the newest prefill and decode", scale_down),
)
