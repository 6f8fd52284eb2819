"""deploy/ for Docker: the Dockerfile, Compose, Prometheus and Grafana files, checked with
the real tools (BuildKit's Dockerfile parser, hadolint, docker-compose, promtool) and
every `pdreg` command line parsed by pdreg's own CLI. No Docker daemon: nothing is built
or run in a container here (tests/test_deploy_live.py runs the Compose command lines on
loopback instead). Kubernetes: tests/test_deploy_k8s.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import runpy
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from deploy_support import (
    COMPOSE_ENV,
    COMPOSE_FILE,
    DEPLOY,
    REPO,
    compose,
    compose_command,
    compose_processes,
    dashboard_queries,
    dockerfile_stages,
    grafana_to_promql,
    http_port,
    image_user,
    listening_ports,
    load_yaml,
    metrics_port,
    pyproject_packages,
    run_tool,
    tool,
)
from prometheus_client.parser import text_string_to_metric_families

from engine_agent.reference.server import ServerState, render_metrics
from registry.server import RegistryConfig, RegistryServer
from router.metrics import RouterMetrics

WAIT_S = 20.0
HEALTHCHECK = runpy.run_path(str(DEPLOY / "healthcheck.py"))
# Which HTTP path each kind of pdreg process answers liveness on.
LIVENESS_PATHS = {"registry": "/healthz", "router": "/health", "engine": "/health"}


def test_every_file_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))
    assert len(files) >= 15
    for path in files:
        assert load_yaml(path), f"{path} is empty"
    for path in DEPLOY.rglob("*.json"):
        assert json.loads(path.read_text()), f"{path} is empty"


# --- Dockerfile -------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    result = run_tool([tool("hadolint"), str(DEPLOY / "Dockerfile")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_as_a_numeric_non_root_user() -> None:
    uid, gid = image_user()
    assert uid != 0 and gid != 0
    final = dockerfile_stages()[-1]
    [run] = [i for i in final if i["cmd"] == "RUN" and "useradd" in i["value"][0]]
    assert f"--uid {uid}" in run["value"][0] and f"--gid {gid}" in run["value"][0]


def test_dockerfile_every_pip_stage_sees_the_package_index() -> None:
    for stage in dockerfile_stages():
        if any(i["cmd"] == "RUN" and re.search(r"\bpip (install|wheel)\b", i["value"][0])
               for i in stage):
            args = {i["value"][0] for i in stage if i["cmd"] == "ARG"}
            # No default: unset unless given, so pip keeps its own configuration.
            assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"} <= args, stage[0]["value"]


def test_dockerfile_healthcheck_and_entrypoint() -> None:
    final = dockerfile_stages()[-1]
    [healthcheck] = [i for i in final if i["cmd"] == "HEALTHCHECK"]
    assert healthcheck["value"][0] == "CMD"
    script = healthcheck["value"][-1]
    copies = {tuple(i["value"]) for i in final if i["cmd"] == "COPY"}
    assert ("deploy/healthcheck.py", script) in copies
    assert any(f.startswith("--timeout=") for f in healthcheck["flags"])
    [entrypoint] = [i for i in final if i["cmd"] == "ENTRYPOINT"]
    assert entrypoint["json"] and entrypoint["value"] == ["pdreg"]
    assert not any(re.search(r"https?://", " ".join(i["value"])) for s in dockerfile_stages()
                   for i in s), "name no package index host"


def test_dockerfile_copies_only_what_the_context_keeps() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    sources = [i["value"][:-1] for s in dockerfile_stages() for i in s
               if i["cmd"] == "COPY" and not i["flags"]]
    # Every package pyproject installs (`make test-image` also imports each in the image).
    packages = set(pyproject_packages())
    for source in (src for group in sources for src in group):
        assert (REPO / source).exists(), source
        keep = f"!{source}/" if (REPO / source).is_dir() else f"!{source}"
        assert keep in ignore, f"{source} is copied but the .dockerignore drops it"
    assert packages <= {src for group in sources for src in group}


_LOCKED = re.compile(r"^([a-z0-9][a-z0-9._-]*)==(\S+) \\$", re.M)
_HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def _lock(name: str) -> dict[str, str]:
    """A pip-compile lock: package -> version; every package carries sha256 hashes."""
    text = (DEPLOY / name).read_text()
    blocks = re.split(r"\n(?=[a-z0-9])", text[text.index("\n" + _LOCKED.search(text)[1]):])
    for block in blocks:
        if _LOCKED.match(block.strip()):
            assert _HASH.search(block), f"{name}: {block.splitlines()[0]} has no hash"
    return dict(_LOCKED.findall(text))


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_dockerfile_pins_its_base_by_digest_and_installs_only_hashed_files() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", base[1])
    assert all(stage[0]["value"][0] == "${BASE}" for stage in dockerfile_stages())
    runs = [i["value"][0] for stage in dockerfile_stages() for i in stage if i["cmd"] == "RUN"]
    installs = [part for run in runs for part in re.split(r"&&", run) if "pip install" in part]
    assert installs
    for install in installs:
        # From a lock, hash-checked; or pdreg's own wheel, built here, nothing more.
        assert ("--require-hashes" in install and "--no-deps" in install) or \
            re.search(r"--no-deps /wheels/pdreg-\*\.whl", install), install
    [wheel] = [run for run in runs if "pip wheel" in run]
    assert "--no-build-isolation" in wheel  # the backend comes from the build lock


def test_the_locks_pin_every_dependency_at_the_tested_versions() -> None:
    """deploy/requirements.lock (deploy/lock.sh, from PyPI): every dependency of
    pyproject.toml, hashed, at the version this test suite runs with."""
    with (REPO / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)
    runtime = _lock("requirements.lock")
    declared = {_name(r) for r in project["project"]["dependencies"]}
    assert declared <= set(runtime), declared - set(runtime)
    for package, version in runtime.items():
        assert importlib.metadata.version(package) == version, package
    engine = _lock("requirements-engine.lock")
    assert {_name(r) for r in project["project"]["optional-dependencies"]["engine"]} <= set(
        engine)
    assert all(engine[p] == v for p, v in runtime.items())  # the same, plus torch's
    build = _lock("requirements-build.lock")
    assert {_name(r) for r in project["build-system"]["requires"]} <= set(build)


# --- the image's HEALTHCHECK picks each process's liveness endpoint -------------------


@pytest.mark.parametrize(("cmdline", "argv"), [
    (["/usr/local/bin/python3.11", "/usr/local/bin/pdreg", "router", "--port", "8000"],
     ["router", "--port", "8000"]),
    (["python", "-m", "pdreg", "--log-level", "INFO", "registry"],
     ["--log-level", "INFO", "registry"]),
    (["pdreg"], []),
    (["python", "/usr/local/bin/pdreg-healthcheck"], None),
    (["vllm", "serve", "m"], None),
])
def test_healthcheck_finds_pdreg_arguments(cmdline: list[str], argv: list[str] | None) -> None:
    assert HEALTHCHECK["pdreg_argv"](cmdline) == argv


def test_compose_processes_are_checked_on_their_own_liveness_port() -> None:
    for name, process in compose_processes().items():
        url = urlsplit(HEALTHCHECK["liveness_url"](process.argv))
        args = process.parse()
        assert url.hostname == "127.0.0.1"
        assert url.port == http_port(process.kind, args), name
        assert url.path == LIVENESS_PATHS[process.kind], name
    assert HEALTHCHECK["liveness_url"](["agent", "--engine", "vllm", "--engine-url",
                                        "http://127.0.0.1:8000", "--role", "decode"]) is None


# --- Compose ----------------------------------------------------------------------------


def test_the_expected_processes_are_there() -> None:
    kinds = sorted(process.kind for process in compose_processes().values())
    assert kinds == ["engine"] * 4 + ["registry", "router"]


@pytest.mark.parametrize("name", sorted(compose_processes()))
def test_compose_command_line_parses_and_is_reachable(name: str) -> None:
    process = compose_processes()[name]
    args = process.parse()
    assert args.host == "0.0.0.0", f"{name}: a container must bind all interfaces"
    if process.kind != "registry":
        assert args.advertise_host == name, f"{name}: advertise the service name"
        assert args.registry is None, f"{name}: take the registry from the env"


def _published(port_spec: str) -> tuple[str, int, int]:
    host, host_port, container_port = port_spec.split(":")
    return host, int(host_port), int(container_port)


def test_compose_ports_and_environment_agree_with_the_command_lines() -> None:
    services = compose()["services"]
    processes = compose_processes()
    for name, service in services.items():
        for spec in service.get("ports", []):
            host, _, container_port = _published(str(spec))
            assert host == "127.0.0.1", f"{name}: publish on loopback only ({spec})"
            if name in processes:
                args = processes[name].parse()
                assert container_port in listening_ports(processes[name].kind, args), spec
        assert "healthcheck" in service, f"{name} has no healthcheck"

    control_port = processes["registry"].parse().port
    for name in processes:
        env = services[name]["environment"]
        assert env["PDREG_REGISTRY"] == f"registry:{control_port}", name
        assert env["PDREG_TOKEN"] == COMPOSE_ENV["PDREG_TOKEN"], f"{name}: registers with a token"
    assert services["registry"]["environment"]["PDREG_ADMIN_TOKEN"]
    assert services["router"]["environment"]["PDREG_API_KEY"]


def test_compose_drain_fits_the_stop_grace_period() -> None:
    services = compose()["services"]
    for name, process in compose_processes().items():
        args = process.parse()
        grace = float(services[name]["stop_grace_period"].removesuffix("s"))
        if process.kind == "router":
            drain = args.drain_delay + args.drain_timeout
        elif process.kind == "engine":
            drain = args.drain_timeout_s
        else:
            drain = 0.0
        assert drain < grace, f"{name}: drains for {drain} s, killed after {grace} s"
    router = compose_processes()["router"].parse()
    assert router.locality_label == "zone"
    engine_labels = {name: dict(p.parse().labels) for name, p in compose_processes().items()
                     if p.kind == "engine"}
    assert all("zone" in labels for labels in engine_labels.values()), engine_labels


def _docker_compose(env: dict[str, str]) -> Any:
    return run_tool([tool("docker-compose"), "-f", str(COMPOSE_FILE), "config"],
                    env={"PATH": "/usr/bin:/bin", **env}, cwd=DEPLOY)


def test_compose_config_agrees_with_docker_compose() -> None:
    """docker-compose itself validates the file and renders what `up` would run; the
    live test runs our reading of it, so the two must be the same."""
    result = _docker_compose(COMPOSE_ENV)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)["services"]
    ours = compose()["services"]
    assert rendered.keys() == ours.keys()
    for name, service in rendered.items():
        if "command" in service:
            assert compose_command(service) == compose_command(ours[name]), name
        assert service.get("environment", {}) == ours[name].get("environment", {}), name


def test_compose_refuses_to_start_without_the_tokens() -> None:
    result = _docker_compose({k: v for k, v in COMPOSE_ENV.items() if k != "PDREG_TOKEN"})
    assert result.returncode != 0
    assert "PDREG_TOKEN" in result.stderr


def test_compose_prometheus_scrapes_every_pdreg_http_port() -> None:
    config = load_yaml(DEPLOY / "prometheus.yml")[0]
    targets = {target for job in config["scrape_configs"]
               for group in job.get("static_configs", []) for target in group["targets"]}
    processes = compose_processes()
    expected = {f"{name}:{metrics_port(p.kind, p.parse())}" for name, p in processes.items()}
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


def test_compose_prometheus_config_passes_promtool() -> None:
    result = run_tool([tool("promtool"), "check", "config", str(DEPLOY / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


# --- Grafana queries: valid PromQL naming real metrics ------------------------------------


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel's query with Prometheus's own PromQL parser (as a
    recording rule), Grafana's variables filled in."""
    queries = list(dashboard_queries())
    assert len(queries) >= 20
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": grafana_to_promql(q.expr)}
        for i, q in enumerate(queries)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run_tool([tool("promtool"), "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


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


def _sample_names(families: Any) -> set[str]:
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
    reference engine's /metrics (vLLM's and SGLang's load gauge names)."""
    config = RegistryConfig(port=0, events_port=0, http_port=0)
    with RegistryServer(config) as registry:
        text = httpx.get(f"{registry.http_url}/metrics", timeout=WAIT_S).text
    names = _sample_names(text_string_to_metric_families(text))
    names |= _sample_names(RouterMetrics().registry.collect())
    engine = render_metrics(ServerState(role="prefill", model="tiny", model_dir=""))
    names |= _sample_names(text_string_to_metric_families(engine))
    assert {"pdreg_members", "pdreg_heartbeats_total", "pdreg_router_ttft_seconds_bucket",
            "vllm:num_requests_running", "sglang:num_running_reqs"} <= names
    return names


def _variable_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana/pdreg-dashboard.json").read_text())
    return [(f"variable {v['name']}", v["definition"])
            for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_dashboard_queries_name_exposed_metrics(exposed_metric_names: set[str]) -> None:
    exprs = [(q.panel, q.expr) for q in dashboard_queries()] + _variable_queries()
    for title, expr in exprs:
        names = promql_metric_names(expr.replace("label_values(", "label_values_fn("))
        names.discard("model")  # label_values(metric, label): the label, not a metric
        assert names, f"{title}: {expr} names no metric"
        unknown = names - exposed_metric_names
        assert not unknown, f"panel {title!r}: {sorted(unknown)} are not exposed"


def test_dashboard_covers_the_brief() -> None:
    text = " ".join(q.expr for q in dashboard_queries())
    for metric in ("pdreg_members", "pdreg_member_heartbeat_age_seconds",
                   "pdreg_heartbeats_total", "pdreg_rejected_messages_total",
                   "pdreg_departures_total", "pdreg_self_preservation",
                   "pdreg_loop_lag_seconds", "pdreg_membership_version",
                   "pdreg_router_requests_total", "pdreg_router_ttft_seconds_bucket",
                   "pdreg_router_itl_seconds_bucket", "pdreg_router_migrations_total",
                   "pdreg_router_retries_total", "pdreg_router_quarantines_total",
                   # the engine row: vLLM's names and SGLang's, side by side
                   "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "sglang:num_running_reqs",
                   "sglang:num_queue_reqs", "sglang:token_usage"):
        assert metric in text, metric
