"""deploy/ stays honest: every file parses, every `pdreg` command line in Compose and
Kubernetes parses with the real CLI, the ports they publish, probe and scrape are the
ones those command lines listen on, and every Grafana query names only metrics the code
exposes. No Docker, no cluster: the files are read, the CLI parser and a live registry
are real.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine_agent.reference.server import ServerState, render_metrics
from pdreg.cli import build_parser
from registry.server import RegistryConfig, RegistryServer
from router.metrics import RouterMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
PDREG_IMAGE_PREFIX = "pdreg:"
WAIT_S = 20.0  # generous: the machine is shared with other test runs

# Which HTTP path each kind of pdreg process answers health on.
HEALTH_PATHS = {"registry": "/healthz", "router": "/health", "engine": "/health"}


# --- reading the files ------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))


def load_yaml(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "docker-compose.yml")[0]


def k8s_objects(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in load_yaml(path)
            if isinstance(doc, dict) and doc.get("kind") == kind]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


# --- pdreg command lines ----------------------------------------------------------------


@dataclass(frozen=True)
class PdregProcess:
    where: str  # "compose:router", "k8s:router.yaml:pdreg-router/router"
    argv: list[str]

    def parse(self) -> argparse.Namespace:
        try:
            return build_parser().parse_args(self.argv)
        except SystemExit:
            pytest.fail(f"{self.where}: `pdreg {shlex.join(self.argv)}` does not parse")

    @property
    def kind(self) -> str:
        return self.argv[0]


def listening_ports(kind: str, args: argparse.Namespace) -> set[int]:
    """Every port a pdreg process binds, from its parsed flags (0 = none fixed).

    KIND is the subcommand, argv[0]: `args.command` is not it for `agent`, whose
    positional COMMAND list reuses that attribute name.
    """
    ports = {
        "registry": lambda: {args.port, args.events_port, args.http_port},
        "router": lambda: {args.port},
        "engine": lambda: {args.port, args.kv_port, args.bootstrap_port},
        "agent": lambda: set(),
    }[kind]()
    return {port for port in ports if port > 0}


def http_port(kind: str, args: argparse.Namespace) -> int:
    return args.http_port if kind == "registry" else args.port


def container_argv(container: dict[str, Any]) -> list[str]:
    # The image's ENTRYPOINT is ["pdreg"]: args are pdreg's argv.
    assert container.get("command") in (None, ["pdreg"]), container["name"]
    return [str(arg) for arg in container["args"]]


def compose_processes() -> dict[str, PdregProcess]:
    found = {}
    for name, service in compose()["services"].items():
        if str(service.get("image", "")).startswith(PDREG_IMAGE_PREFIX):
            command = service["command"]
            argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
            found[name] = PdregProcess(f"compose:{name}", argv)
    return found


def k8s_processes() -> list[PdregProcess]:
    found = []
    for path, deployment in k8s_objects("Deployment"):
        for container in pod_spec(deployment)["containers"]:
            if container["image"].startswith(PDREG_IMAGE_PREFIX):
                where = f"k8s:{path.name}:{deployment['metadata']['name']}/{container['name']}"
                found.append(PdregProcess(where, container_argv(container)))
    return found


ALL_PROCESSES = [*compose_processes().values(), *k8s_processes()]


def test_every_file_parses() -> None:
    files = yaml_files()
    assert len(files) >= 10
    for path in files:
        assert load_yaml(path), f"{path} is empty"
    for path in DEPLOY.rglob("*.json"):
        assert json.loads(path.read_text()), f"{path} is empty"


def test_the_expected_processes_are_there() -> None:
    kinds = sorted(process.kind for process in compose_processes().values())
    assert kinds == ["engine"] * 4 + ["registry", "router"]
    k8s_kinds = sorted(process.kind for process in k8s_processes())
    assert k8s_kinds == ["agent"] * 4 + ["registry", "router"]


@pytest.mark.parametrize("process", ALL_PROCESSES, ids=lambda p: p.where)
def test_pdreg_command_line_parses_and_is_reachable(process: PdregProcess) -> None:
    args = process.parse()
    if process.kind in ("registry", "router", "engine"):
        assert args.host == "0.0.0.0", f"{process.where}: a container must bind all interfaces"
    if process.kind in ("router", "engine", "agent"):
        assert args.advertise_host not in ("", "0.0.0.0", "127.0.0.1", "localhost"), (
            f"{process.where}: peers need a routable --advertise-host")
    if process.where.startswith("k8s:") and process.kind != "registry":
        assert args.advertise_host == "$(POD_IP)", process.where


# --- Compose ----------------------------------------------------------------------------


def _published(port_spec: str) -> tuple[str, int, int]:
    host, host_port, container_port = port_spec.split(":")
    return host, int(host_port), int(container_port)


def _healthcheck_url(service: dict[str, Any]) -> str:
    test = " ".join(str(part) for part in service["healthcheck"]["test"])
    match = re.search(r"http://[^'\"\s]+", test)
    assert match, test
    return match.group(0)


def test_compose_ports_agree_with_the_command_lines() -> None:
    services = compose()["services"]
    processes = compose_processes()
    for name, service in services.items():
        for spec in service.get("ports", []):
            host, _, container_port = _published(str(spec))
            assert host == "127.0.0.1", f"{name}: publish on loopback only ({spec})"
            if name in processes:
                args = processes[name].parse()
                assert container_port in listening_ports(processes[name].kind, args), (
                    f"{name}: {spec}")
        assert "healthcheck" in service, f"{name} has no healthcheck"

    for name, process in processes.items():
        args = process.parse()
        url = urlsplit(_healthcheck_url(services[name]))
        assert url.port == http_port(process.kind, args), f"{name}: healthcheck port"
        assert url.path == HEALTH_PATHS[process.kind], f"{name}: healthcheck path"
        if process.kind != "registry":
            assert args.advertise_host == name, f"{name}: advertise the service name"
            assert args.registry is None, f"{name}: take the registry from the env"

    registries = [n for n, p in processes.items() if p.kind == "registry"]
    assert registries == ["registry"]
    control_port = processes["registry"].parse().port
    for name in processes:
        env = services[name].get("environment", {})
        assert env.get("PDREG_REGISTRY") == f"registry:{control_port}", name


def test_compose_prometheus_scrapes_every_pdreg_http_port() -> None:
    config = load_yaml(DEPLOY / "prometheus.yml")[0]
    targets = {target for job in config["scrape_configs"]
               for group in job.get("static_configs", []) for target in group["targets"]}
    processes = compose_processes()
    expected = {f"{name}:{http_port(p.kind, p.parse())}" for name, p in processes.items()}
    assert targets == expected
    prometheus = compose()["services"]["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]


def test_compose_grafana_provisioning_matches_the_mounts() -> None:
    services = compose()["services"]
    grafana = services["grafana"]
    mounts = dict(str(v).rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    for source in mounts:
        assert (DEPLOY / source).exists(), source
    dashboards_dir = Path(mounts["./grafana/pdreg-dashboard.json"]).parent
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/pdreg.yml")[0]
    assert Path(provider["providers"][0]["options"]["path"]) == dashboards_dir
    datasource = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")[0]
    url = urlsplit(datasource["datasources"][0]["url"])
    assert url.hostname == "prometheus"
    assert f"127.0.0.1:{url.port}:{url.port}" in services["prometheus"]["ports"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_compose_prometheus_config_passes_promtool() -> None:
    result = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Kubernetes -------------------------------------------------------------------------


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom"))
            for item in container.get("env", [])}


def _flag(argv: list[str], flag: str) -> str:
    """The value after FLAG in ARGV (`--flag value` or `--flag=value`)."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


