"""deploy/ as a real cluster and a real operator meet it: images a node can pull (or use
as loaded), engine images pinned to the versions this repository tests, the Secrets
applied first on a new cluster, KEDA reaching Prometheus from its own namespace, and
Prometheus bounded by size. (The image itself is built and run by `make test-image`.)"""

from __future__ import annotations

import re
import runpy
import shutil
import tomllib
from pathlib import Path

import yaml
from deploy_support import (
    COMPOSE_ENV,
    COMPOSE_FILE,
    DEPLOY,
    K8S,
    NAMESPACE,
    REPO,
    by_name,
    compose_command,
    flag,
    image_name,
    is_pdreg,
    objects,
    overlays,
    pod_spec,
    render,
    run_tool,
    tool,
)

from pdreg.cli import build_parser

IMAGES = K8S / "images"
# What `make test-vllm` / `make test-sglang` install: the engine images must be the same.
ENGINE_VERSIONS = {"vllm/vllm-openai": ("tests/vllm/setup.sh", "VLLM_VERSION"),
                   "lmsysorg/sglang": ("tests/sglang/setup.sh", "SGLANG_VERSION")}
KEDA = DEPLOY / "keda"


def _containers(docs: list[dict]) -> list[dict]:
    return [c for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")
            for c in [*pod_spec(d).get("initContainers", []), *pod_spec(d)["containers"]]]


def _setup_version(script: str, variable: str) -> str:
    match = re.search(rf"^{variable}=(\S+)$", (REPO / script).read_text(), re.M)
    assert match, f"{script}: no {variable}="
    return match.group(1)


def test_images_are_set_in_one_place() -> None:
    """Only deploy/k8s/images names a tag: the manifests name images bare."""
    for path in K8S.rglob("*.yaml"):
        if path.parent == IMAGES:
            continue
        for line in path.read_text().splitlines():
            match = re.match(r"\s*image:\s*(\S+)", line)
            if match and image_name(match.group(1)) in ("pdreg", "vllm-openai", "sglang"):
                assert ":" not in match.group(1), f"{path}: {line.strip()} (tag it in images/)"


@overlays
def test_every_image_is_pinned_and_used_when_present(overlay: str) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for docs in (render(K8S / overlay), render(KEDA)):
        for container in _containers(docs):
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest", f"{container['name']}: {image}"
            if is_pdreg(container):
                # latest (or no tag) means imagePullPolicy Always: a pull from Docker Hub
                # even when the node already holds the image.
                assert tag == version, image
                assert container["imagePullPolicy"] == "IfNotPresent", container["name"]
            for repository, (script, variable) in ENGINE_VERSIONS.items():
                if name == repository:
                    assert tag == f"v{_setup_version(script, variable)}", image


def test_make_image_tags_by_version_and_commit() -> None:
    """A new commit is a new tag: a node never keeps a stale image under an old name."""
    build_image = runpy.run_path(str(DEPLOY / "build_image.py"))
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    tag = build_image["image_tag"]()
    assert re.fullmatch(rf"{re.escape(version)}-g[0-9a-f]{{12}}(-dirty)?", tag), tag


@overlays
def test_the_image_make_image_prints_pins_every_pdreg_container(overlay: str,
                                                                 tmp_path: Path) -> None:
    """The images component as `kustomize edit set image pdreg=REGISTRY/pdreg:TAG@DIGEST`
    leaves it (newName, newTag, digest): every pdreg container, init containers too,
    runs that registry's image by digest; nothing else changes."""
    reference = ("registry.example.com/team/pdreg", "0.1.0-g0123456789ab",
                 "sha256:" + "5" * 64)
    copied = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copied, ignore=shutil.ignore_patterns(".env", "files"))
    path = copied / "k8s/images/kustomization.yaml"
    component = yaml.safe_load(path.read_text())
    [entry] = [i for i in component["images"] if i["name"] == "pdreg"]
    entry.update(newName=reference[0], newTag=reference[1], digest=reference[2])
    path.write_text(yaml.safe_dump(component))
    before = _containers(render(K8S / overlay))
    after = _containers(render(copied / "k8s" / overlay))
    assert len(before) == len(after)
    pinned = f"{reference[0]}:{reference[1]}@{reference[2]}"
    for old, new in zip(before, after, strict=True):
        assert new["image"] == (pinned if is_pdreg(old) else old["image"]), new["name"]


