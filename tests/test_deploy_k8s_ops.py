"""deploy/k8s, operations: where each credential lands, what the NetworkPolicies let
through (their semantics modelled in tests/deploy_policy.py), disruption budgets,
placement, resources, monitoring and the engines' drain hook, on the overlays as
kubectl's kustomize renders them.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_policy import (
    Pod,
    ingress_allowed,
    selector_matches,
)
from deploy_support import (
    DEPLOY,
    K8S,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    by_name,
    container_argv,
    engine_deployment,
    env_of,
    is_pdreg,
    load_yaml,
    named_ports,
    objects,
    overlays,
    pdreg_containers,
    pod_labels,
    pod_spec,
    render,
    run_tool,
    tool,
    workloads,
    workloads_by_name,
)

from engine_agent.reference.server import ServerState, render_metrics
from pdreg.cli import build_parser

WAIT_S = 20.0
OPERATORS = "pdreg-operators"


# --- credentials ------------------------------------------------------------------------

SECRETS = K8S / "secrets"


ALLOWLIST = "pdreg-allowed-clients"  # written by generate.sh: every allowed client key


def _secret_keys() -> dict[str, set[str]]:
    """Secret name -> keys, from deploy/k8s/secrets/kustomization.yaml's generators, and
    the allowlist generate.sh writes (one client key at first)."""
    kustomization = load_yaml(SECRETS / "kustomization.yaml")[0]
    keys = {ALLOWLIST: {"client.key"}}
    for generator in kustomization["secretGenerator"]:
        keys[generator["name"]] = {entry.partition("=")[0] if "=" in entry
                                   else Path(entry).name for entry in generator["files"]}
    return keys


def _mounted_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key), for every Secret file mounted; a Secret
    mounted whole (no items: every key it has) is (Secret, "*") at its mount path."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")  # none: a claim template
        if secret and "items" not in secret:
            files[mount["mountPath"]] = (secret["secretName"], "*")
        elif secret:
            for item in secret["items"]:
                files[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"],
                                                                  item["key"])
    return files


# What each process is given, by where its credential lands. Engines get nothing.
CREDENTIALS = {
    "registry": {"token_file": "token", "admin_token_file": "admin-token",
                 "curve_secret_key": "registry.key_secret"},
    "router": {"token_file": "token", "api_key_file": "api-key"},
    "agent": {"token_file": "token"},
}


@overlays
def test_every_credential_is_a_mounted_secret_file(overlay: str) -> None:
    keys = _secret_keys()
    for pod, container in pdreg_containers(overlay):
        files = _mounted_files(pod, container)
        for secret, key in files.values():
            assert key == "*" or key in keys[secret], \
                f"{container['name']}: {secret}/{key} is not generated"
        argv = container_argv(container)
        args = build_parser().parse_args(argv)
        for attribute, key in CREDENTIALS[argv[0]].items():
            path = getattr(args, attribute)
            assert files.get(path, (None, None))[1] == key, f"{argv[0]}: {attribute}={path}"
        if argv[0] == "registry":
            # Every allowed client key at once (a rotation has two): the whole Secret.
            assert files[args.allowed_clients] == (ALLOWLIST, "*")
        else:
            env = env_of(container)
            assert files[env["PDREG_REGISTRY_PUBLIC_KEY"]][1] == "registry.key"
            assert files[env["PDREG_CURVE_KEY"]][1] == "client.key_secret"
        # Nothing a process does not need: the router never sees the admin token.
        mounted = {key for _, key in files.values()}
        needed = set(CREDENTIALS[argv[0]].values()) | (
            {"*"} if argv[0] == "registry" else {"registry.key", "client.key_secret"})
        assert mounted == needed, f"{argv[0]} mounts {sorted(mounted - needed)} it does not use"
    for deployment in workloads(overlay):
        for container in pod_spec(deployment)["containers"]:
            if not is_pdreg(container):
                assert not _mounted_files(pod_spec(deployment), container), container["name"]


def test_secrets_render_from_generated_credentials(tmp_path: Path) -> None:
    """generate.sh (tokens + `pdreg keys generate`) then kubectl kustomize: valid Secrets
    in the fleet's namespace with every key the overlays mount; a second run keeps them."""
    secrets = tmp_path / "secrets"
    shutil.copytree(SECRETS, secrets, ignore=shutil.ignore_patterns("files"))
    shutil.copytree(K8S / "namespace", tmp_path / "namespace")  # the Secrets include it
    pdreg = {**os.environ, "PDREG": f"{sys.executable} -m pdreg"}
    for _ in range(2):
        subprocess.run([str(secrets / "generate.sh")], check=True, timeout=60,
                       capture_output=True, cwd=tmp_path, env=pdreg)
        if _ == 0:
            first = {p: p.read_bytes() for p in (secrets / "files").rglob("*") if p.is_file()}
    assert first == {p: p.read_bytes() for p in (secrets / "files").rglob("*") if p.is_file()}
    assert all(p.stat().st_mode & 0o077 == 0 for p in first)
    docs = render(secrets)
    rendered = tmp_path / "secrets.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    for version in KUBERNETES_VERSIONS:
        result = run_tool([tool("kubernetes-validate"), "--strict", "--quiet",
                           "--kubernetes-version", version, str(rendered)])
        assert result.returncode == 0, result.stdout + result.stderr
    generated = {d["metadata"]["name"]: set(d["data"]) for d in objects(docs, "Secret")}
    assert generated == _secret_keys()
    # The namespace comes with them: on a new cluster they are applied first.
    [namespace] = objects(docs, "Namespace")
    assert namespace["metadata"]["name"] == NAMESPACE
    assert {d["metadata"]["namespace"] for d in objects(docs, "Secret")} == {NAMESPACE}


