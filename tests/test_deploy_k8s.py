"""deploy/k8s as an operator gets it: each overlay rendered by kubectl's own kustomize,
validated against the Kubernetes schemas (kubernetes-validate --strict, 1.30 and 1.37),
held to the kubelet's runAsNonRoot rule, Pod Security "restricted" for pdreg's
containers, NetworkPolicy semantics and the drain timings, with every `pdreg` command
line parsed by pdreg's own CLI. No cluster: what needs one is listed in deploy/README.md.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_policy import (
    hardening_errors,
    run_as_non_root_errors,
    selector_matches,
    unreadable_files,
)
from deploy_support import (
    DEPLOY,
    K8S,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    by_name,
    container_argv,
    engine_deployment,
    engine_pair,
    env_of,
    env_value,
    flag,
    http_port,
    image_name,
    image_user,
    image_user_spec,
    is_pdreg,
    k8s_processes,
    listening_ports,
    load_yaml,
    metrics_port,
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

from engine_agent.probes import SGLANG_GAUGES, VLLM_GAUGES
from pdreg.cli import build_parser
from router.guard import parse_networks

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
    # One PersistentVolumeClaim, the model cache, and the Job that fills it.
    assert kinds == ["ConfigMap", "Deployment", "Job", "Namespace", "NetworkPolicy",
                     "PersistentVolumeClaim", "PodDisruptionBudget", "Role", "RoleBinding",
                     "Service", "ServiceAccount", "StatefulSet"]
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
        "pdreg-etcd", "pdreg-registry", "pdreg-router", "pdreg-prometheus",
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
    registry = pod_spec(workloads_by_name(render(K8S / "vllm"))["pdreg-registry"])
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


def _etcd_listening(args: list[str]) -> dict[str, int]:
    """The ports an etcd member binds, by its --listen-{client,peer,metrics}-urls flags
    (one URL each): {"client": 2379, "peer": 2380, "metrics": 2381}."""
    return {kind: int(flag(args, f"--listen-{kind}-urls").rsplit(":", 1)[1])
            for kind in ("client", "peer", "metrics")}


def _listening(container: dict[str, Any]) -> set[int]:
    if is_pdreg(container):
        argv = container_argv(container)
        return listening_ports(argv[0], build_parser().parse_args(argv))
    if image_name(container["image"]) == "etcd":
        return set(_etcd_listening(container["args"]).values())
    ports = {int(flag(container["args"], "--port"))}
    if "--disaggregation-bootstrap-port" in container["args"]:
        ports.add(int(flag(container["args"], "--disaggregation-bootstrap-port")))
    nixl = env_of(container).get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if nixl:
        ports.add(int(nixl))
    return ports


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
                    args = build_parser().parse_args(argv)
                    http_ports |= {http_port(argv[0], args), metrics_port(argv[0], args)}
                for value in [*argv, *(str(v) for v in env_of(container).values())]:
                    for var in re.findall(r"\$\((\w+)\)", value):
                        assert var in env_of(container), f"{where}: $({var}) is not defined"
            elif image_name(container["image"]) == "etcd":
                http_ports.add(_etcd_listening(container["args"])["metrics"])
            else:
                http_ports.add(int(flag(container["args"], "--port")))
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if where != "pdreg-prometheus":
            assert annotations["prometheus.io/scrape"] == "true", where
            assert int(annotations["prometheus.io/port"]) in http_ports, where


@overlays
def test_liveness_and_readiness_endpoints(overlay: str) -> None:
    deployments = workloads_by_name(render(K8S / overlay))
    [registry] = pod_spec(deployments["pdreg-registry"])["containers"]
    # /healthz answers 503 when the registry's loop stalls: liveness restarts it.
    assert registry["livenessProbe"]["httpGet"]["path"] == "/healthz"
    [router] = pod_spec(deployments["pdreg-router"])["containers"]
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"


@overlays
def test_services_reach_listening_ports(overlay: str) -> None:
    docs = render(K8S / overlay)
    deployments = list(workloads_by_name(docs).values())
    services = by_name(docs, "Service")
    assert services.keys() == {"pdreg-registry", "pdreg-registry-http", "pdreg-router",
                               "pdreg-prometheus", "pdreg-etcd"}
    for name, service in services.items():
        [pod] = [pod_spec(d) for d in deployments
                 if selector_matches({"matchLabels": service["spec"]["selector"]},
                                     pod_labels(d))]
        named = named_ports(pod)
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, f"{name}: {port}"

    # PDREG_REGISTRY names every registry pod by its stable DNS name (the StatefulSet's
    # headless Service) at the control port, which reaches --port; the same one value
    # for every client.
    registry_args = next(p for p in k8s_processes(overlay) if p.kind == "registry").parse()
    registries = workloads_by_name(docs)["pdreg-registry"]
    service = services["pdreg-registry"]
    assert registries["kind"] == "StatefulSet"
    assert registries["spec"]["serviceName"] == "pdreg-registry"
    assert service["spec"]["clusterIP"] == "None"  # a name per registry, none shared
    service_ports = {p["port"]: named_ports(pod_spec(registries))[p["targetPort"]]
                     for p in service["spec"]["ports"]}
    assert set(service_ports.values()) == listening_ports("registry", registry_args)
    want = [f"pdreg-registry-{i}.pdreg-registry" for i in range(registries["spec"]["replicas"])]
    assert len(want) == 2
    clients = [c for _, c in pdreg_containers(overlay) if c["args"][0] != "registry"]
    assert len(clients) == 3  # router + 2 sidecars
    values = {env_value(docs, c, "PDREG_REGISTRY") for c in clients}
    assert len(values) == 1, values  # one value, from one ConfigMap
    addresses = [address.rsplit(":", 1) for address in values.pop().split(",")]
    assert [host for host, _ in addresses] == want
    assert {service_ports[int(port)] for _, port in addresses} == {registry_args.port}


# --- drain and locality -----------------------------------------------------------------


def _router_networks(docs: list[dict[str, Any]]) -> tuple[str, str]:
    """(the ConfigMap the router's POD_CIDRS comes from, its value)."""
    [router] = pod_spec(by_name(docs, "Deployment")["pdreg-router"])["containers"]
    ref = env_of(router)["POD_CIDRS"]["configMapKeyRef"]
    assert router["args"][router["args"].index("--allow-upstream") + 1] == "$(POD_CIDRS)"
    return ref["name"], str(by_name(docs, "ConfigMap")[ref["name"]]["data"][ref["key"]])


@overlays
def test_allow_upstream_is_the_pod_network_one_parameter_sets(overlay: str,
                                                              tmp_path: Path) -> None:
    """--allow-upstream comes from POD_CIDRS (IPv4 and IPv6) in one ConfigMap, which an
    operator's overlay sets; its name carries the value's hash, so a change rolls the
    routers onto the new ranges."""
    docs = render(K8S / overlay)
    name, default = _router_networks(docs)
    networks = [ipaddress.ip_network(n) for n in parse_networks(default)]
    assert {n.version for n in networks} == {4, 6}
    # The usual pod pools are in it: RFC 1918, carrier-grade NAT, unique-local IPv6.
    for address in ("10.244.1.5", "100.64.3.2", "172.20.0.9", "192.168.7.1", "fd00:10:244::7"):
        assert any(ipaddress.ip_address(address) in n for n in networks), address
    assert build_parser().parse_args(container_argv(
        pod_spec(by_name(docs, "Deployment")["pdreg-router"])["containers"][0])
        ).allow_upstream == default

    copied = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copied, ignore=shutil.ignore_patterns(".env", "files"))
    mine = tmp_path / "my-cluster"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [f"../deploy/k8s/{overlay}"],
        "configMapGenerator": [{"name": "pdreg-network", "behavior": "merge",
                                "literals": ["POD_CIDRS=10.244.0.0/16,2001:db8:42::/56"]}]}))
    new_name, value = _router_networks(render(mine))
    assert value == "10.244.0.0/16,2001:db8:42::/56" and new_name != name


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
    assert (argv[0], args.engine, args.role) == ("agent", overlay, role)
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
        # GPU flags only: the CPU test's workarounds stay out of the manifests.
        assert not {"--device", "--disable-overlap-schedule", "--max-total-tokens",
                    "--disaggregation-decode-retraction-backup"} & set(server["args"])
        # /health runs a generation and takes at least a second (make test-sglang).
        assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert server["livenessProbe"]["timeoutSeconds"] >= 5
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
    # ...on the same condition the sidecar drains on: running, waiting, every hand-off
    # queue, and (where the engine counts them) open POST requests.
    gauges = {"vllm": VLLM_GAUGES, "sglang": SGLANG_GAUGES}[overlay]
    wanted = [gauges.running[0], gauges.waiting[0], *gauges.queued]
    if gauges.http_active:
        wanted.append(f'{gauges.http_active}{{method="POST"}}')
    assert hook[5:] == wanted