@overlays
def test_engine_probes_are_routes_of_the_pinned_version(overlay: str) -> None:
    """SGLang's probes use /ready, which its servers before 0.5 answer with 404: the
    pinned version serves it (make test-sglang runs that version)."""
    docs = render(K8S / overlay)
    for container in _containers(docs):
        if is_pdreg(container) or "prometheus" in container["image"] or \
                image_name(container["image"]) == "etcd" or \
                container["name"] == "download":  # the model-download Job serves nothing
            continue
        paths = {container[p]["httpGet"]["path"] for p in
                 ("startupProbe", "readinessProbe", "livenessProbe") if p in container}
        allowed = {"vllm": {"/health"}, "sglang": {"/ready", "/health"}}[overlay]
        assert paths and paths <= allowed, (container["name"], paths)


def test_secrets_overlay_brings_its_namespace() -> None:
    kustomization = yaml.safe_load((K8S / "secrets/kustomization.yaml").read_text())
    assert "../namespace" in kustomization["resources"]
    base = yaml.safe_load((K8S / "base/kustomization.yaml").read_text())
    assert "../namespace" in base["resources"]  # one Namespace object, both include it


def test_keda_reaches_prometheus_from_its_own_namespace() -> None:
    docs = render(KEDA)
    [prometheus] = [s for s in objects(docs, "Service") if "prometheus" in s["metadata"]["name"]]
    port = prometheus["spec"]["ports"][0]["port"]
    want = (f"http://{prometheus['metadata']['name']}.{prometheus['metadata']['namespace']}"
            f".svc.cluster.local:{port}")
    for scaled in objects(docs, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["metadata"]["serverAddress"] == want
        fallback = scaled["spec"]["fallback"]
        assert fallback["failureThreshold"] >= 1
        assert scaled["spec"]["minReplicaCount"] <= fallback["replicas"] <= \
            scaled["spec"]["maxReplicaCount"]


def test_keda_overlay_leaves_the_counts_to_keda() -> None:
    """`kubectl apply -k deploy/keda` again must not reset what KEDA's HPA set."""
    docs = render(KEDA)
    deployments = by_name(docs, "Deployment")
    for scaled in objects(docs, "ScaledObject"):
        target = deployments[scaled["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"], target["metadata"]["name"]
    assert deployments["pdreg-router"]["spec"]["replicas"] >= 1  # the others keep theirs


@overlays
def test_prometheus_retention_is_bounded_by_size(overlay: str) -> None:
    deployment = by_name(render(K8S / overlay), "Deployment")["pdreg-prometheus"]
    pod = pod_spec(deployment)
    [container] = pod["containers"]
    size = flag(container["args"], "--storage.tsdb.retention.size")
    match = re.fullmatch(r"(\d+)GB", size)
    assert match, size
    data = next(m for m in container["volumeMounts"]
                if m["mountPath"] == flag(container["args"], "--storage.tsdb.path"))
    volume = next(v for v in pod["volumes"] if v["name"] == data["name"])
    limit = re.fullmatch(r"(\d+)Gi", volume["emptyDir"]["sizeLimit"])
    assert limit
    # Blocks under the limit with room for the WAL and a compaction (GB < GiB too).
    assert int(match.group(1)) <= int(limit.group(1)) * 0.8


def test_compose_prometheus_config_names_files_that_exist() -> None:
    text = (DEPLOY / "prometheus.yml").read_text()
    for name in re.findall(r"\b([\w./-]+\.ya?ml)\b", text):
        assert (DEPLOY / name).exists() or Path(name).name == "prometheus.yml", name


def test_namespace_is_named_once_per_kustomization() -> None:
    for path in (K8S / "vllm", K8S / "sglang", K8S / "secrets", KEDA):
        kustomization = yaml.safe_load((path / "kustomization.yaml").read_text())
        assert kustomization["namespace"] == NAMESPACE, path


# --- the router's metrics port -------------------------------------------------------


def test_router_metrics_port_serves_metrics_only_there() -> None:
    """--metrics-port: /metrics (member ids, engine URLs) leaves the API port, where a
    client (even with the API key) gets 404; the metrics port serves nothing else."""
    import httpx
    from standins_fleet import StaticView

    from router.service import RouterConfig, RouterServer

    config = RouterConfig(host="127.0.0.1", port=0, metrics_port=0, api_key="k")
    with RouterServer(config, StaticView()) as server:
        assert server.metrics_port and server.metrics_port != server.port
        api = f"http://127.0.0.1:{server.port}"
        metrics = f"http://127.0.0.1:{server.metrics_port}"
        key = {"authorization": "Bearer k"}
        assert httpx.get(f"{api}/metrics", headers=key).status_code == 404
        assert httpx.get(f"{api}/health").status_code == 200
        scraped = httpx.get(f"{metrics}/metrics")
        assert scraped.status_code == 200 and "pdreg_router" in scraped.text
        assert httpx.get(f"{metrics}/v1/models", headers=key).status_code == 404
    # Without the flag, as before: /metrics on the API port.
    with RouterServer(RouterConfig(host="127.0.0.1", port=0), StaticView()) as server:
        assert server.metrics_port is None
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics").status_code == 200


# --- Compose with two registries -------------------------------------------------------

TWO_REGISTRIES = DEPLOY / "docker-compose.two-registries.yml"


def _compose_two_registries() -> dict:
    result = run_tool([tool("docker-compose"), "-f", str(COMPOSE_FILE), "-f",
                       str(TWO_REGISTRIES), "config"],
                      env={"PATH": "/usr/bin:/bin", **COMPOSE_ENV}, cwd=DEPLOY)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def _published(port: str | dict) -> tuple[int, int]:
    """(host port, container port) of a Compose port: `IP:HOST:CONTAINER[/tcp]` or the
    long form."""
    if isinstance(port, dict):
        return int(port["published"]), int(port["target"])
    _, outside, inside = str(port).split("/")[0].split(":")
    return int(outside), int(inside)


def test_compose_two_registries_variant_points_every_client_at_both() -> None:
    services = _compose_two_registries()
    registries = {name: build_parser().parse_args(compose_command(services[name]))
                  for name in ("registry", "registry-2")}
    both = ",".join(f"{name}:{args.port}" for name, args in registries.items())
    # Its own ports, published unchanged: a registry announces its event and HTTP ports,
    # which clients then reach at the host name they used.
    for name, args in registries.items():
        published = dict(_published(port) for port in services[name]["ports"])
        assert all(outside == inside for outside, inside in published.items()), name
        assert set(published) == {args.port, args.events_port, args.http_port}, name
    assert len({args.port for args in registries.values()}) == 2
    clients = [name for name, service in services.items()
               if str(service.get("image", "")).startswith("pdreg:")
               and not name.startswith("registry")]
    assert sorted(clients) == ["decode-1", "decode-2", "prefill-1", "prefill-2", "router"]
    for name in clients:
        assert services[name]["environment"]["PDREG_REGISTRY"] == both, name
    # The second registry runs what the first does, credentials included.
    first, second = (services[name] for name in registries)
    assert second["image"] == first["image"]
    assert second["environment"]["PDREG_ADMIN_TOKEN"] == first["environment"]["PDREG_ADMIN_TOKEN"]
    mounts = [str(v) for v in services["prometheus"]["volumes"]]
    assert [m for m in mounts if m.endswith(":/etc/prometheus/prometheus.yml:ro")] == [
        f"{DEPLOY / 'prometheus.two-registries.yml'}:/etc/prometheus/prometheus.yml:ro"]


def test_compose_two_registries_prometheus_scrapes_both() -> None:
    main = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    two = yaml.safe_load((DEPLOY / "prometheus.two-registries.yml").read_text())
    services = _compose_two_registries()
    http = build_parser().parse_args(compose_command(services["registry-2"])).http_port
    for job in main["scrape_configs"]:
        if job["job_name"] == "pdreg-registry":
            job["static_configs"][0]["targets"].append(f"registry-2:{http}")
    assert two == main
    result = run_tool([tool("promtool"), "check", "config",
                       str(DEPLOY / "prometheus.two-registries.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