# --- NetworkPolicy ----------------------------------------------------------------------


def _pods(overlay: str) -> dict[str, Pod]:
    docs = render(K8S / overlay)
    pods = {d["metadata"]["name"]: Pod(NAMESPACE, pod_labels(d), named_ports(pod_spec(d)))
            for d in workloads_by_name(docs).values()}
    planner = {"app.kubernetes.io/component": "planner", "app.kubernetes.io/part-of": "pdreg"}
    engine_labels = pod_labels(engine_deployment(overlay, "decode"))
    return {**pods, "planner": Pod(NAMESPACE, planner),
            "stranger": Pod(NAMESPACE, {"app": "something-else"}),
            # An engine's labels copied into another namespace are not an engine.
            "impostor": Pod("elsewhere", engine_labels),
            "operator": Pod(OPERATORS, {"app": "kubectl"})}


@overlays
def test_network_policy_lets_through_only_what_the_fleet_needs(overlay: str) -> None:
    policies = objects(render(K8S / overlay), "NetworkPolicy")
    pods = _pods(overlay)
    prefill, decode = f"{overlay}-prefill", f"{overlay}-decode"
    registry, router, engine = pods["pdreg-registry"], pods["pdreg-router"], pods[decode]
    etcd = pods["pdreg-etcd"]
    expected = {  # (target, port): who may connect
        ("pdreg-registry", registry.ports["control"]): {prefill, decode, "pdreg-router",
                                                        "planner"},
        ("pdreg-registry", registry.ports["events"]): {"pdreg-router", "planner"},
        ("pdreg-registry", registry.ports["http"]): {"operator", "pdreg-prometheus"},
        ("pdreg-router", router.ports["http"]): set(pods),
        # /metrics names members and engine URLs: Prometheus, and the planner, which
        # reads the routers' latency there.
        ("pdreg-router", router.ports["metrics"]): {"pdreg-prometheus", "planner"},
        (decode, engine.ports["http"]): {"pdreg-router", "pdreg-prometheus", prefill, decode},
        # KV transfer: NIXL's side channel, SGLang's bootstrap, Mooncake's data ports
        (decode, 5600): {prefill, decode},
        (prefill, 8998): {prefill, decode},
        (decode, 17000): {prefill, decode},
        ("pdreg-prometheus", pods["pdreg-prometheus"].ports["http"]): {"operator"},
        # etcd's keys are the fleet's admin state: the registries alone; its members
        # among themselves; its metrics to Prometheus.
        ("pdreg-etcd", etcd.ports["client"]): {"pdreg-registry"},
        ("pdreg-etcd", etcd.ports["peer"]): {"pdreg-etcd"},
        ("pdreg-etcd", etcd.ports["metrics"]): {"pdreg-prometheus"},
    }
    for (target, port), allowed in expected.items():
        got = {name for name, source in pods.items()
               if ingress_allowed(policies, source, pods[target], port)}
        assert got == allowed, f"{target}:{port}"
    # Every pod of the fleet is selected by a policy: none is open by omission.
    for name in ("pdreg-registry", "pdreg-router", prefill, decode, "pdreg-prometheus",
                 "pdreg-etcd"):
        assert not ingress_allowed(policies, pods["stranger"], pods[name], 1), name