def _probe_ports(container: dict[str, Any]) -> list[int]:
    return [container[probe]["httpGet"]["port"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe")
            if probe in container]


def _container_listening_ports(container: dict[str, Any]) -> set[int]:
    if container["image"].startswith(PDREG_IMAGE_PREFIX):
        argv = container_argv(container)
        return listening_ports(argv[0], build_parser().parse_args(argv))
    ports = {int(_flag(container["args"], "--port"))}
    for extra in ("--disaggregation-bootstrap-port",):
        with contextlib.suppress(AssertionError):
            ports.add(int(_flag(container["args"], extra)))
    nixl = _env(container).get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if nixl:
        ports.add(int(nixl))
    return ports


def test_k8s_ports_probes_and_annotations_agree() -> None:
    for path, deployment in k8s_objects("Deployment"):
        where = f"{path.name}:{deployment['metadata']['name']}"
        pod = pod_spec(deployment)
        http_ports: set[int] = set()
        for container in pod["containers"]:
            listening = _container_listening_ports(container)
            declared = {port["containerPort"] for port in container.get("ports", [])}
            assert declared == listening, f"{where}/{container['name']}: containerPorts"
            for port in _probe_ports(container):
                assert port in listening, f"{where}/{container['name']}: probe port {port}"
            if container["image"].startswith(PDREG_IMAGE_PREFIX):
                argv = container_argv(container)
                if argv[0] != "agent":
                    http_ports.add(http_port(argv[0], build_parser().parse_args(argv)))
                for value in container_argv(container):
                    for var in re.findall(r"\$\((\w+)\)", value):
                        assert var in _env(container), f"{where}: $({var}) is not defined"
            else:
                http_ports.add(int(_flag(container["args"], "--port")))
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", where
        assert int(annotations["prometheus.io/port"]) in http_ports, where


def test_k8s_services_target_listening_ports() -> None:
    deployments = {doc["metadata"]["name"]: doc for _, doc in k8s_objects("Deployment")}
    services = k8s_objects("Service")
    assert {doc["metadata"]["name"] for _, doc in services} == {"pdreg-registry", "pdreg-router"}
    for _, service in services:
        selector = service["spec"]["selector"]
        [deployment] = [d for d in deployments.values()
                        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        listening = set().union(*(_container_listening_ports(c)
                                  for c in pod_spec(deployment)["containers"]))
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in listening, service["metadata"]["name"]

    # PDREG_REGISTRY names the registry Service's control port, which reaches --port.
    [(_, registry_service)] = [s for s in services if s[1]["metadata"]["name"] == "pdreg-registry"]
    registry_args = build_parser().parse_args(container_argv(
        pod_spec(deployments["pdreg-registry"])["containers"][0]))
    service_ports = {p["port"]: p["targetPort"] for p in registry_service["spec"]["ports"]}
    clients = [c for d in deployments.values() for c in pod_spec(d)["containers"]
               if c["image"].startswith(PDREG_IMAGE_PREFIX) and c["args"][0] != "registry"]
    assert len(clients) == 5  # router + 4 sidecars
    for container in clients:
        host, port = _env(container)["PDREG_REGISTRY"].split(":")
        assert host == "pdreg-registry"
        assert service_ports[int(port)] == registry_args.port
        assert set(service_ports.values()) == listening_ports("registry", registry_args)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_k8s_engine_pod_wires_sidecar_to_engine(engine: str, role: str) -> None:
    [(_, deployment)] = [(p, d) for p, d in k8s_objects("Deployment")
                         if d["metadata"]["name"] == f"{engine}-{role}"]
    pod = pod_spec(deployment)
    [server] = [c for c in pod["containers"] if not c["image"].startswith(PDREG_IMAGE_PREFIX)]
    [sidecar] = [c for c in pod["containers"] if c["image"].startswith(PDREG_IMAGE_PREFIX)]
    argv = container_argv(sidecar)
    args = build_parser().parse_args(argv)
    assert (argv[0], args.engine, args.role) == ("agent", engine, role)
    engine_url = urlsplit(args.engine_url)
    assert engine_url.hostname == "127.0.0.1"
    assert engine_url.port == int(_flag(server["args"], "--port"))
    assert _flag(server["args"], "--host") == "0.0.0.0"
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    assert _env(sidecar)["POD_IP"] == pod_ip

    if engine == "vllm":
        kv = json.loads(_flag(server["args"], "--kv-transfer-config"))
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        env = _env(server)
        assert env["POD_IP"] == pod_ip
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert args.kv_port == int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    else:
        assert _flag(server["args"], "--disaggregation-mode") == role
        assert "--enable-metrics" in server["args"]  # the sidecar reads load from /metrics
        if role == "prefill":
            assert args.bootstrap_port == int(
                _flag(server["args"], "--disaggregation-bootstrap-port"))

    # Drain: the sidecar drains on SIGTERM; the engine's preStop waits for idle past the
    # sidecar's drain timeout, and the pod's grace period covers both.
    hook = server["lifecycle"]["preStop"]["exec"]["command"]
    wait_s = float(hook[3])
    assert hook[2] == f"http://127.0.0.1:{engine_url.port}/metrics"
    assert args.drain_timeout < wait_s < pod["terminationGracePeriodSeconds"]
    assert "lifecycle" not in sidecar, "the sidecar drains on SIGTERM itself"


def test_kustomization_lists_existing_files() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")[0]
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource


class _MetricsHandler(BaseHTTPRequestHandler):
    """Serves /metrics: busy for the first `busy_answers` scrapes, idle afterwards."""

    busy_answers = 2
    answered = 0

    def do_GET(self) -> None:
        cls = type(self)
        busy = cls.answered < cls.busy_answers
        cls.answered += 1
        state = ServerState(role="prefill", model="tiny", model_dir="")
        text = render_metrics(state)
        if busy:
            text = text.replace('vllm:num_requests_waiting{model_name="tiny"} 0',
                                'vllm:num_requests_waiting{model_name="tiny"} 3')
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[ThreadingHTTPServer]:
    _MetricsHandler.answered = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=WAIT_S)


def _wait_idle_script(tmp_path: Path) -> Path:
    [config_map] = [doc for _, doc in k8s_objects("ConfigMap")
                    if doc["metadata"]["name"] == "pdreg-engine-drain"]
    script = tmp_path / "wait-idle.py"
    script.write_text(config_map["data"]["wait-idle.py"])
    return script


def test_engine_prestop_hook_waits_for_idle(tmp_path: Path, metrics_server) -> None:
    script = _wait_idle_script(tmp_path)
    url = f"http://127.0.0.1:{metrics_server.server_address[1]}/metrics"
    started = time.monotonic()
    subprocess.run([sys.executable, str(script), url, str(WAIT_S), "0",
                    "vllm:num_requests_running", "vllm:num_requests_waiting"],
                   check=True, timeout=WAIT_S + 10)
    assert _MetricsHandler.answered == 3  # busy, busy, idle
    assert time.monotonic() - started < WAIT_S


def test_engine_prestop_hook_returns_when_engine_is_gone(tmp_path: Path) -> None:
    script = _wait_idle_script(tmp_path)
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]  # closed before the hook runs: connection refused
    started = time.monotonic()
    subprocess.run([sys.executable, str(script), f"http://127.0.0.1:{port}/metrics",
                    str(WAIT_S), "0", "vllm:num_requests_running"],
                   check=True, timeout=WAIT_S + 10)
    assert time.monotonic() - started < WAIT_S / 2


