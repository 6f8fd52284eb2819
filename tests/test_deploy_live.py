"""deploy/ running: the Compose file's own command lines started on loopback (registry,
router, 2 prefill + 2 decode reference engines, sim backend), scraped by a real
Prometheus with the Compose scrape config, and every Grafana panel's query run against it;
the image's HEALTHCHECK asked about each process; and the Kubernetes credential layout
(tokens and CURVE keys mounted where the manifests say) used by a real registry and router.

What changes on the way to loopback, and nothing else: each service name becomes
127.0.0.1 and each fixed port a free one (every engine listens on 8100 in its own
container), and Prometheus scrapes every second instead of every five.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_support import (
    COMPOSE_ENV,
    DEPLOY,
    K8S,
    Processes,
    compose,
    compose_command,
    compose_processes,
    container_argv,
    dashboard_queries,
    env_of,
    env_value,
    flag,
    generate_secrets,
    grafana_to_promql,
    is_pdreg,
    pod_spec,
    render,
    tool,
    workloads_by_name,
)
from etcd_process import EtcdProcess, requires_etcd

from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until
from router.guard import LOOPBACK_ALLOW

WAIT_S = 60.0  # start-up on a shared two-core machine
SCRAPE_INTERVAL_S = 1
RATE_INTERVAL = "30s"  # $__rate_interval: spans the traffic phases below
REQUESTS_PER_PHASE = 8
PORT_FLAGS = ("--port", "--events-port", "--http-port", "--kv-port", "--bootstrap-port",
              "--metrics-port")
HOST_FLAGS = ("--host", "--advertise-host")
HEALTHCHECK = DEPLOY / "healthcheck.py"

# Panels a user looks at first: with the cluster up and traffic sent, each has data.
MUST_HAVE_DATA = {
    "Members by role and state", "Heartbeat age per member", "Heartbeats per second",
    "Membership version", "Self-preservation", "Registry loop lag",
    "Registrations by result", "Requests by outcome", "Time to first token",
    "End-to-end latency", "Picks per member", "Inter-token latency",
    "Running requests", "Waiting requests", "KV cache usage",
}


@dataclass
class Loopback:
    """Where each Compose service's fixed port lands on 127.0.0.1."""

    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def port(self, service: str, port: int) -> int:
        if (service, port) not in self.ports:
            self.ports[(service, port)] = free_low_port(avoid=set(self.ports.values()))
        return self.ports[(service, port)]

    def address(self, service: str, port: int) -> str:
        return f"127.0.0.1:{self.port(service, port)}"

    def argv(self, service: str, argv: list[str]) -> list[str]:
        localized, args = [], iter(argv)
        for arg in args:
            localized.append(arg)
            if arg in PORT_FLAGS:
                localized.append(str(self.port(service, int(next(args)))))
            elif arg in HOST_FLAGS:
                next(args)
                localized.append("127.0.0.1")
            elif arg == "--allow-upstream":  # the pod network's ranges, and loopback's
                localized.append(f"{next(args)},{LOOPBACK_ALLOW}")
        return localized

    def value(self, text: str, services: set[str]) -> str:
        """SERVICE:PORT (PDREG_REGISTRY, scrape targets), or a comma list of them, on
        loopback."""
        if "," in text:
            return ",".join(self.value(part, services) for part in text.split(","))
        host, sep, port = text.rpartition(":")
        if sep and host in services and port.isdigit():
            return self.address(host, int(port))
        return text


def _get(url: str, **params: Any) -> Any:
    response = httpx.get(url, params=params, timeout=10.0)
    response.raise_for_status()
    return response.json()


@dataclass
class ComposeCluster:
    loopback: Loopback
    prometheus: str  # http://127.0.0.1:PORT
    processes: Processes

    @property
    def pids(self) -> dict[str, int]:
        """Compose service -> its pdreg process."""
        return {name: proc.pid for name, proc in self.processes.running.items()
                if name != "prometheus"}

    @property
    def router(self) -> str:
        return f"http://{self.loopback.address('router', 8000)}"

    @property
    def router_metrics(self) -> str:
        """The router's --metrics-port (its /metrics is not on the API port)."""
        return f"http://{self.loopback.address('router', 9100)}"

    @property
    def registry_http(self) -> str:
        return f"http://{self.loopback.address('registry', 7680)}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        body = _get(f"{self.prometheus}/api/v1/query", query=promql)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, promql: str) -> float:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else math.nan


