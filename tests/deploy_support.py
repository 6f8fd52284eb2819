"""What the deploy/ tests share: where the files and the real tools are, reading Compose
and rendered Kubernetes objects, and pdreg command lines parsed by pdreg's own CLI.

The tools (kubectl with its built-in kustomize, kubernetes-validate, hadolint, the
`dockerfile` parser, docker-compose) live in .venv-deploy/ (`make deploy-tools`);
Prometheus and promtool are Debian's `prometheus` package. Missing locally, a test that
needs one skips and says how to install it; in CI (CI=true) it fails instead.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdreg.cli import build_parser
from pdreg.testing import die_with_parent, stop_process

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("vllm", "sglang")
DEPLOY_VENV = REPO / ".venv-deploy"
PDREG_IMAGE_PREFIX = "pdreg:"  # compose's image (a local build)
PDREG_IMAGE_NAME = "pdreg"  # the manifests' image, before deploy/k8s/images sets repo and tag
TOOL_TIMEOUT_S = 120.0

_TOOLS = {
    "kubectl": DEPLOY_VENV / "tools/bin/kubectl",
    "kubernetes-validate": DEPLOY_VENV / "tools/bin/kubernetes-validate",
    "hadolint": DEPLOY_VENV / "tools/bin/hadolint",
    "dockerfile-python": DEPLOY_VENV / "tools/bin/python",
    "docker-compose": DEPLOY_VENV / "compose/bin/docker-compose",
}
_HOW_TO_INSTALL = {"promtool": "apt-get install prometheus",
                   "prometheus": "apt-get install prometheus"}


def tool(name: str) -> str:
    """The path of a real tool the deploy checks run: .venv-deploy first, then PATH."""
    local = _TOOLS.get(name)
    if local is not None and local.exists():
        return str(local)
    found = shutil.which(name) if name != "dockerfile-python" else None
    if found:
        return found
    how = _HOW_TO_INSTALL.get(name, "make deploy-tools")
    message = f"{name} is not installed ({how})"
    if os.environ.get("CI"):
        pytest.fail(f"{message}: CI must run this check")
    pytest.skip(message)


def run_tool(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                          **kwargs)


# --- files ------------------------------------------------------------------------------


def load_yaml(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@functools.cache
def _render(directory: str) -> str:
    result = run_tool([tool("kubectl"), "kustomize", directory])
    assert result.returncode == 0, f"kubectl kustomize {directory}:\n{result.stderr}"
    return result.stdout


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize DIRECTORY` renders (kubectl's own kustomize)."""
    return [doc for doc in yaml.safe_load_all(_render(str(directory))) if doc]


def objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def by_name(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in objects(docs, kind)}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def image_name(image: str) -> str:
    """The image's name without registry, path or tag: `reg.io/x/pdreg:1` -> `pdreg`."""
    return image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]


def is_pdreg(container: dict[str, Any]) -> bool:
    return image_name(container["image"]) == PDREG_IMAGE_NAME


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom"))
            for item in container.get("env", [])}


