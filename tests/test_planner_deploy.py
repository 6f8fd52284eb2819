"""deploy/keda, the production overlay, stays honest: rendered by kubectl's own kustomize
(the vLLM overlay plus the planner and the ScaledObjects), the planner's command line
parses with the real CLI, runs as the image's numeric user with the Secrets it reads,
listens where its probes and scrape annotations look, and may reach the registry and the
routers' metrics port under the NetworkPolicies; each ScaledObject scales a Deployment of
the same rendering on a gauge the planner really exposes, for that Deployment's model and
role, within the planner's own bounds, and falls back to the current replicas; Prometheus
keeps its data on a claim."""

from __future__ import annotations

import re
from typing import Any

from deploy_policy import (
    Pod,
    hardening_errors,
    ingress_allowed,
    run_as_non_root_errors,
    unreadable_files,
)
from deploy_support import (
    DEPLOY,
    NAMESPACE,
    by_name,
    image_user,
    image_user_spec,
    named_ports,
    pod_labels,
    pod_spec,
    render,
    workloads_by_name,
)

from pdreg.cli import build_parser
from pdreg.cmd_planner import config_from
from planner.metrics import PlannerMetrics
from planner.rule import Decision, Reason, RoleSignals
from wire.protocol import Role

QUERY = re.compile(r'^max\((\w+)\{model="([^"]+)",role="(\w+)"\}\)$')


def rendered() -> list[dict[str, Any]]:
    return render(DEPLOY / "keda")


def objects(kind: str) -> dict[str, dict[str, Any]]:
    return by_name(rendered(), kind)


