"""deploy/k8s as an operator gets it: each overlay rendered by kubectl's own kustomize,
validated against the Kubernetes schemas (kubernetes-validate --strict, 1.30 and 1.37),
held to the kubelet's runAsNonRoot rule, Pod Security "restricted" for pdreg's
containers, NetworkPolicy semantics and the drain timings, with every `pdreg` command
line parsed by pdreg's own CLI. No cluster: what needs one is listed in deploy/README.md.
"""

from __future__ import annotations

import copy
import json
import os
import re
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
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_policy import (
    Pod,
    hardening_errors,
    ingress_allowed,
    run_as_non_root_errors,
    selector_matches,
    unreadable_files,
)
from deploy_support import (
    DEPLOY,
    K8S,
    OVERLAYS,
    by_name,
    container_argv,
    env_of,
    flag,
    http_port,
    image_user,
    image_user_spec,
    is_pdreg,
    k8s_processes,
    listening_ports,
    load_yaml,
    objects,
    pod_labels,
    pod_spec,
    render,
    run_tool,
    tool,
)

from engine_agent.probes import SGLANG_GAUGES, VLLM_GAUGES
from engine_agent.reference.server import ServerState, render_metrics
from pdreg.cli import build_parser

WAIT_S = 20.0
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
NAMESPACE = "pdreg"
OPERATORS = "pdreg-operators"
ENGINES = {"vllm": "vllm", "sglang": "sglang"}  # overlay -> engine container name
overlays = pytest.mark.parametrize("overlay", OVERLAYS)


def workloads(overlay: str) -> list[dict[str, Any]]:
    return objects(render(K8S / overlay), "Deployment")