# --- disruptions, placement, resources -------------------------------------------------


@overlays
def test_one_disruption_budget_per_role(overlay: str) -> None:
    docs = render(K8S / overlay)
    budgets = objects(docs, "PodDisruptionBudget")
    for name, deployment in workloads_by_name(docs).items():
        matching = [b["metadata"]["name"] for b in budgets
                    if selector_matches(b["spec"]["selector"], pod_labels(deployment))]
        if name == "pdreg-prometheus":
            assert matching == [], f"{name}: a budget on one replica blocks node drains"
        elif name == "pdreg-etcd":
            # A majority of three, always: a drain never takes the store's quorum.
            assert matching == ["pdreg-etcd"], name
            [budget] = [b for b in budgets if b["metadata"]["name"] == "pdreg-etcd"]
            assert budget["spec"] == {"minAvailable": 2, "selector": budget["spec"]["selector"]}
            assert deployment["spec"]["replicas"] == 3
        else:
            assert len(matching) == 1, name
            [budget] = [b for b in budgets if b["metadata"]["name"] == matching[0]]
            assert budget["spec"]["maxUnavailable"] == 1


@overlays
def test_engines_spread_over_zones_and_nodes(overlay: str) -> None:
    for role in ("prefill", "decode"):
        deployment = engine_deployment(overlay, role)
        constraints = pod_spec(deployment)["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in constraints} == {
            "topology.kubernetes.io/zone", "kubernetes.io/hostname"}
        for constraint in constraints:
            assert selector_matches(constraint["labelSelector"], pod_labels(deployment))
            # Soft: a fleet on one node still schedules.
            assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"


# --- monitoring ---------------------------------------------------------------------


@overlays
def test_prometheus_config_rbac_and_dashboard(overlay: str, tmp_path: Path) -> None:
    docs = render(K8S / overlay)
    config_maps = by_name(docs, "ConfigMap")
    config = yaml.safe_load(config_maps["pdreg-prometheus"]["data"]["prometheus.yml"])
    [job] = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod",
                                             "namespaces": {"own_namespace": True}}]
    # Debian builds Prometheus without Kubernetes discovery, so promtool here checks the
    # rest of the file (relabelling included) with the discovery block set aside.
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["pod-ip:8000"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_tool([tool("promtool"), "check", "config", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    # Pod discovery in its own namespace, with a Role bound to the pod's service account.
    prometheus = pod_spec(by_name(docs, "Deployment")["pdreg-prometheus"])
    [role] = objects(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    [binding] = objects(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                    "name": prometheus["serviceAccountName"]}]
    dashboard = config_maps["pdreg-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pdreg-dashboard.json"]) == json.loads(
        (DEPLOY / "grafana/pdreg-dashboard.json").read_text())


# --- the engines' drain hook --------------------------------------------------------


class _MetricsHandler(BaseHTTPRequestHandler):
    """Serves /metrics: busy for the first `busy_answers` scrapes, idle afterwards."""

    busy_answers = 2
    answered = 0

    def do_GET(self) -> None:
        cls = type(self)
        busy = cls.answered < cls.busy_answers
        cls.answered += 1
        text = render_metrics(ServerState(role="prefill", model="tiny", model_dir=""))
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
    config_map = by_name(render(K8S / "vllm"), "ConfigMap")["pdreg-engine-drain"]
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


def test_engine_prestop_hook_matches_labels(tmp_path: Path) -> None:
    """SGLang counts open HTTP requests by method: only POSTs are work (the hook's own
    GET of /metrics is one too)."""
    script = runpy.run_path(str(_wait_idle_script(tmp_path)), run_name="wait_idle_module")
    text = ('# TYPE sglang:http_requests_active gauge\n'
            'sglang:http_requests_active{method="GET",model_name="m"} 1.0\n'
            'sglang:http_requests_active{method="POST",model_name="m"} 2.0\n'
            'sglang:num_running_reqs{model_name="m"} 0.0\n')
    selectors = [script["selector"](s) for s in
                 ['sglang:http_requests_active{method="POST"}', "sglang:num_running_reqs"]]
    assert script["busy"](text, selectors) == 2.0
    assert script["busy"](text.replace("2.0", "0.0"), selectors) == 0.0
