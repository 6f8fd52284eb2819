"""The registries' etcd as deploy/ ships it: three members on Kubernetes that find each
other and that the registries name, placed so that one node's loss keeps the majority;
the external-etcd and etcd-user components as an operator's overlay renders them (and a
registry on those flags reaching a real etcd over TLS); Compose's one etcd.

Rendered by kubectl's own kustomize; the store URL parsed by pdreg's own parser. The
NetworkPolicy for etcd's ports: tests/test_deploy_k8s_ops.py. The members run from the
rendered manifests: `make test-cluster`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_policy import selector_matches
from deploy_support import (
    COMPOSE_ENV,
    COMPOSE_FILE,
    DEPLOY,
    K8S,
    KUBERNETES_VERSIONS,
    Processes,
    by_name,
    env_of,
    flag,
    image_name,
    overlays,
    pod_labels,
    pod_spec,
    render,
    run_tool,
    tool,
    workloads_by_name,
)
from etcd_process import EtcdProcess, make_certificates, requires_etcd

from pdreg.cli import build_parser
from pdreg.testing import free_low_port, wait_until
from registry.store.url import StoreKind, parse_store_url

ETCD = "pdreg-etcd"
TWO_REGISTRIES = DEPLOY / "docker-compose.two-registries.yml"
EXTERNAL_STORE = "etcd://etcd-a.example:2379,etcd-b.example:2379,etcd-c.example:2379/fleet-a"


def _etcd(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the etcd StatefulSet, its container)."""
    members = workloads_by_name(docs)[ETCD]
    [container] = pod_spec(members)["containers"]
    return members, container


def _registry(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = pod_spec(workloads_by_name(docs)["pdreg-registry"])["containers"]
    return container


def _config_value(docs: list[dict[str, Any]], container: dict[str, Any], name: str) -> str:
    """An env var of CONTAINER that comes from a rendered ConfigMap, by its value there."""
    ref = env_of(container)[name]["configMapKeyRef"]
    return str(by_name(docs, "ConfigMap")[ref["name"]]["data"][ref["key"]])


def _store_args(docs: list[dict[str, Any]]) -> Any:
    """The registry's command line parsed by pdreg, $(PDREG_STORE) as its ConfigMap says."""
    registry = _registry(docs)
    store = _config_value(docs, registry, "PDREG_STORE")
    argv = [store if arg == "$(PDREG_STORE)" else str(arg) for arg in registry["args"]]
    return build_parser().parse_args(argv)


@overlays
def test_members_name_each_other_and_the_registries_name_every_member(overlay: str) -> None:
    docs = render(K8S / overlay)
    members, etcd = _etcd(docs)
    replicas = members["spec"]["replicas"]
    assert replicas == 3  # one may be lost, two still agree
    # All at once: each waits for a majority before it is ready.
    assert members["spec"]["podManagementPolicy"] == "Parallel"
    service = by_name(docs, "Service")[members["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # peers resolve before ready
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels(members))
    assert env_of(etcd)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    args = etcd["args"]
    assert flag(args, "--name") == "$(POD_NAME)"
    ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    dns = f"$(POD_NAME).{service['metadata']['name']}"
    assert flag(args, "--initial-advertise-peer-urls") == f"http://{dns}:{ports['peer']}"
    assert flag(args, "--advertise-client-urls") == f"http://{dns}:{ports['client']}"
    for kind in ("client", "peer", "metrics"):
        assert flag(args, f"--listen-{kind}-urls") == f"http://0.0.0.0:{ports[kind]}"
    names = [f"{ETCD}-{i}" for i in range(replicas)]
    assert flag(args, "--initial-cluster") == ",".join(
        f"{name}=http://{name}.{ETCD}:{ports['peer']}" for name in names)
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)

    # Every registry on the same store: each member by its stable name, at the client port.
    store_args = _store_args(docs)
    store = parse_store_url(store_args.store)
    assert store.kind is StoreKind.ETCD
    assert list(store.endpoints) == [f"{name}.{ETCD}:{ports['client']}" for name in names]
    assert store.prefix == "pdreg"
    # The replica set names each registry by its pod and the address clients reach it by.
    assert store_args.registry_id == "$(POD_NAME)"
    assert store_args.advertise_host == "$(POD_NAME).pdreg-registry"
    assert env_of(_registry(docs))["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@overlays
def test_members_survive_a_node_a_drain_and_a_restart(overlay: str) -> None:
    members, etcd = _etcd(render(K8S / overlay))
    spec = pod_spec(members)
    spread = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    # Never two members on one node (one node's loss would take the majority); zones
    # preferred, so a cluster without zone labels still schedules.
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    for constraint in spread.values():
        assert constraint["maxSkew"] == 1
        assert selector_matches(constraint["labelSelector"], pod_labels(members))
    # The data on a claim of its own per member, under the mount the data dir is in.
    [claim] = members["spec"]["volumeClaimTemplates"]
    [mount] = etcd["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"]
    assert flag(etcd["args"], "--data-dir").startswith(mount["mountPath"] + "/")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    # The database's own cap stays below the claim (etcd alarms at it, not the disk).
    quota = int(flag(etcd["args"], "--quota-backend-bytes"))
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and quota < int(size[:-2]) * 2**30
    # Probes on the metrics port (never the client port, which serves the keys). The
    # liveness probe asks this member alone: a lost majority restarts nobody.
    ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert etcd[kind]["httpGet"]["port"] == "metrics", kind
    assert etcd["readinessProbe"]["httpGet"]["path"] == "/health"
    assert etcd["livenessProbe"]["httpGet"]["path"] == "/health?serializable=true"
    annotations = members["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert etcd["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "memory" in etcd["resources"]["limits"]
    # Its own version, pinned (deploy/k8s/images): 3.5.3+ serves ?serializable=true.
    version = etcd["image"].rsplit(":", 1)[1]
    assert image_name(etcd["image"]) == "etcd"
    assert tuple(int(n) for n in version.lstrip("v").split(".")) >= (3, 5, 3), version


def _operator_overlay(tmp_path: Path, *components: str, store: str | None) -> Path:
    """An operator's overlay of the vLLM fleet with COMPONENTS, and the ConfigMap the
    external component asks for unless STORE is None."""
    root = tmp_path / "overlay"
    root.mkdir()
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "vllm", root)],
        "components": [os.path.relpath(K8S / c, root) for c in components]}
    if store is not None:
        kustomization["configMapGenerator"] = [{
            "name": "pdreg-etcd-external", "options": {"disableNameSuffixHash": True},
            "literals": [f"PDREG_STORE={store}"]}]
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return root