# --- Dockerfile -------------------------------------------------------------------------


def test_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert 'ENTRYPOINT ["pdreg"]' in text
    assert "ARG PDREG_EXTRAS" in text
    assert not re.search(r"https?://", text), "name no package index host"
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M))
    packages = {p.name for p in Path(DEPLOY.parent).iterdir()
                if (p / "__init__.py").is_file() and p.name in ("registry", "engine_agent",
                                                               "router", "pdreg")}
    assert copied == packages == {"registry", "engine_agent", "router", "pdreg"}
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for name in copied:
        assert f"!{name}/" in ignore


# --- Grafana queries name real metrics ------------------------------------------------


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset",
                   "bool", "and", "or", "unless", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names, label values or range durations."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = re.findall(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text)
    return {name for name in names if name.lower() not in PROMQL_KEYWORDS}


@pytest.mark.parametrize(("expr", "names"), [
    ("sum by (role, state) (pdreg_members{model=~\"$model\"})", {"pdreg_members"}),
    ("histogram_quantile(0.99, sum by (le) (rate(a_bucket{m=\"x\"}[$__rate_interval])))",
     {"a_bucket"}),
    ("max(vllm:kv_cache_usage_perc) / on (instance) b offset 5m", {"vllm:kv_cache_usage_perc",
                                                                   "b"}),
    ("rate(x[1m]) > 0 and y", {"x", "y"}),
])
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def _sample_names(families: Iterator[Any]) -> set[str]:
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                                 "_created"),
                "summary": ("", "_sum", "_count", "_created")}
    names: set[str] = set()
    for family in families:
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


