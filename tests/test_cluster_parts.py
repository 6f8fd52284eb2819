"""The parts `make test-cluster` is built of (tests/cluster/), each held to what it plays:
KEDA's and the HPA's arithmetic and fallback (tables), the connection audit (it must
refuse what the NetworkPolicies drop), and the kubelet's reading of the rendered pod
templates (commands, env, DNS, mounts) on the real renderings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from deploy_policy import Pod as PolicyPod
from deploy_support import DEPLOY, K8S, generate_secrets, objects, render

sys.path.insert(0, str(Path(__file__).parent / "cluster"))

from keda import ScaledObject, fallback_replicas, hpa_replicas
from kubelet import POD_NETWORK, Kubelet
from netaudit import Peer, audit, connections_in

# --- KEDA and the HPA ---------------------------------------------------------------


@pytest.mark.parametrize(("value", "current", "expected"), [
    (3.0, 1, 3),  # AverageValue, threshold 1: the planner's count itself
    (1.0, 3, 1),
    (2.0, 2, 2),
    (10.5, 10, 10),  # within the HPA's 10% of the current count: no change
    (12.0, 10, 12),
    (0.0, 2, 0),  # clamped to minReplicaCount by the caller
])
def test_hpa_average_value(value: float, current: int, expected: int) -> None:
    assert hpa_replicas(value, 1.0, current) == expected


@pytest.mark.parametrize(("behavior", "current", "expected"), [
    ("static", 6, 2), ("currentReplicas", 6, 6), ("currentReplicasIfHigher", 6, 6),
    ("currentReplicasIfHigher", 1, 2), ("currentReplicasIfLower", 6, 2),
    ("currentReplicasIfLower", 1, 1),
])
def test_fallback_behaviors(behavior: str, current: int, expected: int) -> None:
    assert fallback_replicas(behavior, 2, current) == expected


def _scaled_object(behavior: str | None) -> ScaledObject:
    [obj] = [o for o in objects(render(DEPLOY / "keda"), "ScaledObject")
             if o["spec"]["scaleTargetRef"]["name"] == "vllm-decode"]
    if behavior is None:
        del obj["spec"]["fallback"]["behavior"]
    return ScaledObject.from_manifest(obj)


@pytest.mark.parametrize(("behavior", "after_outage"), [
    ("currentReplicas", 5),  # as shipped: the fleet stays as it is
    (None, 2),  # KEDA's default, static: the fixed count, whatever the load
])
def test_an_outage_keeps_the_count_until_the_fallback_then_applies_it(
        behavior: str | None, after_outage: int) -> None:
    obj = _scaled_object(behavior)
    assert obj.poll(1, lambda server, query: 5.0) == (5, "5")
    assert obj.failure_threshold == 3

    def down(server: str, query: str) -> float:
        raise OSError("connection refused")
    counts = [obj.poll(5, down)[0] for _ in range(4)]
    # KEDA falls back once the failures in a row exceed the threshold: the fourth.
    assert counts == [5, 5, 5, after_outage]
    assert obj.poll(after_outage, lambda server, query: None)[0] == after_outage
    assert obj.poll(after_outage, lambda server, query: 3.0) == (3, "3")


# --- the connection audit -------------------------------------------------------------

TRACE = """\
101 connect(7, {sa_family=AF_INET, sin_port=htons(7600), sin_addr=inet_addr("127.77.0.2")}, 16) = 0
101 connect(8, {sa_family=AF_UNIX, sun_path="/run/x"}, 110) = 0
102 connect(9, {sa_family=AF_INET6, sin6_port=htons(8000), sin6_flowinfo=htonl(0), \
inet_pton(AF_INET6, "fd00::5", &sin6_addr), sin6_scope_id=0}, 28) = -1 EINPROGRESS
102 +++ exited with 0 +++
"""


def test_connections_are_read_from_strace_output(tmp_path: Path) -> None:
    trace = tmp_path / "x.strace"
    trace.write_text(TRACE)
    assert connections_in(trace) == [("127.77.0.2", 7600), ("fd00::5", 8000)]


def test_the_audit_refuses_what_the_policies_drop() -> None:
    docs = render(K8S / "vllm")
    policies = objects(docs, "NetworkPolicy")
    pods = {}
    for kind in ("Deployment", "StatefulSet"):
        for d in objects(docs, kind):
            template = d["spec"]["template"]
            ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                     for p in c.get("ports", [])}
            pods[d["metadata"]["name"]] = Peer(d["metadata"]["name"], PolicyPod(
                "pdreg", template["metadata"]["labels"], ports), f"10.0.0.{len(pods) + 1}")
    by_ip = {p.ip: p for p in pods.values()}
    router, engine, registry = pods["pdreg-router"], pods["vllm-decode"], pods["pdreg-registry"]
    made = [(router, engine.ip, 8000),  # routing: allowed
            (engine, registry.ip, 7600),  # registering: allowed
            (engine, registry.ip, 7680),  # an engine at the admin port: dropped
            (engine, engine.ip, 9999),  # within the pod
            (router, "192.0.2.9", 443)]  # no pod there
    result = audit(policies, made, by_ip.get)
    assert not result.ok
    assert dict(result.denied) == {("vllm-decode", "pdreg-registry", "http"): 1}
    assert set(result.allowed) == {("pdreg-router", "vllm-decode", "http"),
                                   ("vllm-decode", "pdreg-registry", "control")}
    assert dict(result.outside) == {("pdreg-router", "192.0.2.9:443"): 1}
    assert "DENIED   vllm-decode -> pdreg-registry:http" in result.report()


# --- the kubelet ------------------------------------------------------------------


def test_pods_run_the_rendered_commands_with_the_pod_network_and_cluster_dns(
        tmp_path: Path) -> None:
    _, secrets = generate_secrets(tmp_path / "credentials")
    docs = render(K8S / "vllm")
    kubelet = Kubelet(docs, tmp_path / "run", secrets, {"vllm-openai": lambda *a: ["true"]})
    registries = [kubelet.new_pod("pdreg-registry", i) for i in range(2)]
    router = kubelet.new_pod("pdreg-router")
    engine = kubelet.new_pod("vllm-decode")
    assert {p.ip for p in (*registries, router, engine)} <= {
        str(h) for h in POD_NETWORK.hosts()}
    [registry_argv] = [c.argv for c in registries[0].containers]
    assert registry_argv[registry_argv.index("--host") + 1] == registries[0].ip
    allowed = Path(registry_argv[registry_argv.index("--allowed-clients") + 1])
    assert sorted(p.name for p in allowed.iterdir()) == ["client.key"]

    [container] = router.containers
    argv, env = container.argv, container.env
    # $(POD_CIDRS) from the rendered ConfigMap, $(POD_IP) from the downward API.
    cidrs = next(d for d in objects(docs, "ConfigMap")
                 if d["metadata"]["name"].startswith("pdreg-network"))["data"]["POD_CIDRS"]
    assert argv[argv.index("--allow-upstream") + 1] == cidrs
    assert argv[argv.index("--advertise-host") + 1] == router.ip
    # Both registries by their StatefulSet names, resolved to their pods' addresses.
    assert env["PDREG_REGISTRY"] == ",".join(f"{p.ip}:7600" for p in registries)
    assert Path(env["PDREG_CURVE_KEY"]).read_bytes() == secrets["pdreg-curve"][
        "client.key_secret"]
    assert container.ready_url == f"http://{router.ip}:8000/ready"

    sidecar = next(c for c in engine.containers if c.name == "pdreg-agent")
    # The sidecar reaches its engine at 127.0.0.1: in its pod, that is the pod's address.
    assert sidecar.argv[sidecar.argv.index("--engine-url") + 1] == f"http://{engine.ip}:8000"
    server = next(c for c in engine.containers if c.name == "vllm")
    assert server.argv[-1] == "true" and server.pre_stop is not None
    assert f"http://{engine.ip}:8000/metrics" in server.pre_stop
    assert kubelet.resolve("pdreg-registry-1.pdreg-registry.pdreg.svc.cluster.local") == \
        registries[1].ip
    assert kubelet.resolve("nowhere") is None
