"""deploy/keda stays honest: the planner's command line parses with the real CLI and
listens where its probes and scrape annotations look; each ScaledObject scales a
Deployment of deploy/k8s on a gauge the planner really exposes, for that Deployment's
model and role, within the planner's own bounds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pdreg.cli import build_parser
from pdreg.cmd_planner import config_from
from planner.metrics import PlannerMetrics
from planner.rule import Decision, Reason, RoleSignals
from registry.protocol import Role

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
QUERY = re.compile(r'^max\((\w+)\{model="([^"]+)",role="(\w+)"\}\)$')


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


def objects(directory: Path, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for path in sorted(directory.glob("*.yaml"))
            for d in docs(path) if d.get("kind") == kind}


def planner_container() -> dict[str, Any]:
    deployment = objects(DEPLOY / "keda", "Deployment")["pdreg-planner"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def planner_args() -> Any:
    return build_parser().parse_args(planner_container()["args"])


def test_planner_command_line_parses_and_listens_where_it_is_probed() -> None:
    args = planner_args()
    assert args.subcommand == "planner"
    config_from(args)  # every value is acceptable
    container = planner_container()
    deployment = objects(DEPLOY / "keda", "Deployment")["pdreg-planner"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.port
    assert annotations["prometheus.io/path"] == "/metrics"
    assert [p["containerPort"] for p in container["ports"]] == [args.port]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": args.port}
    service = objects(DEPLOY / "keda", "Service")["pdreg-planner"]
    assert service["spec"]["ports"][0]["targetPort"] == args.port


def test_scaled_objects_follow_the_planners_gauge_for_their_deployment() -> None:
    args = planner_args()
    metrics = PlannerMetrics(config_from(args).rule, 0.9)
    metrics.publish(Decision("m", Role.DECODE, 1, 1, 1, Reason.STEADY, "", 0.0),
                    RoleSignals(1))
    exposed = metrics.render().decode()
    deployments = objects(DEPLOY / "k8s", "Deployment")
    scaled = objects(DEPLOY / "keda", "ScaledObject")
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