def flag(argv: list[str], name: str) -> str:
    """The value after NAME in ARGV (`--flag value` or `--flag=value`)."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


# --- pdreg command lines ----------------------------------------------------------------


@dataclass(frozen=True)
class PdregProcess:
    where: str  # "compose:router", "k8s/vllm:pdreg-router/router"
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
        "router": lambda: {args.port, args.metrics_port or 0},
        "engine": lambda: {args.port, args.kv_port, args.bootstrap_port},
        "agent": lambda: set(),
    }[kind]()
    return {port for port in ports if port > 0}


def http_port(kind: str, args: argparse.Namespace) -> int:
    return args.http_port if kind == "registry" else args.port


def metrics_port(kind: str, args: argparse.Namespace) -> int:
    """Where Prometheus scrapes a pdreg process: a router's --metrics-port when given
    (its /metrics is then off the API port), else its HTTP port."""
    if kind == "router" and args.metrics_port is not None:
        return int(args.metrics_port)
    return http_port(kind, args)


def container_argv(container: dict[str, Any]) -> list[str]:
    """pdreg's argv as the kubelet passes it: `$(VAR)` of a variable the container takes
    from a ConfigMap is expanded (the router's `--allow-upstream $(POD_CIDRS)`); those
    from the downward API (`$(POD_IP)`) stay as written, which the tests check."""
    assert container.get("command") in (None, ["pdreg"]), container["name"]  # ENTRYPOINT
    values = {}
    for item in container.get("env", []):
        ref = item.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            values[item["name"]] = _config_map_value(ref["name"], ref["key"])
    return [_VAR_REF.sub(lambda m: values.get(m.group(1), m.group(0)), str(arg))
            for arg in container["args"]]


_VAR_REF = re.compile(r"\$\((\w+)\)")


@functools.cache
def _config_map_value(name: str, key: str) -> str:
    """KEY of ConfigMap NAME as the overlays render it (a generated name names a value)."""
    for overlay in (*(K8S / o for o in OVERLAYS), DEPLOY / "keda"):
        for doc in objects(render(overlay), "ConfigMap"):
            if doc["metadata"]["name"] == name:
                return str(doc["data"][key])
    raise AssertionError(f"no ConfigMap {name} in the renderings")


def k8s_processes(overlay: str) -> list[PdregProcess]:
    found = []
    for deployment in workloads(overlay):
        for container in pod_spec(deployment)["containers"]:
            if is_pdreg(container):
                where = f"k8s/{overlay}:{deployment['metadata']['name']}/{container['name']}"
                found.append(PdregProcess(where, container_argv(container)))
    return found


# --- credentials ------------------------------------------------------------------------


def generate_secrets(work: Path) -> tuple[Path, dict[str, dict[str, bytes]]]:
    """deploy/k8s/secrets as an operator makes it, in a copy under WORK: generate.sh, then
    the Secrets kubectl's kustomize renders. (The files operators hold, each Secret.)"""
    secrets = work / "secrets"
    shutil.copytree(K8S / "secrets", secrets, ignore=shutil.ignore_patterns("files"))
    shutil.copytree(K8S / "namespace", work / "namespace")
    result = run_tool([str(secrets / "generate.sh")], cwd=work,
                      env={**os.environ, "PDREG": f"{sys.executable} -m pdreg"})
    assert result.returncode == 0, f"generate.sh:\n{result.stdout}{result.stderr}"
    return secrets / "files", rendered_secrets(secrets)


def rendered_secrets(directory: Path) -> dict[str, dict[str, bytes]]:
    """Each Secret `kubectl kustomize DIRECTORY` renders: name -> key -> bytes."""
    result = run_tool([tool("kubectl"), "kustomize", str(directory)])
    assert result.returncode == 0, f"kubectl kustomize {directory}:\n{result.stderr}"
    return {doc["metadata"]["name"]: {k: base64.b64decode(v) for k, v in doc["data"].items()}
            for doc in yaml.safe_load_all(result.stdout) if doc and doc["kind"] == "Secret"}


# --- the image ---------------------------------------------------------------------


@functools.cache
def dockerfile_stages() -> list[list[dict[str, Any]]]:
    """The Dockerfile's stages as BuildKit's own parser reads them (the `dockerfile`
    package wraps moby/buildkit's parser): per stage, its instructions."""
    script = ("import dockerfile, json, sys\n"
              "json.dump([{'cmd': c.cmd.upper(), 'value': list(c.value), "
              "'flags': list(c.flags), 'json': c.json} "
              "for c in dockerfile.parse_file(sys.argv[1])], sys.stdout)")
    result = run_tool([tool("dockerfile-python"), "-c", script, str(DEPLOY / "Dockerfile")])
    assert result.returncode == 0, result.stderr
    stages: list[list[dict[str, Any]]] = []
    for instruction in json.loads(result.stdout):
        if instruction["cmd"] == "FROM":
            stages.append([])
        if stages:  # an ARG before the first FROM is global (the base): no stage's
            stages[-1].append(instruction)
    return stages


def pyproject_packages() -> list[str]:
    """The top-level packages pyproject.toml installs: its setuptools `include` patterns
    (`registry*` -> registry). The image must hold every one of them."""
    with (REPO / "pyproject.toml").open("rb") as file:
        include = tomllib.load(file)["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*").rstrip(".") for pattern in include]


def image_user_spec() -> str:
    """The pdreg image's user as its Dockerfile says it ("" = root)."""
    users = [i["value"][0] for i in dockerfile_stages()[-1] if i["cmd"] == "USER"]
    return users[-1] if users else ""


def image_user() -> tuple[int, int]:
    """(uid, gid) of the pdreg image: its final stage's last USER, which must be numeric
    for Kubernetes to verify runAsNonRoot."""
    spec = image_user_spec()
    assert spec, "the image runs as root: no USER in the final stage"
    uid, _, gid = spec.partition(":")
    assert uid.isdigit() and gid.isdigit(), (
        f"USER {spec}: a name cannot be checked against runAsNonRoot (the kubelet "
        f"refuses the pod with CreateContainerConfigError); use UID:GID")
    return int(uid), int(gid)