def pdreg_containers(overlay: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment in workloads(overlay):
        for container in pod_spec(deployment)["containers"]:
            if is_pdreg(container):
                yield pod_spec(deployment), container


def engine_deployment(overlay: str, role: str) -> dict[str, Any]:
    return by_name(render(K8S / overlay), "Deployment")[f"{overlay}-{role}"]


def engine_pair(overlay: str, role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = pod_spec(engine_deployment(overlay, role))
    [server] = [c for c in pod["containers"] if not is_pdreg(c)]
    [sidecar] = [c for c in pod["containers"] if is_pdreg(c)]
    return server, sidecar


# --- rendered and valid -----------------------------------------------------------------


@overlays
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_overlay_passes_kubernetes_validate_strict(overlay: str, version: str,
                                                  tmp_path: Path) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(yaml.safe_dump_all(render(K8S / overlay)))
    result = run_tool([tool("kubernetes-validate"), "--strict", "--quiet",
                       "--kubernetes-version", version, str(rendered)])
    assert result.returncode == 0, result.stdout + result.stderr
    # Every kind has a schema: an unknown kind (a CRD) would only warn.
    assert "Couldn't find schema" not in result.stdout + result.stderr


@overlays
def test_overlay_holds_the_whole_fleet_in_one_namespace(overlay: str) -> None:
    docs = render(K8S / overlay)
    kinds = sorted({doc["kind"] for doc in docs})
    assert kinds == ["ConfigMap", "Deployment", "Namespace", "NetworkPolicy",
                     "PersistentVolumeClaim", "PodDisruptionBudget", "Role", "RoleBinding",
                     "Service", "ServiceAccount"]
    [namespace] = objects(docs, "Namespace")
    assert namespace["metadata"]["name"] == NAMESPACE
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdreg"
    # Named in each overlay and in ../secrets: they must agree.
    for kustomization in (K8S / overlay, K8S / "secrets"):
        assert load_yaml(kustomization / "kustomization.yaml")[0]["namespace"] == NAMESPACE
    assert {d["metadata"]["name"] for d in workloads(overlay)} == {
        "pdreg-registry", "pdreg-router", "pdreg-prometheus",
        f"{overlay}-prefill", f"{overlay}-decode"}


@overlays
def test_x_and_y_are_set_in_one_place(overlay: str, tmp_path: Path) -> None:
    """The overlay's `replicas:` sets XpYd; changing only that line reshapes the fleet."""
    kustomization = load_yaml(K8S / overlay / "kustomization.yaml")[0]
    counts = {r["name"]: r["count"] for r in kustomization["replicas"]}
    assert counts.keys() == {f"{overlay}-prefill", f"{overlay}-decode"}
    deployments = by_name(render(K8S / overlay), "Deployment")
    for name, count in counts.items():
        assert deployments[name]["spec"]["replicas"] == count

    copied = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copied, ignore=shutil.ignore_patterns(".env", "files"))
    path = copied / "k8s" / overlay / "kustomization.yaml"
    kustomization["replicas"] = [{"name": f"{overlay}-prefill", "count": 3},
                                 {"name": f"{overlay}-decode", "count": 5}]
    path.write_text(yaml.safe_dump(kustomization))
    reshaped = by_name(render(copied / "k8s" / overlay), "Deployment")
    assert reshaped[f"{overlay}-prefill"]["spec"]["replicas"] == 3
    assert reshaped[f"{overlay}-decode"]["spec"]["replicas"] == 5


# --- who runs as whom -------------------------------------------------------------------


@overlays
def test_no_container_is_refused_by_the_kubelets_run_as_non_root_check(overlay: str) -> None:
    """The bug this deploy/ shipped with: `USER pdreg` plus runAsNonRoot and no
    runAsUser, which the kubelet refuses (CreateContainerConfigError)."""
    problems = []
    for deployment in workloads(overlay):
        pod = pod_spec(deployment)
        for container in pod["containers"]:
            # Only pdreg's user is known here; another image must say its user itself.
            user = image_user_spec() if is_pdreg(container) else "unknown-image-user"
            problems += run_as_non_root_errors(pod, container, user)
    assert not problems


@overlays
def test_pdreg_containers_run_hardened_as_the_images_user(overlay: str) -> None:
    uid, gid = image_user()
    containers = list(pdreg_containers(overlay))
    assert len(containers) == 4  # registry, router, two sidecars
    for pod, container in containers:
        assert not hardening_errors(pod, container, uid, gid)
        assert pod["securityContext"]["fsGroup"] == gid
        assert not unreadable_files(pod, container, uid)
        assert pod.get("automountServiceAccountToken") is False, container["name"]


def test_the_policy_catches_what_shipped_before() -> None:
    """The rules above can fail: the old Dockerfile's user name, a root user, and a
    Secret only root can read are each caught."""
    registry = pod_spec(by_name(render(K8S / "vllm"), "Deployment")["pdreg-registry"])
    container = registry["containers"][0]
    before = copy.deepcopy(registry)
    del before["securityContext"]["runAsUser"]
    assert "non-numeric user (pdreg)" in run_as_non_root_errors(before, container, "pdreg")[0]
    assert run_as_non_root_errors(before, container, "") != []  # no USER: root
    assert run_as_non_root_errors(before, container, "10001:10001") == []
    root = copy.deepcopy(container)
    root.setdefault("securityContext", {})["runAsUser"] = 0
    assert run_as_non_root_errors(registry, root, "10001:10001") != []
    assert hardening_errors(registry, root, 10001, 10001) != []
    unreadable = copy.deepcopy(registry)
    unreadable["volumes"][0]["secret"]["defaultMode"] = 0o400
    assert unreadable_files(unreadable, container, 10001) != []
    del unreadable["securityContext"]["fsGroup"]
    unreadable["volumes"][0]["secret"]["defaultMode"] = 0o440
    assert unreadable_files(unreadable, container, 10001) != []


# --- command lines, ports and probes ---------------------------------------------------


@overlays
def test_pdreg_command_lines_parse_and_are_reachable(overlay: str) -> None:
    processes = k8s_processes(overlay)
    assert sorted(p.kind for p in processes) == ["agent", "agent", "registry", "router"]
    for process in processes:
        args = process.parse()
        if process.kind in ("registry", "router"):
            assert args.host == "0.0.0.0", f"{process.where}: bind all interfaces"
        if process.kind != "registry":
            assert args.advertise_host == "$(POD_IP)", process.where
            assert args.registry is None, f"{process.where}: the registry comes from the env"


def _listening(container: dict[str, Any]) -> set[int]:
    if is_pdreg(container):
        argv = container_argv(container)
        return listening_ports(argv[0], build_parser().parse_args(argv))
    ports = {int(flag(container["args"], "--port"))}
    if "--disaggregation-bootstrap-port" in container["args"]:
        ports.add(int(flag(container["args"], "--disaggregation-bootstrap-port")))
    nixl = env_of(container).get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if nixl:
        ports.add(int(nixl))
    return ports


def _named_ports(pod: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for c in pod["containers"]
            for port in c.get("ports", [])}


def _probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return named[port] if isinstance(port, str) else port


@overlays
def test_ports_probes_and_scrape_annotations_agree(overlay: str) -> None:
    for deployment in workloads(overlay):
        where = deployment["metadata"]["name"]
        pod = pod_spec(deployment)
        http_ports: set[int] = set()
        for container in pod["containers"]:
            if container["image"].startswith("prom/prometheus"):
                continue
            listening = _listening(container)
            declared = {port["containerPort"] for port in container.get("ports", [])}
            assert declared == listening, f"{where}/{container['name']}: containerPorts"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in container:
                    probe = container[kind]
                    assert _probe_port(container, probe) in listening, f"{where}: {kind}"
                    assert 1 <= probe["timeoutSeconds"] < probe["periodSeconds"], \
                        f"{where}/{container['name']}: {kind} needs a timeout below its period"
            if is_pdreg(container):
                argv = container_argv(container)
                if argv[0] != "agent":
                    http_ports.add(http_port(argv[0], build_parser().parse_args(argv)))
                for value in [*argv, *(str(v) for v in env_of(container).values())]:
                    for var in re.findall(r"\$\((\w+)\)", value):
                        assert var in env_of(container), f"{where}: $({var}) is not defined"
            else:
                http_ports.add(int(flag(container["args"], "--port")))
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if where != "pdreg-prometheus":
            assert annotations["prometheus.io/scrape"] == "true", where
            assert int(annotations["prometheus.io/port"]) in http_ports, where


@overlays
def test_liveness_and_readiness_endpoints(overlay: str) -> None:
    deployments = by_name(render(K8S / overlay), "Deployment")
    [registry] = pod_spec(deployments["pdreg-registry"])["containers"]
    # /healthz answers 503 when the registry's loop stalls: liveness restarts it.
    assert registry["livenessProbe"]["httpGet"]["path"] == "/healthz"
    [router] = pod_spec(deployments["pdreg-router"])["containers"]
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"


@overlays
def test_services_reach_listening_ports(overlay: str) -> None:
    docs = render(K8S / overlay)
    deployments = objects(docs, "Deployment")
    services = by_name(docs, "Service")
    assert services.keys() == {"pdreg-registry", "pdreg-router", "pdreg-prometheus"}
    for name, service in services.items():
        [pod] = [pod_spec(d) for d in deployments
                 if selector_matches({"matchLabels": service["spec"]["selector"]},
                                     pod_labels(d))]
        named = _named_ports(pod)
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, f"{name}: {port}"

    # PDREG_REGISTRY names the registry Service's control port, which reaches --port.
    registry_args = next(p for p in k8s_processes(overlay) if p.kind == "registry").parse()
    registry_pod = pod_spec(by_name(docs, "Deployment")["pdreg-registry"])
    service_ports = {p["port"]: _named_ports(registry_pod)[p["targetPort"]]
                     for p in services["pdreg-registry"]["spec"]["ports"]}
    assert set(service_ports.values()) == listening_ports("registry", registry_args)
    clients = [c for _, c in pdreg_containers(overlay) if c["args"][0] != "registry"]
    assert len(clients) == 3  # router + 2 sidecars
    for container in clients:
        host, port = env_of(container)["PDREG_REGISTRY"].split(":")
        assert host == "pdreg-registry"
        assert service_ports[int(port)] == registry_args.port


# --- credentials ------------------------------------------------------------------------

SECRETS = K8S / "secrets"


def _secret_keys() -> dict[str, set[str]]:
    """Secret name -> keys, from deploy/k8s/secrets/kustomization.yaml's generators."""
    kustomization = load_yaml(SECRETS / "kustomization.yaml")[0]
    keys = {}
    for generator in kustomization["secretGenerator"]:
        keys[generator["name"]] = {entry.partition("=")[0] if "=" in entry
                                   else Path(entry).name for entry in generator["files"]}
    return keys


def _mounted_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key), for every Secret file mounted."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret:
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
            assert key in keys[secret], f"{container['name']}: {secret}/{key} is not generated"
        argv = container_argv(container)
        args = build_parser().parse_args(argv)
        for attribute, key in CREDENTIALS[argv[0]].items():
            path = getattr(args, attribute)
            assert files.get(path, (None, None))[1] == key, f"{argv[0]}: {attribute}={path}"
        if argv[0] == "registry":
            allowed = {p.rpartition("/")[0]: k for p, (_, k) in files.items()}
            assert allowed[args.allowed_clients] == "client.key"
        else:
            env = env_of(container)
            assert files[env["PDREG_REGISTRY_PUBLIC_KEY"]][1] == "registry.key"
            assert files[env["PDREG_CURVE_KEY"]][1] == "client.key_secret"
        # Nothing a process does not need: the router never sees the admin token.
        mounted = {key for _, key in files.values()}
        needed = set(CREDENTIALS[argv[0]].values()) | (
            {"client.key"} if argv[0] == "registry" else {"registry.key", "client.key_secret"})
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
    assert {d["metadata"]["namespace"] for d in docs} == {NAMESPACE}