def _mounted(container: dict[str, Any], pod: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in CONTAINER -> (Secret, key) of each Secret item mounted."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    files = {}
    for mount in container["volumeMounts"]:
        secret = volumes.get(mount["name"], {}).get("secret")
        for item in (secret or {}).get("items", []):
            files[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    return files


def test_external_etcd_replaces_the_members_and_talks_tls(tmp_path: Path) -> None:
    docs = render(_operator_overlay(tmp_path, "etcd-external", "etcd-auth",
                                    store=EXTERNAL_STORE))
    # Nothing of the in-cluster etcd is left, not even its address.
    leftovers = [f"{d['kind']}/{d['metadata']['name']}" for d in docs
                 if d["metadata"]["name"] == ETCD or d["metadata"]["name"].startswith(
                     "pdreg-store")]
    assert leftovers == []
    args = _store_args(docs)
    assert args.store == EXTERNAL_STORE
    registries = workloads_by_name(docs)["pdreg-registry"]
    files = _mounted(_registry(docs), pod_spec(registries))
    # TLS from the Secret's three keys; the password from a file, the user from the Secret.
    assert files[args.store_ca] == ("pdreg-etcd-client", "ca.crt")
    assert files[args.store_cert] == ("pdreg-etcd-client", "tls.crt")
    assert files[args.store_key] == ("pdreg-etcd-client", "tls.key")
    assert files[args.store_password_file] == ("pdreg-etcd-auth", "password")
    assert args.store_user == "$(PDREG_STORE_USER)"
    assert env_of(_registry(docs))["PDREG_STORE_USER"] == {
        "secretKeyRef": {"name": "pdreg-etcd-auth", "key": "user"}}
    result = run_tool([tool("kubernetes-validate"), "--strict", "--quiet",
                       "--kubernetes-version", KUBERNETES_VERSIONS[-1],
                       _written(tmp_path / "external.yaml", docs)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_external_etcd_without_its_address_starts_no_registry(tmp_path: Path) -> None:
    """Left out, the ConfigMap is missing from the rendering: the kubelet refuses to
    start the registries (CreateContainerConfigError) rather than run them against an
    etcd nobody chose."""
    docs = render(_operator_overlay(tmp_path, "etcd-external", store=None))
    ref = env_of(_registry(docs))["PDREG_STORE"]["configMapKeyRef"]
    assert ref["name"] not in by_name(docs, "ConfigMap")
    assert not ref.get("optional")


def _written(path: Path, docs: list[dict[str, Any]]) -> str:
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


@requires_etcd
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_a_registry_on_the_external_components_flags_reaches_etcd_over_tls(
        tmp_path: Path) -> None:
    """The rendered --store-* flags, with the Secret's files where the pod mounts them,
    against a real etcd that requires a client certificate."""
    docs = render(_operator_overlay(tmp_path, "etcd-external", store=EXTERNAL_STORE))
    registry = _registry(docs)
    files = _mounted(registry, pod_spec(workloads_by_name(docs)["pdreg-registry"]))
    certificates = make_certificates(tmp_path)
    secret = {"ca.crt": certificates["ca"], "tls.crt": certificates["client"],
              "tls.key": certificates["client_key"]}
    etcd = EtcdProcess(tmp_path / "data")
    etcd.scheme = "https"
    etcd.start("--cert-file", str(certificates["server"]), "--key-file",
               str(certificates["server_key"]), "--trusted-ca-file", str(certificates["ca"]),
               "--client-cert-auth")
    store_flags = []
    for arg in registry["args"]:
        match = re.fullmatch(r"(--store-(?:ca|cert|key))=(\S+)", str(arg))
        if match:
            store_flags.append(f"{match.group(1)}={secret[files[match.group(2)][1]]}")
    assert len(store_flags) == 3
    http = free_low_port(avoid={etcd.client_port, etcd.peer_port})
    processes = Processes(tmp_path)
    try:
        processes.start("registry", [
            "registry", "--port", "0", "--events-port", "0", "--http-port", str(http),
            "--store", f"etcd://{etcd.endpoint}/fleet-a", "--registry-id", "pdreg-registry-0",
            *store_flags], {})

        def in_replica_set() -> bool:
            processes.check_alive()
            try:
                response = httpx.get(f"http://127.0.0.1:{http}/v1/registries", timeout=2)
            except httpx.HTTPError:
                return False
            # Anything but the list (a store not reached yet answers 503) is not there yet.
            entries = response.json() if response.status_code == 200 else []
            return [e["id"] for e in entries] == ["pdreg-registry-0"]
        assert wait_until(in_replica_set, 60.0), processes.log("registry")
    finally:
        processes.stop()
        etcd.stop()


def _compose_two_registries() -> dict[str, Any]:
    result = run_tool([tool("docker-compose"), "-f", str(COMPOSE_FILE), "-f",
                       str(TWO_REGISTRIES), "config"],
                      env={"PATH": "/usr/bin:/bin", **COMPOSE_ENV}, cwd=DEPLOY)
    assert result.returncode == 0, result.stderr
    return dict(yaml.safe_load(result.stdout)["services"])


def test_compose_two_registries_share_one_etcd() -> None:
    services = _compose_two_registries()
    etcd = services["etcd"]
    command = [str(a) for a in etcd["command"]]
    assert Path(command[0]).name == "etcd"
    client_port = int(flag(command, "--listen-client-urls").rsplit(":", 1)[1])
    assert flag(command, "--advertise-client-urls") == f"http://etcd:{client_port}"
    assert "ports" not in etcd  # the registries' only, on the compose network
    assert str(client_port) in " ".join(etcd["healthcheck"]["test"])
    # Its version is the one the Kubernetes manifests pin.
    [pinned] = [c["image"] for d in render(K8S / "vllm")
                if d["kind"] == "StatefulSet" and d["metadata"]["name"] == ETCD
                for c in pod_spec(d)["containers"]]
    assert etcd["image"] == pinned
    ids = set()
    for name in ("registry", "registry-2"):
        service = services[name]
        store = parse_store_url(service["environment"]["PDREG_STORE"])
        assert store.kind is StoreKind.ETCD, name
        assert list(store.endpoints) == [f"etcd:{client_port}"], name
        assert service["depends_on"]["etcd"]["condition"] == "service_healthy", name
        args = build_parser().parse_args([str(a) for a in service["command"]])
        assert args.advertise_host == name  # as its clients reach it
        ids.add(args.registry_id)
    assert ids == {"registry", "registry-2"}