@pytest.fixture(scope="module")
def exposed_metric_names() -> set[str]:
    """Sample names the code exposes: a live registry, the router's metrics, and the
    reference engine's /metrics (vLLM's load gauge names)."""
    config = RegistryConfig(port=0, events_port=0, http_port=0)
    with RegistryServer(config).start() as registry:
        text = httpx.get(f"{registry.http_url}/metrics", timeout=WAIT_S).text
    names = _sample_names(text_string_to_metric_families(text))
    names |= _sample_names(RouterMetrics().registry.collect())
    engine = render_metrics(ServerState(role="prefill", model="tiny", model_dir=""))
    names |= _sample_names(text_string_to_metric_families(engine))
    assert {"pdreg_members", "pdreg_heartbeats_total", "pdreg_router_ttft_seconds_bucket",
            "vllm:num_requests_running"} <= names
    return names


def _dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana/pdreg-dashboard.json").read_text())
    exprs = [(panel["title"], target["expr"]) for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    exprs += [(f"variable {v['name']}", v["definition"])
              for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_queries_name_exposed_metrics(exposed_metric_names: set[str]) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 15
    for title, expr in exprs:
        names = promql_metric_names(expr.replace("label_values(", "label_values_fn("))
        names.discard("model")  # label_values(metric, label): the label, not a metric
        assert names, f"{title}: {expr} names no metric"
        unknown = names - exposed_metric_names
        assert not unknown, f"panel {title!r}: {sorted(unknown)} are not exposed"


def test_dashboard_covers_the_brief() -> None:
    text = " ".join(expr for _, expr in _dashboard_exprs())
    for metric in ("pdreg_members", "pdreg_member_heartbeat_age_seconds",
                   "pdreg_heartbeats_total", "pdreg_rejected_messages_total",
                   "pdreg_departures_total", "pdreg_self_preservation",
                   "pdreg_loop_lag_seconds", "pdreg_membership_version",
                   "pdreg_router_requests_total", "pdreg_router_ttft_seconds_bucket",
                   "pdreg_router_retries_total", "pdreg_router_quarantines_total"):
        assert metric in text, metric
