"""Real-engine check: one prefill and two decodes (`vllm serve`, NixlConnector on CPU),
each under `pdreg agent`, against a real `pdreg registry`, behind `pdreg router`, with
security on: CURVE keys for every registry client (an allow-list on the registry), the
fleet and admin tokens, and a router API key (security.py). Run by `make test-vllm`
after setup.sh.

    .venv/bin/python tests/vllm/check_vllm_sidecar.py [--vllm-venv .venv-vllm]
        [--model-dir .cache/vllm-tiny-model]

Asserts, in this order:
1. all three members READY with the right role, model, protocol and NIXL side channel,
   registered over CURVE with the fleet token; in each vLLM, NIXL's progress thread
   polls every 10 ms and the model thread stays where VLLM_CPU_OMP_THREADS_BIND put it
   (nixl_cpu/: else three engines busy-poll and all compute on the last core); idle CPU
   printed;
2. load figures that move while completions run;
3. a generation cut after k tokens and continued from token ids on a new P/D pair is
   exact, for completions and chat (continuation_checks.py);
4. `pdreg router` (registered as an api_server member) refuses a client without the API
   key, and serves the model with output token-identical to a single vLLM instance while
   the KV travels from P to D (routing_checks.py); `pdreg status` with its own CURVE key
   lists every member, and with a key the registry does not allow gets nothing;
5. a decode killed with kill -9 while it streams: every client stream still completes,
   identical to a single instance (migration_checks.py); the dead decode leaves the
   registry;
6. SIGTERM on the surviving decode's sidecar drains it (DRAINING while requests run),
   it leaves /v1/members and its vLLM processes exit.
Every process it starts carries a marker in its environment, and all of them are killed
at the end, pass or fail. On failure it names the step that failed, prints the tail of
every log and keeps the logs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import continuation_checks  # tests/vllm/, beside this script
import httpx
import migration_checks
import routing_checks
import security
from busy import BusyClients
from cluster import (
    MODEL_NAME,
    NIXL_CPU_MARKERS,
    PDREG,
    REPO,
    SIDECAR_EXIT_TIMEOUT_S,
    Engine,
    Proc,
    Registry,
    Router,
    Steps,
    cpu_seconds,
    run_check,
    say,
    wait_logged,
)

from pdreg.testing import LowPorts

STARTUP_TIMEOUT_S = 360.0  # vLLM takes ~50-85 s to become healthy here; three at once
STEP_TIMEOUT_S = 60.0
ROUTER_STARTUP_TIMEOUT_S = 60.0
IDLE_SAMPLE_S = 5.0
DRAIN_CLIENTS = 6
ROUTER_MAX_ATTEMPTS = 3  # pairs the router tries per request (its --max-attempts)
ROUTER_MAX_MIGRATIONS = 2
ROUTER_DRAIN_DELAY_S = 0.5  # nothing balances across routers here: stop soon on SIGTERM
HEARTBEAT_INTERVAL_S = 0.5
LEASE_S = 5.0
# VLLM_CPU_OMP_THREADS_BIND for every engine. "nobind": the OS places the three model
# threads on the two cores; pinned (0, 1, 0), the decode sharing the prefill's core
# pulled its KV only after NIXL's 30 s lease ran out, every time.
VLLM_OMP_BIND = "nobind"
STATUS_TIMEOUT_S = 30.0
SECURITY_LINE = "security: CURVE, token, admin token"  # what `pdreg registry` prints
# A client with a key pair of its own that the registry's allow-list does not name.
STRANGER = "stranger"
LONG_COMPLETION = {"model": MODEL_NAME, "prompt": "The registry keeps", "max_tokens": 480,
                   "ignore_eos": True, "temperature": 0.0}
SHORT_COMPLETION = {**LONG_COMPLETION, "max_tokens": 96}


class Cluster:
    """Everything this check starts, by name, in one place for teardown."""

    def __init__(self, workdir: Path) -> None:
        def proc(name: str) -> Proc:
            return Proc(name, workdir / f"{name}.log", uuid.uuid4().hex)

        port = LowPorts()  # distinct: a KV replay port once equalled an engine's HTTP port
        self.registry = Registry(port(), port(), port(),
                                 proc("registry"))
        # Three engines on two cores: not pinned, the OS places them (VLLM_OMP_BIND).
        self.prefill = Engine("prefill", "prefill", port(), port(),
                              VLLM_OMP_BIND, proc("prefill"))
        self.decodes = [
            Engine(name, "decode", port(), port(), VLLM_OMP_BIND, proc(name))
            for name in ("decode-1", "decode-2")
        ]
        self.router = Router(port(), proc("router"))
        self.security = security.create(
            workdir / "secrets", [*(e.name for e in self.engines), "router", "status"],
            [STRANGER])
        self.router.api_key = self.security.api_key
        self._stopped = False

    @property
    def engines(self) -> list[Engine]:
        return [self.prefill, *self.decodes]

    def stop(self) -> None:
        """Stop every process started, pass or fail. Safe twice."""
        if self._stopped:
            return
        self._stopped = True
        say("stopping router, decodes, prefill, registry")
        self.router.proc.stop()
        for engine in [*self.decodes, self.prefill]:
            engine.proc.stop(SIDECAR_EXIT_TIMEOUT_S)
        self.registry.proc.stop()


def start_engines(steps: Steps, cluster: Cluster, vllm_venv: Path, model_dir: Path) -> None:
    steps.begin("start registry, prefill and two decodes (vLLM under pdreg agent), "
                "wait for READY")
    registry, secured = cluster.registry, cluster.security
    registry.start(HEARTBEAT_INTERVAL_S, LEASE_S, secured.registry_args())
    wait_logged("registry answers", registry.answers, STEP_TIMEOUT_S)
    wait_logged(f"registry says '{SECURITY_LINE}'",
                lambda: SECURITY_LINE in registry.proc.log_text(), STEP_TIMEOUT_S)
    for engine in cluster.engines:
        engine.start(registry.address, vllm_venv, model_dir, secured.member_args(engine.name))

    def states() -> str:
        view = registry.members()
        return ", ".join(f"{e.name}={view.get(e.member_id, {}).get('state', 'absent')}"
                         for e in cluster.engines)

    def all_ready() -> bool:
        for engine in cluster.engines:
            engine.proc.assert_alive()
        view = registry.members()
        return all(view.get(e.member_id, {}).get("state") == "ready" for e in cluster.engines)

    wait_logged("all three members READY", all_ready, STARTUP_TIMEOUT_S, states)

    steps.begin("NIXL on CPU: progress thread polls every 10 ms, model thread not re-pinned "
                "to the last core; idle CPU")
    for engine in cluster.engines:
        for marker in NIXL_CPU_MARKERS:
            assert marker in engine.proc.log_text(), (
                f"{engine.name}: no '{marker}' line in {engine.proc.log_path}: the nixl_cpu "
                f"fixes did not load (NIXL busy-polls a core; every engine computes on the "
                f"last core)")
        cores = engine.worker_cores()
        assert cores == engine.bound_cores, (
            f"{engine.name}: vLLM's model thread may run on cores {cores}, not "
            f"{engine.bound_cores} as VLLM_CPU_OMP_THREADS_BIND={engine.omp_bind} says")
    say("ok: model threads on cores " + ", ".join(
        f"{e.name} {e.worker_cores()}" for e in cluster.engines))
    pids = {engine.name: engine.engine_pids() for engine in cluster.engines}
    before = {name: cpu_seconds(p) for name, p in pids.items()}
    time.sleep(IDLE_SAMPLE_S)  # a measurement window, not a wait for a condition
    idle = {name: (cpu_seconds(p) - before[name]) / IDLE_SAMPLE_S for name, p in pids.items()}
    say("ok: idle CPU per engine (share of a core, all its vLLM processes): "
        + ", ".join(f"{name} {share:.0%}" for name, share in idle.items()))


def check_registration(steps: Steps, cluster: Cluster) -> None:
    steps.begin("registration: role, model, protocol, endpoints, labels")
    view = cluster.registry.members()
    for engine in cluster.engines:
        m = view[engine.member_id]
        say(f"{engine.name}: " + json.dumps({k: m[k] for k in (
            "role", "model", "state", "protocol", "endpoints", "load")}))
        assert m["role"] == engine.role, m
        assert m["model"] == MODEL_NAME, m
        assert m["protocol"] == "vllm-nixl", m
        assert m["endpoints"]["http"] == engine.url, m
        assert m["endpoints"]["kv_host"] == "127.0.0.1", m
        assert m["endpoints"]["kv_port"] == engine.side_channel_port, m
        assert m["labels"] == {"test": "vllm"}, m


def load_of(cluster: Cluster, engine: Engine) -> dict[str, Any]:
    return cluster.registry.members().get(engine.member_id, {}).get(
        "load", {"running": 0, "waiting": 0})


def check_load(steps: Steps, cluster: Cluster) -> None:
    steps.begin("load figures move while completions run")
    prefill, decode = cluster.prefill, cluster.decodes[0]
    clients = [BusyClients(e.url, 4, SHORT_COMPLETION).start() for e in (prefill, decode)]
    seen_busy: set[str] = set()

    def both_seen_busy() -> bool:
        view = cluster.registry.members()
        seen_busy.update(e.name for e in (prefill, decode) if view.get(
            e.member_id, {}).get("load", {}).get("running", 0) > 0)
        return len(seen_busy) == 2

    try:
        wait_logged("prefill and decode report running > 0", both_seen_busy, STEP_TIMEOUT_S,
                    lambda: f"seen busy: {sorted(seen_busy)}, completions done: "
                            f"{sum(len(c.outcomes) for c in clients)}")
    finally:
        for busy in clients:
            busy.join(STEP_TIMEOUT_S)
    failures = [f for busy in clients for f in busy.failures()]
    assert not failures, f"completions failed: {failures}"
    wait_logged("load back to 0", lambda: all(
        load_of(cluster, e)["running"] == 0 for e in (prefill, decode)), STEP_TIMEOUT_S)


def check_routing(steps: Steps, cluster: Cluster) -> None:
    """Requests through `pdreg router` against the same requests served by one instance."""
    registry, router = cluster.registry, cluster.router
    steps.begin("registry shows every engine routable")

    def unroutable() -> dict[str, object]:
        view = registry.members()
        return {e.name: view.get(e.member_id) for e in cluster.engines
                if view.get(e.member_id, {}).get("routable") is not True}
    # Three vLLMs on two cores can delay a heartbeat past two intervals: the member is
    # suspect (unroutable) until the next one, as it should be. All routable at once.
    wait_logged("every engine routable at once", lambda: not unroutable(), STEP_TIMEOUT_S,
                lambda: str(unroutable()))

    steps.begin("start pdreg router")
    router.start(registry.address, ROUTER_MAX_ATTEMPTS,
                 ["--max-migrations", str(ROUTER_MAX_MIGRATIONS),
                  "--drain-delay", str(ROUTER_DRAIN_DELAY_S),
                  *cluster.security.router_args("router")])
    wait_logged("router lists the model in /v1/models", lambda: router.lists(MODEL_NAME),
                ROUTER_STARTUP_TIMEOUT_S)
    wait_logged("router registered as a READY api_server member", lambda: registry.members(
        ).get(router.member_id, {}).get("state") == "ready", STEP_TIMEOUT_S)

    steps.begin("security: the router refuses a client without its API key; pdreg status "
                "needs an allowed CURVE key")
    check_security(cluster)

    steps.begin("router /v1/models through the openai client")
    routing_checks.check_models(router.url, MODEL_NAME, router.api_key)
    say("ok: /v1/models lists the model")

    steps.begin("routed completions and chat = single instance; KV pulled by the decodes")
    decode_urls = [decode.url for decode in cluster.decodes]
    transit = routing_checks.check_routed_outputs(
        router.url, router.api_key, cluster.prefill.url, decode_urls, MODEL_NAME, say)

    steps.begin("router metrics: prefill and decodes picked, no retries")
    routing_checks.check_router_picks(router.url, cluster.prefill.member_id,
                                      [d.member_id for d in cluster.decodes], transit,
                                      ROUTER_MAX_ATTEMPTS)
    say("ok: router picked the prefill and the decodes, retried nothing")


def pdreg_status(cluster: Cluster, client: str,
                 outsider: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PDREG, "status", "--registry", cluster.registry.address, "--json",
         *cluster.security.client_args(client, outsider=outsider)],
        cwd=REPO, capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)


def check_security(cluster: Cluster) -> None:
    router = cluster.router
    body = {"model": MODEL_NAME, "prompt": "no key", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        reply = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers,
                           timeout=30)
        assert reply.status_code == 401, (
            f"router answered {reply.status_code} to a client with headers {headers}: "
            f"{reply.text[:300]}")
    say("ok: the router answers 401 without the API key and with a wrong one")
    listed = pdreg_status(cluster, "status")
    assert listed.returncode == 0, f"pdreg status failed: {listed.stderr[-500:]}"
    ids = {member["id"] for member in json.loads(listed.stdout)}
    expected = {engine.member_id for engine in cluster.engines} | {router.member_id}
    assert expected <= ids, f"pdreg status lists {sorted(ids)}, expected {sorted(expected)}"
    say(f"ok: pdreg status over CURVE lists {len(ids)} members")
    refused = pdreg_status(cluster, STRANGER, outsider=True)
    assert refused.returncode != 0 and not refused.stdout.strip(), (
        f"pdreg status with a key the registry does not allow answered "
        f"{refused.returncode}: {refused.stdout[:300]}")
    say(f"ok: pdreg status with a key not on the allow-list gets nothing "
        f"({refused.stderr.strip().splitlines()[-1][:120] if refused.stderr.strip() else ''})")


def check_kill(steps: Steps, cluster: Cluster) -> Engine:
    steps.begin("kill -9 a decode while it streams: every stream completes, = single "
                "instance")
    victim = migration_checks.check_kill_decode_mid_stream(
        cluster.router, cluster.prefill, cluster.decodes, MODEL_NAME, say)
    steps.begin("the killed decode leaves the registry; the router still serves")
    wait_logged(f"{victim.name} gone from /v1/members (lease {LEASE_S:.0f}s)",
                lambda: victim.member_id not in cluster.registry.members(), STEP_TIMEOUT_S)
    assert victim.proc.process is not None
    victim.proc.process.wait(STEP_TIMEOUT_S)
    wait_logged(f"every process of {victim.name} gone", lambda: not victim.proc.pids(),
                STEP_TIMEOUT_S, lambda: f"left: {victim.proc.pids()}")
    reply = httpx.post(f"{cluster.router.url}/v1/completions", headers=cluster.router.headers,
                       json={"model": MODEL_NAME, "prompt": "after the kill", "max_tokens": 4,
                             "temperature": 0.0, "ignore_eos": True}, timeout=120)
    assert reply.status_code == 200, f"router after the kill: {reply.status_code} {reply.text}"
    say("ok: a new request through the router is served by the survivor")
    return victim


def check_drain(steps: Steps, cluster: Cluster, decode: Engine) -> None:
    """SIGTERM the decode's sidecar while it serves: DRAINING, then gone, and every request
    it held at SIGTERM answered in full."""
    steps.begin(f"drain {decode.name} with SIGTERM while it serves")
    # Idle first, so that "busy" below is these requests and not a stale report of the
    # routed ones; and busy in the sidecar's own report before SIGTERM, because the
    # sidecar can only wait for requests vLLM's scheduler counts.
    wait_logged(f"{decode.name} reports idle", lambda: load_of(cluster, decode)["running"] == 0,
                STEP_TIMEOUT_S)
    busy = BusyClients(decode.url, DRAIN_CLIENTS, LONG_COMPLETION).start()
    try:
        wait_logged(f"{decode.name} reports running > 0", lambda: load_of(
            cluster, decode)["running"] > 0, STEP_TIMEOUT_S)
    finally:
        busy.stop()  # no new requests; the ones under way are what the drain must wait for
    held = busy.in_flight()
    process = decode.proc.process
    assert process is not None
    process.terminate()
    say(f"sent SIGTERM to {decode.name}'s sidecar with {held} requests under way")
    registry = cluster.registry
    wait_logged(f"{decode.name} DRAINING", lambda: registry.members().get(
        decode.member_id, {}).get("state") == "draining", STEP_TIMEOUT_S)
    wait_logged(f"{decode.name} gone from /v1/members",
                lambda: decode.member_id not in registry.members(), SIDECAR_EXIT_TIMEOUT_S)
    code = process.wait(SIDECAR_EXIT_TIMEOUT_S)
    assert code == 0, f"{decode.name} sidecar exit code {code}"
    wait_logged(f"{decode.name}'s vLLM processes exited",
                lambda: not decode.proc.pids(), STEP_TIMEOUT_S)
    busy.join(STEP_TIMEOUT_S)
    assert held > 0, "no request was under way at SIGTERM: nothing tested the drain"
    assert not busy.failures(), (
        f"requests to {decode.name} ended {busy.failures()}; drain should have let the "
        f"{held} under way at SIGTERM finish")
    say(f"ok: the {held} requests under way at SIGTERM finished "
        f"({len(busy.outcomes)} completions in all, every one ok)")
    assert registry.members()[cluster.prefill.member_id]["state"] == "ready"
    say("prefill still READY")


def check(steps: Steps, cluster: Cluster, vllm_venv: Path, model_dir: Path) -> None:
    start_engines(steps, cluster, vllm_venv, model_dir)
    check_registration(steps, cluster)
    check_load(steps, cluster)
    steps.begin("a generation cut after k tokens, continued from ids on P/D, is exact")
    continuation_checks.check_continuations(cluster.prefill, cluster.decodes, MODEL_NAME,
                                            say)
    check_routing(steps, cluster)
    victim = check_kill(steps, cluster)
    survivor = next(d for d in cluster.decodes if d is not victim)
    check_drain(steps, cluster, survivor)


def main() -> int:
    return run_check(__doc__.splitlines()[0], "pdreg-vllm-", Cluster, check)


if __name__ == "__main__":
    sys.exit(main())