# --- Compose ----------------------------------------------------------------------------

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
# What the tests put in deploy/.env. Compose refuses to start without them.
COMPOSE_ENV = {"PDREG_TOKEN": "test-fleet-token", "PDREG_ADMIN_TOKEN": "test-admin-token",
               "PDREG_API_KEY": "test-api-key"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's `${NAME}`, `${NAME:?message}`, `${NAME:-default}` for variables in ENV
    (what the tests set; test_compose_config_agrees_with_docker_compose holds this to
    docker-compose's own rendering)."""
    return _VARIABLE.sub(lambda m: env[m.group(1)], value)


def compose(env: Mapping[str, str] = COMPOSE_ENV) -> dict[str, Any]:
    """docker-compose.yml with anchors merged (YAML does that) and ENV interpolated."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return interpolate(node, env) if isinstance(node, str) else node
    return walk(load_yaml(COMPOSE_FILE)[0])


def compose_command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def compose_processes() -> dict[str, PdregProcess]:
    return {name: PdregProcess(f"compose:{name}", compose_command(service))
            for name, service in compose()["services"].items()
            if str(service.get("image", "")).startswith(PDREG_IMAGE_PREFIX)}


# --- Grafana ----------------------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana/pdreg-dashboard.json"


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str


def dashboard_queries() -> Iterator[PanelQuery]:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield PanelQuery(panel["title"], target["refId"], target["expr"])


def grafana_to_promql(expr: str, rate_interval: str = "1m") -> str:
    """A panel's query as Prometheus gets it: Grafana's variables filled in ($model = all)."""
    for name, value in (("$__rate_interval", rate_interval), ("$__interval", rate_interval),
                        ("$model", ".*")):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


# --- the overlays' workloads ---------------------------------------------------------

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
NAMESPACE = "pdreg"
overlays = pytest.mark.parametrize("overlay", OVERLAYS)


WORKLOAD_KINDS = ("Deployment", "StatefulSet")  # the registries are a StatefulSet


def workloads(overlay: str) -> list[dict[str, Any]]:
    """The overlay's pod controllers: Deployments and the registries' StatefulSet."""
    docs = render(K8S / overlay)
    return [doc for kind in WORKLOAD_KINDS for doc in objects(docs, kind)]


def workloads_by_name(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: doc for kind in WORKLOAD_KINDS for name, doc in by_name(docs, kind).items()}


def env_value(docs: list[dict[str, Any]], container: dict[str, Any], name: str) -> str:
    """Environment variable NAME of CONTAINER as the kubelet sets it: a plain value, or
    the key of a ConfigMap among DOCS."""
    value = env_of(container)[name]
    if isinstance(value, str):
        return value
    ref = value["configMapKeyRef"]
    return str(by_name(docs, "ConfigMap")[ref["name"]]["data"][ref["key"]])


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


def named_ports(pod: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for c in pod["containers"]
            for port in c.get("ports", [])}


@dataclass
class Processes:
    """pdreg processes a test started, by name; each logs to LOGS/NAME.log (appended, so a
    restart keeps what came before). `stop()` ends every one of them."""

    logs: Path
    stop_s: float = 40.0  # a router drains for --drain-delay + in-flight
    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argvs: dict[str, list[str]] = field(default_factory=dict)
    envs: dict[str, Mapping[str, str]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: Mapping[str, str],
              log_level: str = "WARNING") -> None:
        with (self.logs / f"{name}.log").open("ab") as log:
            self.running[name] = subprocess.Popen(
                [sys.executable, "-m", "pdreg", "--log-level", log_level, *argv],
                env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent)
        self.argvs[name], self.envs[name] = argv, env

    def stop_one(self, name: str) -> None:
        proc = self.running.pop(name)
        proc.send_signal(signal.SIGTERM)
        stop_process(proc, self.stop_s)

    def restart(self, name: str) -> None:
        """Stop NAME and start it again with the same command line: for a member, a new
        incarnation of the same id."""
        self.stop_one(name)
        self.start(name, self.argvs[name], self.envs[name])

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        for name, proc in self.running.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n{self.log(name)[-2000:]}")

    def stop(self) -> None:
        for proc in self.running.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.running.values():
            stop_process(proc, self.stop_s)