# --- NetworkPolicy ----------------------------------------------------------------------


def _pods(overlay: str) -> dict[str, Pod]:
    docs = render(K8S / overlay)
    pods = {d["metadata"]["name"]: Pod(NAMESPACE, pod_labels(d), _named_ports(pod_spec(d)))
            for d in objects(docs, "Deployment")}
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
    expected = {  # (target, port): who may connect
        ("pdreg-registry", registry.ports["control"]): {prefill, decode, "pdreg-router",
                                                        "planner"},
        ("pdreg-registry", registry.ports["events"]): {"pdreg-router", "planner"},
        ("pdreg-registry", registry.ports["http"]): {"operator", "pdreg-prometheus"},
        ("pdreg-router", router.ports["http"]): set(pods),
        (decode, engine.ports["http"]): {"pdreg-router", "pdreg-prometheus", prefill, decode},
        # KV transfer: NIXL's side channel, SGLang's bootstrap, Mooncake's data ports
        (decode, 5600): {prefill, decode},
        (prefill, 8998): {prefill, decode},
        (decode, 17000): {prefill, decode},
        ("pdreg-prometheus", pods["pdreg-prometheus"].ports["http"]): {"operator"},
    }
    for (target, port), allowed in expected.items():
        got = {name for name, source in pods.items()
               if ingress_allowed(policies, source, pods[target], port)}
        assert got == allowed, f"{target}:{port}"
    # Every pod of the fleet is selected by a policy: none is open by omission.
    for name in ("pdreg-registry", "pdreg-router", prefill, decode, "pdreg-prometheus"):
        assert not ingress_allowed(policies, pods["stranger"], pods[name], 1), name


