"""One rendered fleet, run: its pods started in order and kept to the counts asked for,
what the run's played actors do (clients, KEDA, an operator), and the connection audit.

The kubelet (kubelet.py) runs pods; this is the rest of the cluster around them: the
scheduler's part (start the StatefulSets' and Deployments' pods, registries first), the
ReplicaSet controller's (`scale`: start pods, or end the newest), Prometheus' pod
discovery (stand_ins.write_pod_targets after every change), and readiness.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from deploy_policy import Pod as PolicyPod
from kubelet import Kubelet, Pod, traced
from netaudit import Audit, Peer, audit, connections_in
from stand_ins import stand_ins, write_pod_targets

__all__ = ["Fleet", "LoadDriver", "log"]

OPERATORS = Peer("operator (pdreg-operators)", PolicyPod("pdreg-operators", {"app": "pdreg-cli"}))
KEDA = Peer("keda-operator (keda)", PolicyPod("keda", {"app": "keda-operator"}))
CLIENT = Peer("client (outside)", PolicyPod("ingress", {"app": "load-balancer"}))
PROMPT = "Tell me about disaggregated serving. " * 7  # ~270 prompt tokens with the salt
MAX_TOKENS = 24
ORDER = ("pdreg-etcd", "pdreg-registry", "pdreg-prometheus", "pdreg-router", "pdreg-planner",
         "pdreg-model-download")


def log(message: str) -> None:
    print(f"test-cluster: {message}", flush=True)


class Fleet:
    def __init__(self, docs: list[dict[str, Any]], work: Path, credentials: Path,
                 secrets: dict[str, dict[str, bytes]], *, scrape_interval_s: float) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.docs = docs
        self.credentials = credentials
        self.targets = work / "prometheus-pods.json"
        write_pod_targets(self.targets, [], {})
        self.kubelet = Kubelet(docs, work, secrets, stand_ins(self.targets, scrape_interval_s))
        self.policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        self.annotations = {name: w["spec"]["template"]["metadata"].get("annotations", {})
                            for name, w in self.kubelet.workloads.items()}
        self.played: list[tuple[Peer, str, int]] = []  # connections the played actors made
        self.operator_traces: list[Path] = []
        self.api_key = secrets["pdreg-tokens"]["api-key"].decode()
        self._stopped = False

    # --- pods ----------------------------------------------------------------------

    def start_all(self, timeout_s: float) -> None:
        """Every workload at its rendered count (1 where KEDA owns it, as a new
        Deployment without replicas starts), registries first, each wave ready."""
        names = [*ORDER, *sorted(set(self.kubelet.workloads) - set(ORDER))]
        for name in names:
            workload = self.kubelet.workloads.get(name)
            if workload is None:
                continue
            count = int(workload["spec"].get("replicas", 1))
            stateful = workload["kind"] == "StatefulSet"
            pods = (self.kubelet.new_stateful_pods(name, count) if stateful
                    else [self.kubelet.new_pod(name) for _ in range(count)])
            for pod in pods:
                self.kubelet.start(pod)
            if workload["kind"] == "Job":
                self.wait_complete(pods, timeout_s)
                log(f"job {name} completed")
                continue
            self._publish_targets()
            self.wait_ready(pods, timeout_s)
            log(f"started {name}: {', '.join(f'{p.name} at {p.ip}' for p in pods)}")

    def wait_complete(self, pods: list[Pod], timeout_s: float) -> None:
        """A Job's pods: every container exits 0; the pods are then done."""
        for pod in pods:
            for container in pod.containers:
                assert container.proc is not None
                code = container.proc.wait(timeout_s)
                if code != 0:
                    raise SystemExit(f"test-cluster: job {pod.name}/{container.name} "
                                     f"failed ({code}): {container.log.read_text()[-2000:]}")
            pod.terminating_since = time.monotonic()  # completed: not a live pod

    def wait_ready(self, pods: list[Pod], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = [(p, c) for p in pods for c in p.containers if c.ready_url]
        while pending:
            self.check_alive()
            pending = [(p, c) for p, c in pending if not _answers(c.ready_url or "")]
            if time.monotonic() > deadline:
                raise SystemExit(f"test-cluster: not ready after {timeout_s:.0f} s: "
                                 f"{[(p.name, c.name) for p, c in pending]}")
            time.sleep(0.3)

    def scale(self, workload: str, count: int) -> None:
        live = sorted(self.kubelet.live(workload), key=lambda p: list(self.kubelet.pods).index(
            p.name))
        for _ in range(count - len(live)):
            pod = self.kubelet.new_pod(workload)
            self.kubelet.start(pod)
            log(f"kubelet: started {pod.name} at {pod.ip}")
        for pod in reversed(live[count:]):  # the newest go first
            self.kubelet.terminate(pod, time.monotonic())
            log(f"kubelet: terminating {pod.name} (preStop, then SIGTERM)")
        self._publish_targets()

    def terminating(self, workload: str) -> bool:
        return any(p.workload == workload and p.terminating_since is not None and p.running()
                   for p in self.kubelet.pods.values())

    def tick_for(self, seconds: float) -> None:
        """Let SECONDS pass, advancing terminating pods and watching the others."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.check_alive()
            for pod in self.kubelet.pods.values():
                if (pod.terminating_since is not None and pod.running()
                        and self.kubelet.reap(pod, time.monotonic())):
                    log(f"kubelet: {pod.name} gone")
                    self._publish_targets()
            time.sleep(0.2)

    def check_alive(self) -> None:
        for pod in self.kubelet.live():
            for container in pod.containers:
                if container.proc is not None and container.proc.poll() is not None:
                    tail = container.log.read_text(errors="replace")[-3000:]
                    raise SystemExit(f"test-cluster: {pod.name}/{container.name} exited "
                                     f"({container.proc.returncode}):\n{tail}")

    def _publish_targets(self) -> None:
        pods = [p for p in self.kubelet.pods.values()
                if p.terminating_since is None or p.running()]
        write_pod_targets(self.targets, pods, self.annotations)

    def stop_all(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        now = time.monotonic()
        pods = [p for p in self.kubelet.pods.values() if p.running()]
        for pod in pods:
            if pod.terminating_since is None:
                pod.grace_s = min(pod.grace_s, 10.0)  # the run is over: no long drains
                self.kubelet.terminate(pod, now)
        while any(not self.kubelet.reap(p, time.monotonic()) for p in pods):
            time.sleep(0.2)

    # --- what the run reads ----------------------------------------------------------

    def registries(self) -> list[Pod]:
        return self.kubelet.live("pdreg-registry")

    def members(self, registry: Pod) -> list[dict[str, Any]]:
        response = httpx.get(f"http://{registry.ip}:{registry.ports['http']}/v1/members",
                             timeout=5.0)
        response.raise_for_status()
        return list(response.json())

    def ready_members(self, workload: str) -> int:
        """Members ready in every registry whose address is a live pod of WORKLOAD."""
        addresses = {p.ip for p in self.kubelet.live(workload)}
        counts = []
        for registry in self.registries():
            counts.append(sum(1 for m in self.members(registry) if m["state"] == "ready"
                              and _host(m["endpoints"]["http"]) in addresses))
        return min(counts, default=0)

    def prometheus_query(self, server: str, promql: str, at: float | None = None
                         ) -> float | None:
        """KEDA's query, at the ScaledObject's serverAddress (cluster DNS); OSError when
        nothing answers there."""
        url = self.kubelet.dns(server)
        host, port = url.split("//", 1)[1].split("/")[0].rsplit(":", 1)
        if self.kubelet.by_ip(host) is not None:
            self.played.append((KEDA, host, int(port)))
        params = {"query": promql, **({} if at is None else {"time": f"{at:.3f}"})}
        try:
            body = httpx.get(f"{url}/api/v1/query", params=params, timeout=5.0).json()
        except httpx.HTTPError as exc:
            raise OSError(f"{type(exc).__name__}: {exc}") from None
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def prometheus_pod(self) -> Pod | None:
        return next(iter(self.kubelet.live("pdreg-prometheus")), None)

    def wait_targets_up(self, timeout_s: float) -> int:
        """Prometheus scrapes every pod annotated for it, each target up."""
        deadline = time.monotonic() + timeout_s
        while True:
            prometheus = self.prometheus_pod()
            assert prometheus is not None, "no Prometheus pod"
            wanted = {p.name for p in self.kubelet.live()
                      if self.annotations[p.workload].get("prometheus.io/scrape") == "true"}
            targets = httpx.get(f"http://{prometheus.ip}:{prometheus.ports['http']}"
                                "/api/v1/targets", timeout=5.0).json()["data"]["activeTargets"]
            up = {t["labels"].get("pod") for t in targets if t["health"] == "up"}
            if wanted <= up:
                return len(wanted)
            if time.monotonic() > deadline:
                raise SystemExit(f"test-cluster: Prometheus targets not up: "
                                 f"{sorted(wanted - up)}")
            self.tick_for(0.5)

    def router_urls(self) -> list[str]:
        return [f"http://{p.ip}:{p.ports['http']}" for p in self.kubelet.live("pdreg-router")]

    def complete(self, router: Pod) -> str:
        deadline = time.monotonic() + 60
        while True:
            response = httpx.post(f"http://{router.ip}:{router.ports['http']}/v1/completions",
                                  json=_body(self.model()), timeout=30.0,
                                  headers={"authorization": f"Bearer {self.api_key}"})
            self.played.append((CLIENT, router.ip, router.ports["http"]))
            if response.status_code == 200:
                return str(response.json()["choices"][0]["text"])
            if time.monotonic() > deadline:
                raise SystemExit(f"test-cluster: {router.name}: {response.status_code} "
                                 f"{response.text[:300]}")
            time.sleep(0.5)

    def model(self) -> str:
        for workload in self.kubelet.workloads.values():
            for container in workload["spec"]["template"]["spec"]["containers"]:
                args = [str(a) for a in container.get("args", [])]
                if "--served-model-name" in args:
                    return args[args.index("--served-model-name") + 1]
        raise SystemExit("test-cluster: no engine names its model")

    # --- the operator --------------------------------------------------------------

    def operator(self, *args: str) -> str:
        """`pdreg ARGS` as an operator runs it from the operators' namespace: the client
        registries' HTTP sides named (no control port: admin and status go over HTTP
        alone, which is all the NetworkPolicy opens to the operators' namespace)."""
        trace = self.kubelet.work / "logs" / f"operator-{len(self.operator_traces)}.strace"
        self.operator_traces.append(trace)
        registries = ",".join(f"http://{p.ip}:{p.ports['http']}" for p in self.registries())
        env = {"PDREG_REGISTRY": registries}
        result = subprocess.run(traced([sys.executable, "-m", "pdreg", *args], trace),
                                capture_output=True, text=True, timeout=60,
                                env=_env_with(env))
        if result.returncode != 0:
            raise SystemExit(f"test-cluster: `pdreg {' '.join(args)}` as an operator: "
                             f"{result.returncode}\n{result.stdout}{result.stderr}")
        return result.stdout

    def admin_status_and_drain(self) -> None:
        members = json.loads(self.operator("status", "--json", "--token-file",
                                           str(self.credentials / "token")))
        decode = next(m for m in members if m["role"] == "decode")
        log(f"operator: pdreg status lists {len(members)} members")
        self.operator("drain", decode["id"], "--admin-token-file",
                      str(self.credentials / "admin-token"))
        for registry in self.registries():
            states = {m["id"]: m["state"] for m in self.members(registry)}
            assert states.get(decode["id"]) == "draining", (registry.name, states)
        log(f"operator: pdreg drain {decode['id']}: draining in both registries")

    def cordon_survives_the_registries(self, timeout_s: float) -> None:
        """A cordon is written to etcd, never carried by its member: both registries
        apply it, and still hold it after both crash at once and start again empty."""
        admin = ("--admin-token-file", str(self.credentials / "admin-token"))
        prefill = next(m["id"] for m in self.members(self.registries()[0])
                       if m["role"] == "prefill")
        self.operator("cordon", prefill, *admin)
        self.wait_cordoned(prefill, timeout_s)
        for registry in self.registries():
            self.kubelet.crash_and_restart(registry)
        log(f"operator: pdreg cordon {prefill}; both registries killed -9 and restarted")
        self.wait_ready(self.registries(), timeout_s)
        self.wait_cordoned(prefill, timeout_s)
        replicas = {r["id"] for r in httpx.get(
            f"http://{self.registries()[0].ip}:{self.registries()[0].ports['http']}"
            "/v1/registries", timeout=5.0).json()}
        assert replicas == {p.name for p in self.registries()}, replicas
        log(f"operator: {prefill} re-registered cordoned in both registries (from etcd); "
            f"the replica set in etcd: {sorted(replicas)}")
        self.operator("uncordon", prefill, *admin)

    def wait_cordoned(self, member_id: str, timeout_s: float) -> None:
        """MEMBER_ID registered and cordoned in every registry, within TIMEOUT_S."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = [{m["id"]: m["cordoned"] for m in self.members(r)}.get(member_id)
                    for r in self.registries()]
            if all(held):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"test-cluster: {member_id} not cordoned in every "
                                 f"registry after {timeout_s:.0f} s: {held}")
            self.tick_for(0.3)

    # --- the audit -----------------------------------------------------------------

    def audit(self) -> Audit:
        made: list[tuple[Peer, str, int]] = list(self.played)
        for pod in self.kubelet.pods.values():
            source = self._peer(pod)
            for container in pod.containers:
                for trace in (container.trace, container.trace.with_suffix(".prestop.strace"),
                              *container.past_traces):
                    if trace.exists():
                        made += [(source, a, p) for a, p in connections_in(trace)]
        for trace in self.operator_traces:
            made += [(OPERATORS, a, p) for a, p in connections_in(trace)]

        def peer_at(address: str) -> Peer | None:
            pod = self.kubelet.by_ip(address)
            return None if pod is None else self._peer(pod)
        return audit(self.policies, made, peer_at)

    def audit_or_fail(self, label: str) -> None:
        result = self.audit()
        log(f"connections of the {label} run against its NetworkPolicies:\n{result.report()}")
        if not result.ok:
            raise SystemExit(f"test-cluster: {label}: connections the NetworkPolicies would "
                             "drop (DENIED), or outside the pod network (OUTSIDE), above")

    def _peer(self, pod: Pod) -> Peer:
        return Peer(pod.workload, PolicyPod(pod.namespace, pod.labels, pod.ports), pod.ip)


class LoadDriver:
    """Closed-loop clients (each sends its next completion when the last is answered)
    through the routers, on an event loop of their own in a thread: the pressure that
    must make the fleet scale. A 429 or 503 that says `Retry-After` is the router's
    admission doing its job, counted apart (`refused`); one without it is a failure.
    A real client waits `Retry-After`; these send their next request at once, since
    keeping the fleet past its capacity is what they are for."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.answered: Counter[int] = Counter()
        self.refused: Counter[int] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    @property
    def failed(self) -> int:
        return sum(n for status, n in self.answered.items() if status != 200) + len(self.errors)

    def summary(self) -> str:
        seconds = max(time.monotonic() - self._started, 1e-9)
        ok = self.answered[200]
        refused = ", ".join(f"{n} {status}" for status, n in sorted(self.refused.items()))
        return (f"{ok} answered 200 ({ok / seconds:.1f}/s), {self.failed} failed"
                + (f", refused with Retry-After: {refused}" if refused else ""))

    def start(self, clients: int) -> None:
        self._started = time.monotonic()
        urls, model, key = self.fleet.router_urls(), self.fleet.model(), self.fleet.api_key
        for url in urls:
            host, port = url.split("//")[1].rsplit(":", 1)
            self.fleet.played.append((CLIENT, host, int(port)))
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(clients, urls,
                                                                           model, key),),
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    async def _run(self, clients: int, urls: list[str], model: str, key: str) -> None:
        headers = {"authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=60.0, limits=limits, headers=headers) as client:
            await asyncio.gather(*(self._client(client, urls[i % len(urls)], model)
                                   for i in range(clients)))

    async def _client(self, client: httpx.AsyncClient, url: str, model: str) -> None:
        while not self._stop.is_set():
            try:
                response = await client.post(f"{url}/v1/completions", json=_body(model))
                retry_after = response.headers.get("retry-after")
                if response.status_code in (429, 503) and retry_after is not None:
                    self.refused[response.status_code] += 1
                    continue
                self.answered[response.status_code] += 1
            except httpx.HTTPError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")


def _body(model: str) -> dict[str, Any]:
    """A prompt of its own (a random first line): the engines' prefix caches would
    otherwise serve every prefill but the first."""
    return {"model": model, "prompt": f"{secrets.token_hex(4)}\n{PROMPT}",
            "max_tokens": MAX_TOKENS}


def _host(url: str) -> str:
    return url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _env_with(env: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PDREG_")}, **env}