def _start_compose_services(processes: Processes, loopback: Loopback) -> None:
    """Registry first (the others wait for it, as depends_on says), then the rest."""
    services = compose()["services"]
    pdreg = compose_processes()
    names = set(services)
    order = ["registry", *sorted(set(pdreg) - {"registry"})]
    for name in order:
        argv = loopback.argv(name, compose_command(services[name]))
        env = {key: loopback.value(str(value), names)
               for key, value in services[name]["environment"].items()}
        processes.start(name, argv, env)
        if name == "registry":
            healthz = f"http://{loopback.address('registry', 7680)}/healthz"
            assert wait_until(lambda url=healthz: processes.check_alive() or _answers(url),
                              WAIT_S), "registry not up"


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _prometheus_config(loopback: Loopback, names: set[str], path: Path) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = f"{SCRAPE_INTERVAL_S}s"
    config["global"]["evaluation_interval"] = f"{SCRAPE_INTERVAL_S}s"
    for job in config["scrape_configs"]:
        for group in job.get("static_configs", []):
            group["targets"] = [loopback.value(t, names) for t in group["targets"]]
    path.write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeCluster]:
    prometheus_bin = tool("prometheus")
    work = tmp_path_factory.mktemp("compose")
    processes = Processes(work)
    loopback = Loopback()
    names = set(compose()["services"])
    prometheus_port = free_low_port()
    try:
        _start_compose_services(processes, loopback)
        config = work / "prometheus.yml"
        _prometheus_config(loopback, names, config)
        log = (work / "prometheus.log").open("wb")
        prometheus = subprocess.Popen(
            [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        log.close()
        processes.running["prometheus"] = prometheus
        url = f"http://127.0.0.1:{prometheus_port}"
        assert wait_until(lambda: _answers(f"{url}/-/ready"), WAIT_S), "prometheus not ready"
        yield ComposeCluster(loopback, url, processes)
    finally:
        processes.stop()


def _all_targets_up(cluster: ComposeCluster) -> bool:
    cluster.processes.check_alive()
    targets = _get(f"{cluster.prometheus}/api/v1/targets")["data"]["activeTargets"]
    return len(targets) == len(compose_processes()) and all(
        t["health"] == "up" for t in targets)


def _members_ready(cluster: ComposeCluster) -> bool:
    cluster.processes.check_alive()
    members = _get(f"{cluster.registry_http}/v1/members")
    return sum(m["state"] == "ready" for m in members) == len(compose_processes()) - 1


def _complete(cluster: ComposeCluster, stream: bool) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "stream": stream}
    headers = {"authorization": f"Bearer {COMPOSE_ENV['PDREG_API_KEY']}"}
    with httpx.stream("POST", f"{cluster.router}/v1/completions", json=body, headers=headers,
                      timeout=30.0) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    assert ("data: [DONE]" in text) if stream else json.loads(text)["choices"]


def _scraped_total(cluster: ComposeCluster, metric: str) -> float:
    """sum(metric) as Prometheus has it (0 before the series first appears)."""
    result = cluster.query(f"sum({metric})")
    return float(result[0]["value"][1]) if result else 0.0


def _ttft_count(cluster: ComposeCluster) -> float:
    return _scraped_total(cluster, "pdreg_router_ttft_seconds_count")


def _phase_across_a_scrape(cluster: ComposeCluster, stream: bool) -> None:
    """REQUESTS_PER_PHASE requests in two halves with a scrape between them: rate() needs
    an increase between two scrapes, and a histogram that appears with a burst fast
    enough to fall between two scrapes would show none."""
    count = _itl_count if stream else _ttft_count
    seen = count(cluster)
    half = REQUESTS_PER_PHASE // 2
    for _ in range(half):
        _complete(cluster, stream)
    assert wait_until(lambda: count(cluster) > seen, WAIT_S, poll_s=0.5)
    seen = count(cluster)
    for _ in range(REQUESTS_PER_PHASE - half):
        _complete(cluster, stream)
    assert wait_until(lambda: count(cluster) > seen, WAIT_S, poll_s=0.5)


def _itl_count(cluster: ComposeCluster) -> float:
    return _scraped_total(cluster, "pdreg_router_itl_seconds_count")


def _router_ttft_count(cluster: ComposeCluster) -> float:
    text = httpx.get(f"{cluster.router_metrics}/metrics", timeout=10.0).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdreg_router_ttft_seconds_count"))


def test_prometheus_scrapes_every_compose_process(cluster: ComposeCluster) -> None:
    assert wait_until(lambda: _all_targets_up(cluster), WAIT_S, poll_s=0.5), \
        _get(f"{cluster.prometheus}/api/v1/targets")["data"]["activeTargets"]
    assert wait_until(lambda: _members_ready(cluster), WAIT_S, poll_s=0.5), \
        _get(f"{cluster.registry_http}/v1/members")


def test_every_panel_query_runs_and_the_panels_people_read_have_data(
        cluster: ComposeCluster) -> None:
    assert wait_until(lambda: _members_ready(cluster), WAIT_S, poll_s=0.5)
    ttft_panel = next(q for q in dashboard_queries() if q.panel == "Time to first token")
    ttft = grafana_to_promql(ttft_panel.expr, RATE_INTERVAL)

    # Non-streaming traffic only: the TTFT panel must show it.
    _phase_across_a_scrape(cluster, stream=False)
    assert _router_ttft_count(cluster) == REQUESTS_PER_PHASE, \
        "the router observes TTFT for non-streaming requests"
    assert wait_until(lambda: _ttft_count(cluster) == REQUESTS_PER_PHASE, WAIT_S, poll_s=0.5)
    assert math.isfinite(cluster.scalar(ttft)), "TTFT panel empty for non-streaming traffic"

    # Then streaming traffic: every stream adds its own TTFT and inter-token gaps.
    _phase_across_a_scrape(cluster, stream=True)
    assert wait_until(lambda: _ttft_count(cluster) == 2 * REQUESTS_PER_PHASE, WAIT_S,
                      poll_s=0.5)
    assert math.isfinite(cluster.scalar(ttft)), "TTFT panel empty for streaming traffic"

    empty = []
    for query in dashboard_queries():
        result = cluster.query(grafana_to_promql(query.expr, RATE_INTERVAL))
        values = [float(series["value"][1]) for series in result]
        if query.panel in MUST_HAVE_DATA and not any(math.isfinite(v) for v in values):
            empty.append(f"{query.panel} [{query.ref}]: {query.expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)

    # What those panels say: the whole fleet, one line per engine for each engine's names.
    members = {(s["metric"]["role"], s["metric"]["state"]): float(s["value"][1]) for s in
               cluster.query('sum by (role, state) (pdreg_members{model=~".*"})')}
    assert members[("prefill", "ready")] == 2 and members[("decode", "ready")] == 2
    engines = {cluster.loopback.address(name, 8100) for name, process
               in compose_processes().items() if process.kind == "engine"}
    for name in ("vllm:num_requests_running", "sglang:num_running_reqs",
                 "vllm:kv_cache_usage_perc", "sglang:token_usage"):
        instances = {s["metric"]["instance"] for s in cluster.query(name)}
        assert instances == engines, name
    models = _get(f"{cluster.prometheus}/api/v1/label/model/values",
                  **{"match[]": "pdreg_members"})["data"]
    assert "tiny" in models  # the dashboard's $model variable


def test_image_healthcheck_passes_for_every_compose_process(cluster: ComposeCluster) -> None:
    assert wait_until(lambda: _members_ready(cluster), WAIT_S, poll_s=0.5)
    for name, pid in cluster.pids.items():
        result = subprocess.run([sys.executable, str(HEALTHCHECK), str(pid)],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{name}: {result.stdout}"


def test_image_healthcheck_fails_when_the_endpoint_does_not_answer() -> None:
    port = free_low_port()
    # A process whose command line says `pdreg router --port PORT`, with nothing there.
    impostor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                 "pdreg", "router", "--port", str(port)],
                                preexec_fn=die_with_parent)
    try:
        result = subprocess.run([sys.executable, str(HEALTHCHECK), str(impostor.pid)],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 1
        assert f"http://127.0.0.1:{port}/health" in result.stdout
    finally:
        stop_process(impostor, 5.0)


# --- the Kubernetes credential layout, used for real -------------------------------------


def _pdreg_container(overlay: str, deployment: str) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = pod_spec(workloads_by_name(render(K8S / overlay))[deployment])
    [container] = [c for c in pod["containers"] if is_pdreg(c)]
    return pod, container


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet sets it (ConfigMap keys resolved)."""
    docs = render(K8S / "vllm")
    return {name: env_value(docs, container, name) for name, value in env_of(container).items()
            if isinstance(value, str) or "configMapKeyRef" in value}


def _local_paths(pod: dict[str, Any], container: dict[str, Any],
                 secrets: Mapping[str, Mapping[str, bytes]], work: Path) -> dict[str, str]:
    """Each Secret directory the container mounts, built locally from the rendered
    Secrets with the items the manifest mounts (every key where it names none):
    container path -> local path."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mapping = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if not secret:
            continue
        local = work / container["name"] / mount["name"]
        local.mkdir(parents=True)
        data = secrets[secret["secretName"]]
        for item in secret.get("items") or [{"key": k, "path": k} for k in data]:
            (local / item["path"]).write_bytes(data[item["key"]])
        mapping[mount["mountPath"]] = str(local)
    return mapping


def _expanded(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' $(VAR) in ARGV (the router's $(POD_CIDRS), $(POD_IP))."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in argv]


def _swap_paths(value: str, mapping: Mapping[str, str]) -> str:
    for inside, outside in mapping.items():
        if value == inside or value.startswith(inside + "/"):
            return outside + value[len(inside):]
    return value


@requires_etcd
def test_kubernetes_credentials_work_as_mounted(tmp_path: Path) -> None:
    """The registries' and the router's command lines from the rendered overlay (both
    registry pods of the StatefulSet, each under its stable name, on one etcd in place
    of the manifests' three members), and engines configured as the sidecars are, each
    given only the Secret files its manifest mounts and the one PDREG_REGISTRY value:
    the engines register over CURVE with the fleet token at both registries, the router
    serves clients that hold the API key and no others, and the replica set in etcd
    lists both registries by their pod names."""
    files, secrets = generate_secrets(tmp_path / "generated")
    loopback = Loopback()
    processes = Processes(tmp_path)
    registries = workloads_by_name(render(K8S / "vllm"))["pdreg-registry"]
    names = {f"pdreg-registry-{i}.pdreg-registry" for i in range(registries["spec"]["replicas"])}
    etcd = EtcdProcess(tmp_path / "etcd").start()
    try:
        for name in (*sorted(names), "pdreg-router"):
            pod, container = _pdreg_container(
                "vllm", "pdreg-registry" if name in names else name)
            mapping = _local_paths(pod, container, secrets, tmp_path / name)
            argv = [_swap_paths(a, mapping) for a in loopback.argv(
                name, _expanded(container_argv(container),
                                {**_env(container), "POD_IP": "127.0.0.1",
                                 "POD_NAME": name.split(".")[0]}))]
            if "--store" in argv:  # the members' names are cluster DNS: this etcd here
                argv[argv.index("--store") + 1] = f"etcd://{etcd.endpoint}/pdreg"
            env = {k: _swap_paths(loopback.value(v, names), mapping)
                   for k, v in _env(container).items()}
            processes.start(name, argv, env)
            if name in names:
                healthz = f"http://{loopback.address(name, 7680)}/healthz"
                assert wait_until(lambda url=healthz: processes.check_alive() or _answers(url),
                                  WAIT_S), name
        # Reference engines with the sidecar's credentials (a real vLLM cannot run here).
        pod, sidecar = _pdreg_container("vllm", "vllm-decode")
        mapping = _local_paths(pod, sidecar, secrets, tmp_path / "engines")
        env = {k: _swap_paths(loopback.value(v, names), mapping)
               for k, v in _env(sidecar).items()}
        assert env["PDREG_REGISTRY"].count(",") == len(names) - 1, env["PDREG_REGISTRY"]
        token_file = _swap_paths(flag(container_argv(sidecar), "--token-file"), mapping)
        for role in ("prefill", "decode"):
            processes.start(role, ["engine", "--role", role, "--backend", "sim",
                                   "--model", "tiny", "--token-file", token_file], env)
        router = f"http://{loopback.address('pdreg-router', 8000)}"
        api_key = (files / "api-key").read_text()
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}

        def served() -> bool:
            processes.check_alive()
            try:
                return httpx.post(f"{router}/v1/completions", json=body, timeout=10.0,
                                  headers={"authorization": f"Bearer {api_key}"}
                                  ).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(served, WAIT_S, poll_s=0.5), "no completion through the router"
        refused = httpx.post(f"{router}/v1/completions", json=body, timeout=10.0)
        assert refused.status_code == 401
        # Both registries hold both engines (and the router): each client named both.
        for name in names:
            members = httpx.get(f"http://{loopback.address(name, 7680)}/v1/members",
                                timeout=10.0).json()
            assert sorted(m["role"] for m in members) == ["api_server", "decode", "prefill"], \
                (name, members)
            replicas = httpx.get(f"http://{loopback.address(name, 7680)}/v1/registries",
                                 timeout=10.0).json()
            assert {r["id"] for r in replicas} == {n.split(".")[0] for n in names}
    finally:
        processes.stop()
        etcd.stop()