# --- disruptions, placement, resources -------------------------------------------------


@overlays
def test_one_disruption_budget_per_role(overlay: str) -> None:
    docs = render(K8S / overlay)
    budgets = objects(docs, "PodDisruptionBudget")
    for deployment in objects(docs, "Deployment"):
        name = deployment["metadata"]["name"]
        matching = [b["metadata"]["name"] for b in budgets
                    if selector_matches(b["spec"]["selector"], pod_labels(deployment))]
        if name in ("pdreg-registry", "pdreg-prometheus"):
            assert matching == [], f"{name}: a budget on one replica blocks node drains"
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


@overlays
def test_engine_pods_have_gpu_shared_memory_and_the_model_cache(overlay: str) -> None:
    docs = render(K8S / overlay)
    claims = by_name(docs, "PersistentVolumeClaim")
    for role in ("prefill", "decode"):
        pod = pod_spec(engine_deployment(overlay, role))
        server, _ = engine_pair(overlay, role)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in server["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        cache = mounts["/models"]["persistentVolumeClaim"]["claimName"]
        assert cache in claims
        assert env_of(server)["HF_HOME"].startswith("/models/")
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for deployment in objects(docs, "Deployment"):
        for container in pod_spec(deployment)["containers"]:
            resources = container["resources"]
            assert resources["requests"]["cpu"] and resources["requests"]["memory"]
            assert resources["limits"]["memory"], container["name"]


# --- drain and locality -----------------------------------------------------------------


@overlays
def test_router_drains_within_its_grace_period(overlay: str) -> None:
    deployment = by_name(render(K8S / overlay), "Deployment")["pdreg-router"]
    pod = pod_spec(deployment)
    [router] = pod["containers"]
    args = build_parser().parse_args(container_argv(router))
    # SIGTERM starts the drain itself; a preStop sleep would only add to --drain-delay.
    assert "lifecycle" not in router
    assert args.drain_delay + args.drain_timeout < pod["terminationGracePeriodSeconds"]
    assert args.locality_label == "node"


@overlays
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_pod_wires_sidecar_to_engine(overlay: str, role: str) -> None:
    pod = pod_spec(engine_deployment(overlay, role))
    server, sidecar = engine_pair(overlay, role)
    argv = container_argv(sidecar)
    args = build_parser().parse_args(argv)
    assert (argv[0], args.engine, args.role) == ("agent", ENGINES[overlay], role)
    engine_url = urlsplit(args.engine_url)
    assert engine_url.hostname == "127.0.0.1"
    assert engine_url.port == int(flag(server["args"], "--port"))
    assert flag(server["args"], "--host") == "0.0.0.0"
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env_of(sidecar)["POD_IP"] == pod_ip
    # Locality: every engine carries its node, which the routers pair on.
    assert dict(args.labels) == {"node": "$(NODE_NAME)"}
    assert env_of(sidecar)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}

    if overlay == "vllm":
        kv = json.loads(flag(server["args"], "--kv-transfer-config"))
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        env = env_of(server)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert args.kv_port == int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    else:
        assert flag(server["args"], "--disaggregation-mode") == role
        assert "--enable-metrics" in server["args"]  # the sidecar reads load from /metrics
        assert env_of(server)["SGLANG_HOST_IP"] == "$(POD_IP)"
        if role == "prefill":
            assert args.bootstrap_port == int(
                flag(server["args"], "--disaggregation-bootstrap-port"))

    # Drain: the sidecar drains on SIGTERM; the engine's preStop waits for idle past the
    # sidecar's drain timeout, and the pod's grace period covers both.
    hook = server["lifecycle"]["preStop"]["exec"]["command"]
    wait_s = float(hook[3])
    assert hook[2] == f"http://127.0.0.1:{engine_url.port}/metrics"
    assert args.drain_timeout < wait_s < pod["terminationGracePeriodSeconds"]
    assert "lifecycle" not in sidecar, "the sidecar drains on SIGTERM itself"
    # ...on the same gauges the sidecar drains on.
    gauges = {"vllm": VLLM_GAUGES, "sglang": SGLANG_GAUGES}[overlay]
    assert hook[5:] == [gauges.running[0], gauges.waiting[0]]


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