def planner_container() -> dict[str, Any]:
    deployment = objects("Deployment")["pdreg-planner"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def planner_args() -> Any:
    return build_parser().parse_args(planner_container()["args"])


def test_planner_command_line_parses_and_listens_where_it_is_probed() -> None:
    args = planner_args()
    assert args.subcommand == "planner"
    config_from(args)  # every value is acceptable
    container = planner_container()
    deployment = objects("Deployment")["pdreg-planner"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.port
    assert annotations["prometheus.io/path"] == "/metrics"
    assert [p["containerPort"] for p in container["ports"]] == [args.port]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": args.port}
    service = objects("Service")["pdreg-planner"]
    assert service["spec"]["ports"][0]["targetPort"] == args.port


def test_scaled_objects_follow_the_planners_gauge_for_their_deployment() -> None:
    args = planner_args()
    metrics = PlannerMetrics(config_from(args).rule, 0.9)
    metrics.publish(Decision("m", Role.DECODE, 1, 1, 1, Reason.STEADY, "", 0.0),
                    RoleSignals(1))
    exposed = metrics.render().decode()
    deployments = objects("Deployment")
    scaled = objects("ScaledObject")
    assert scaled, "no ScaledObject in deploy/keda"
    for name, obj in scaled.items():
        target = deployments[obj["spec"]["scaleTargetRef"]["name"]]
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == "1"  # replicas = the gauge itself
        match = QUERY.match(trigger["metadata"]["query"])
        assert match, f"{name}: query {trigger['metadata']['query']!r}"
        metric, model, role = match.groups()
        assert f"\n{metric}{{" in exposed, f"{name}: the planner exposes no {metric}"
        containers = target["spec"]["template"]["spec"]["containers"]
        engine_args = [str(a) for c in containers for a in c.get("args", [])]
        assert model == engine_args[engine_args.index("--served-model-name") + 1], name
        agent = next(c for c in containers if c.get("args", [""])[0] == "agent")
        assert agent["args"][agent["args"].index("--role") + 1] == role, name
        assert obj["spec"]["minReplicaCount"] == getattr(args, f"min_{role}"), name
        assert obj["spec"]["maxReplicaCount"] == getattr(args, f"max_{role}"), name


def test_planner_pod_runs_as_the_images_user_with_its_secrets() -> None:
    deployment = objects("Deployment")["pdreg-planner"]
    assert deployment["metadata"]["namespace"] == NAMESPACE
    pod, container = pod_spec(deployment), planner_container()
    uid, gid = image_user()
    assert not run_as_non_root_errors(pod, container, image_user_spec())
    assert not hardening_errors(pod, container, uid, gid)
    assert not unreadable_files(pod, container, uid)
    args = planner_args()
    token_file = args.token_file
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    for path in (token_file, env["PDREG_REGISTRY_PUBLIC_KEY"], env["PDREG_CURVE_KEY"]):
        assert path and any(path.startswith(m + "/") for m in mounted), path


def _pods() -> dict[str, Pod]:
    docs = rendered()
    return {name: Pod(NAMESPACE, pod_labels(d), named_ports(pod_spec(d)))
            for name, d in workloads_by_name(docs).items()}


def test_network_policy_lets_the_planner_reach_the_registry_and_the_routers_metrics() -> None:
    """The planner registers and watches (registry control and events), and reads every
    router's /metrics on the port the router advertises (--metrics-port); nothing else."""
    policies = objects("NetworkPolicy").values()
    pods = _pods()
    planner, registry, router = pods["pdreg-planner"], pods["pdreg-registry"], pods["pdreg-router"]
    reach = {(target, port): ingress_allowed(policies, planner, pods[target], number)
             for target, port, number in [
                 ("pdreg-registry", "control", registry.ports["control"]),
                 ("pdreg-registry", "events", registry.ports["events"]),
                 ("pdreg-registry", "http", registry.ports["http"]),
                 ("pdreg-router", "metrics", router.ports["metrics"]),
                 ("pdreg-router", "http", router.ports["http"]),
                 ("vllm-prefill", "http", pods["vllm-prefill"].ports["http"])]}
    assert reach == {("pdreg-registry", "control"): True, ("pdreg-registry", "events"): True,
                     ("pdreg-registry", "http"): False, ("pdreg-router", "metrics"): True,
                     ("pdreg-router", "http"): True, ("vllm-prefill", "http"): False}
    # Prometheus scrapes the planner; KEDA's namespace queries Prometheus.
    keda = Pod("keda", {"app": "keda-operator"})
    prometheus = pods["pdreg-prometheus"]
    assert ingress_allowed(policies, prometheus, planner, planner.ports["http"])
    assert ingress_allowed(policies, keda, prometheus, prometheus.ports["http"])
    assert not ingress_allowed(policies, keda, planner, planner.ports["http"])


def test_keda_falls_back_to_the_current_replicas_not_a_fixed_count() -> None:
    """After failed queries (Prometheus or the planner gone) the fleet stays as it is:
    KEDA's `fallback.behavior: currentReplicas` (KEDA 2.17+), which KEDA applies only to
    AverageValue metrics; "no data" must count as a failure, never as 0 replicas."""
    for name, obj in objects("ScaledObject").items():
        fallback = obj["spec"]["fallback"]
        assert fallback["behavior"] == "currentReplicas", name
        assert fallback["failureThreshold"] >= 1 and fallback["replicas"] >= 1, name
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["metricType"] == "AverageValue", name
        assert trigger["metadata"]["ignoreNullValues"] == "false", name


def test_prometheus_keeps_its_data_on_a_claim_in_the_production_overlay() -> None:
    docs = rendered()
    claim = objects("PersistentVolumeClaim")["pdreg-prometheus-data"]
    assert claim["metadata"]["namespace"] == NAMESPACE
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    deployment = workloads_by_name(docs)["pdreg-prometheus"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # one RWO volume
    pod = pod_spec(deployment)
    volumes = {v["name"]: v for v in pod["volumes"]}
    [data] = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/prometheus"]
    assert volumes[data["name"]] == {"name": data["name"], "persistentVolumeClaim": {
        "claimName": claim["metadata"]["name"]}}
    args = pod["containers"][0]["args"]
    assert "--storage.tsdb.path=/prometheus" in args
    retention_gb = float(next(a for a in args if a.startswith("--storage.tsdb.retention.size="))
                         .split("=")[1].removesuffix("GB"))
    assert retention_gb < float(claim["spec"]["resources"]["requests"]["storage"]
                                .removesuffix("Gi")), "retention must leave room for the WAL"
