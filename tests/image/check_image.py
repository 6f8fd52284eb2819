"""`make test-image`: build deploy/Dockerfile for real and run the image it makes.

No container daemon and no container registry are needed, only root and buildah:

1. base   the Dockerfile's FROM (python:3.11-slim), built locally behind a stamp
          (tests/image/build-base.sh);
2. build  deploy/Dockerfile as `make image` builds it (deploy/build_image.py: `buildah
          bud --isolation chroot`, the package indexes this machine's pip uses passed as
          PIP_INDEX_URL / PIP_EXTRA_INDEX_URL), with BASE = that local base (the
          Dockerfile pins the official one by digest; no registry to pull it from here);
          every package from the hashed locks (pip --require-hashes);
   archive the OCI archive `make image` writes: its reported digest is its manifest's;
3. run    the image's rootfs mounted (`buildah mount`); each process runs in it the way
          a pod's container does: its own PID and mount namespaces, chroot, the image's
          USER (10001:10001), ENV and WORKDIR, a read-only root with an emptyDir /tmp,
          and the generated Secrets mounted at the manifests' paths with their modes:
          - every package pyproject.toml installs imports;
          - `pdreg --help` and every subcommand's --help;
          - both registries and the router from the rendered manifests' own command
            lines (ports moved to free ones, $(POD_IP) = 127.0.0.1, $(POD_NAME) each
            registry pod's name), the registries on one etcd (Debian's, on loopback, in
            place of the manifests' three members), and two sim engines (`pdreg engine
            --backend sim`, compose's command lines) with the credentials a vLLM pod's
            sidecar gets, heartbeating to both registries;
          - a completion through that router;
          - the replica set in etcd (each registry lists both), and a cordon sent to one
            registry held by the other (only the store carries it);
          - the image's own HEALTHCHECK, run inside each process's namespaces.

Prints how long each part took. Exit status 0 = every check passed.
usage: check_image.py [--image NAME] [--remove]     (root; buildah, debootstrap, kubectl,
                                                        etcd)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "deploy")]

from build_image import build, write_archive  # noqa: E402
from deploy_support import (  # noqa: E402  (after the path that finds it)
    COMPOSE_ENV,
    K8S,
    by_name,
    compose,
    compose_command,
    flag,
    generate_secrets,
    is_pdreg,
    pod_spec,
    pyproject_packages,
    render,
)
from etcd_process import EtcdProcess  # noqa: E402

from pdreg.cli import SUBCOMMANDS  # noqa: E402
from pdreg.testing import free_low_port, wait_until  # noqa: E402

OVERLAY = "vllm"  # whose sidecar's credentials the sim engines get
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 40.0
# Fields the kubelet fills from the downward API.
DOWNWARD = {"status.podIP": "127.0.0.1", "spec.nodeName": "node-a"}
_VAR_REF = re.compile(r"\$\((\w+)\)")


def log(message: str) -> None:
    print(f"test-image: {message}", flush=True)


@contextlib.contextmanager
def timed(part: str, times: dict[str, float]) -> Iterator[None]:
    start = time.monotonic()
    log(f"{part} ...")
    try:
        yield
    finally:
        times[part] = time.monotonic() - start
        log(f"{part}: {times[part]:.1f} s")


def sh(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"`{shlex.join(argv)}` failed ({result.returncode}):\n"
                         f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


# --- build ------------------------------------------------------------------------------


BASE_STAND_IN = "docker.io/library/python:3.11-slim"  # what build-base.sh commits


def build_image(image: str) -> None:
    """deploy/Dockerfile built as `make image` builds it, on the local stand-in for its
    digest-pinned base (no registry here to pull that from)."""
    build(image, base=BASE_STAND_IN, pull="never")


def check_archive(image: str, scratch: Path) -> str:
    """`make image`'s OCI archive of IMAGE: the digest it reports is the manifest's
    content address, and the manifest names the image's config and layers."""
    archive, digest = write_archive(image, scratch / "archive")
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        [entry] = index["manifests"]
        algorithm, _, hexdigest = entry["digest"].partition(":")
        blob = tar.extractfile(f"blobs/{algorithm}/{hexdigest}")
        manifest = blob.read() if blob is not None else b""
    if entry["digest"] != digest or hashlib.sha256(manifest).hexdigest() != hexdigest:
        raise SystemExit(f"OCI archive {archive}: digest {digest}, index says "
                         f"{entry['digest']}")
    layers = json.loads(manifest)["layers"]
    log(f"OCI archive {archive.name}: {len(layers)} layers, digest {digest}")
    return digest


def image_config(image: str) -> dict[str, Any]:
    inspected = json.loads(sh(["buildah", "inspect", "--type", "image", image]).stdout)
    return inspected["Docker"]["config"]


# --- a container: the mounted rootfs, run like the kubelet runs a pod's container -------


@dataclass
class Mount:
    target: str  # the path inside the container
    source: Path | None = None  # None: a tmpfs (an emptyDir)


@dataclass
class Image:
    rootfs: Path
    user: str  # "UID:GID"
    env: list[str]  # the image's ENV, NAME=VALUE
    workdir: str
    entrypoint: list[str]

    def command(self, argv: list[str], env: dict[str, str], mounts: list[Mount],
                *, entrypoint: bool = True) -> list[str]:
        """A command line (run as root here) that runs ARGV in the image as its container
        would: new PID and mount namespaces (ARGV becomes PID 1, with its own /proc),
        a read-only root, MOUNTS, then chroot as the image's user with the image's ENV
        plus ENV, in its WORKDIR."""
        root = shlex.quote(str(self.rootfs))
        steps = [f"mount --bind {root} {root}", f"mount -o remount,bind,ro {root}",
                 f"mount -t proc proc {root}/proc", f"mount --rbind /dev {root}/dev"]
        for mount in mounts:
            target = shlex.quote(str(self.rootfs) + mount.target)
            if mount.source is None:
                steps.append(f"mount -t tmpfs -o size=64m,mode=1777 tmpfs {target}")
            else:
                steps.append(f"mount --bind -o ro {shlex.quote(str(mount.source))} {target}")
        uid, _, gid = self.user.partition(":")
        environment = [*self.env, *(f"{k}={v}" for k, v in env.items())]
        program = [*self.entrypoint, *argv] if entrypoint else argv
        steps.append(shlex.join(["exec", "chroot", f"--userspec={uid}:{gid}",
                                 f"--groups={gid}", str(self.rootfs), "/usr/bin/env", "-i",
                                 "-C", self.workdir, *environment, *program]))
        return ["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
                "sh", "-ec", " && ".join(steps)]

    def prepare_mount_points(self, mounts: list[Mount]) -> None:
        """The directories the mounts go on (the kubelet makes them; the root is
        read-only once a process runs)."""
        for mount in mounts:
            (self.rootfs / mount.target.lstrip("/")).mkdir(parents=True, exist_ok=True)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    http_port: int
    argv: list[str] = field(default_factory=list)

    def container_pid(self) -> int:
        """The host pid of this container's PID 1 (unshare's forked child)."""
        children = Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = children.read_text().split() if children.exists() else []
            if pids:
                return int(pids[0])
            time.sleep(0.05)
        raise SystemExit(f"{self.name}: no process in its namespace")

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-25:])


# --- Secrets and pod specs, as the kubelet would lay them out ---------------------------


def volume_mounts(pod: dict[str, Any], container: dict[str, Any],
                  secrets: dict[str, dict[str, bytes]], scratch: Path) -> list[Mount]:
    """CONTAINER's volumeMounts as host directories: each Secret volume's items written
    with the volume's defaultMode, owned root:fsGroup (what the kubelet does); emptyDirs
    as tmpfs. Other volumes (configMaps, the model cache) are not the pdreg processes'."""
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    group = int(pod.get("securityContext", {}).get("fsGroup", 0))
    mounts = []
    for volume_mount in container.get("volumeMounts", []):
        volume = volumes[volume_mount["name"]]
        if "emptyDir" in volume:
            mounts.append(Mount(volume_mount["mountPath"]))
        elif "secret" in volume:
            source = scratch / f"{container['name']}-{volume['name']}-{len(mounts)}"
            source.mkdir(parents=True)
            data = secrets[volume["secret"]["secretName"]]
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                path = source / item["path"]
                path.write_bytes(data[item["key"]])
                os.chown(path, 0, group)
                path.chmod(volume["secret"].get("defaultMode", 0o644))
            mounts.append(Mount(volume_mount["mountPath"], source))
    return mounts


def container_env(container: dict[str, Any],
                  config_maps: dict[str, dict[str, Any]] | None = None,
                  pod_name: str = "") -> dict[str, str]:
    """CONTAINER's env as the kubelet sets it: downward-API fields (POD_NAME the pod's
    metadata.name) and ConfigMap keys (of CONFIG_MAPS, by name) filled in and $(NAME)
    references to earlier variables expanded."""
    env: dict[str, str] = {}
    downward = {**DOWNWARD, "metadata.name": pod_name}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "fieldRef" in source:
            env[item["name"]] = downward[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source and config_maps is not None:
            ref = source["configMapKeyRef"]
            env[item["name"]] = str(config_maps[ref["name"]]["data"][ref["key"]])
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def with_ports(argv: list[str], names: tuple[str, ...]) -> tuple[list[str], dict[str, int]]:
    """ARGV with each port flag in NAMES given a free port (the manifests' fixed ports
    may be taken on a shared machine)."""
    argv = list(argv)
    ports: dict[str, int] = {}
    for name in names:
        if name in argv:
            ports[name] = free_low_port(avoid=set(ports.values()))
            argv[argv.index(name) + 1] = str(ports[name])
    return argv, ports


def replaced(argv: list[str], name: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(name) + 1] = value
    return argv


# --- the checks -------------------------------------------------------------------------


class Cluster:
    def __init__(self, image: Image, scratch: Path) -> None:
        self.image = image
        self.scratch = scratch
        self.processes: list[Process] = []

    def run(self, name: str, argv: list[str], env: dict[str, str], mounts: list[Mount],
            http_port: int) -> Process:
        self.image.prepare_mount_points(mounts)
        log_path = self.scratch / f"{name}.log"
        with log_path.open("wb") as out:
            popen = subprocess.Popen(self.image.command(argv, env, mounts), stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        process = Process(name, popen, log_path, http_port, argv)
        self.processes.append(process)
        log(f"started {name}: pdreg {shlex.join(argv)}")
        return process

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.popen.poll() is None:
                with contextlib.suppress(SystemExit, ProcessLookupError):
                    os.kill(process.container_pid(), signal.SIGTERM)
        for process in self.processes:
            try:
                process.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait()

    def failed(self, why: str) -> SystemExit:
        tails = "\n".join(f"--- {p.name} (exit {p.popen.poll()}):\n{p.tail()}"
                          for p in self.processes)
        return SystemExit(f"{why}\n{tails}")

    def wait_http(self, process: Process, path: str) -> None:
        url = f"http://127.0.0.1:{process.http_port}{path}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                raise self.failed(f"{process.name} exited ({process.popen.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise self.failed(f"{process.name}: {url} did not answer 200")

    def healthcheck(self, process: Process, test: list[str]) -> str:
        """The image's HEALTHCHECK, run as Docker runs it: in the process's namespaces
        and root, as the image's user."""
        assert test[0] == "CMD", f"HEALTHCHECK {test}: expected the exec form"
        uid, _, gid = self.image.user.partition(":")
        result = subprocess.run(
            ["nsenter", "-t", str(process.container_pid()), "-m", "-p", "-r", "-w",
             "-S", uid, "-G", gid, "/usr/bin/env", "-i", *self.image.env, *test[1:]],
            capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise self.failed(f"HEALTHCHECK of {process.name} failed: "
                              f"{result.stdout}{result.stderr}")
        return result.stdout.strip()


def check_in_image(image: Image, argv: list[str], what: str) -> str:
    result = subprocess.run(image.command(argv, {}, [Mount("/tmp")], entrypoint=False),
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"{what}: `{shlex.join(argv)}` failed in the image "
                         f"({result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result.stdout


def check_packages(image: Image) -> None:
    """Every package pyproject.toml installs imports in the image, from site-packages."""
    packages = pyproject_packages()
    script = ("import importlib, sys\n"
              "for name in sys.argv[1:]:\n"
              "    print(name, importlib.import_module(name).__file__)")
    out = check_in_image(image, ["python", "-c", script, *packages], "packages")
    for line in out.splitlines():
        name, path = line.split()
        assert "-packages/" in path, f"{name} imports from {path}, not the installed wheel"
    log(f"packages import: {', '.join(packages)}")


def check_help(image: Image) -> None:
    check_in_image(image, [*image.entrypoint, "--help"], "pdreg --help")
    for name in SUBCOMMANDS:
        out = check_in_image(image, [*image.entrypoint, name, "--help"], f"pdreg {name} --help")
        assert out.startswith("usage: pdreg "), out[:200]
    log(f"--help: pdreg and {len(SUBCOMMANDS)} subcommands")


def run_cluster(image: Image, test: list[str], scratch: Path) -> None:
    _, secrets = generate_secrets(scratch / "credentials")
    docs = render(K8S / OVERLAY)
    workloads = {**by_name(docs, "Deployment"), **by_name(docs, "StatefulSet")}
    router_pod = pod_spec(workloads["pdreg-router"])
    [router_container] = router_pod["containers"]
    sidecar_pod = pod_spec(workloads[f"{OVERLAY}-prefill"])
    [sidecar] = [c for c in sidecar_pod["containers"] if c["name"] == "pdreg-agent"]
    api_key = secrets["pdreg-tokens"]["api-key"].decode()

    cluster = Cluster(image, scratch)
    etcd = EtcdProcess(scratch / "etcd-data")
    try:
        etcd.start()
        registries, registry_address = start_registries(cluster, docs, secrets, etcd)

        # Two sim engines, compose's command lines, in a sidecar's place: its env
        # (registry address, CURVE keys), its mounts and its --token-file.
        sidecar_env = {**container_env(sidecar), "PDREG_REGISTRY": registry_address}
        # Plus an emptyDir /tmp, as the registry and router have: the reference engine
        # writes its model there, and the sidecar's root is read-only.
        sidecar_mounts = [*volume_mounts(sidecar_pod, sidecar, secrets, scratch / "volumes"),
                          Mount("/tmp")]
        services = compose(COMPOSE_ENV)["services"]
        engines = []
        for name in ("prefill-1", "decode-1"):
            argv, ports = with_ports(compose_command(services[name]),
                                     ("--port", "--kv-port", "--bootstrap-port"))
            assert flag(argv, "--backend") == "sim", name
            argv = [*replaced(argv, "--advertise-host", "127.0.0.1"),
                    "--token-file", flag(sidecar["args"], "--token-file")]
            engines.append(cluster.run(name, argv, sidecar_env, sidecar_mounts,
                                       ports["--port"]))
        for engine in engines:
            cluster.wait_http(engine, "/health")

        # The router: its manifest's args and env, port moved, pointed at the registry.
        router_env = container_env(router_container, by_name(docs, "ConfigMap"))
        argv, ports = with_ports([expand(str(a), router_env) for a in router_container["args"]],
                                 ("--port", "--metrics-port"))
        # The engines answer on loopback here, where a cluster has its pod network: the
        # manifest's allowance plus loopback.
        argv = replaced(argv, "--allow-upstream",
                        f"{flag(argv, '--allow-upstream')},127.0.0.0/8")
        router = cluster.run(
            "router", argv, {**router_env, "PDREG_REGISTRY": registry_address},
            volume_mounts(router_pod, router_container, secrets, scratch / "volumes"),
            ports["--port"])
        cluster.wait_http(router, "/health")

        completion = complete(cluster, router, api_key)
        log(f"completion through the router: {completion!r}")

        # /metrics (member ids, engine URLs) only on the metrics port Prometheus scrapes.
        api_metrics = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics",
                                headers={"authorization": f"Bearer {api_key}"}, timeout=10)
        scraped = httpx.get(f"http://127.0.0.1:{ports['--metrics-port']}/metrics", timeout=10)
        if api_metrics.status_code != 404 or "pdreg_router_ttft_seconds" not in scraped.text:
            raise cluster.failed(f"router metrics: API port {api_metrics.status_code}, "
                                 f"metrics port {scraped.status_code}")
        log("router /metrics: 404 on the API port, served on --metrics-port")

        for process in cluster.processes:
            log(f"HEALTHCHECK {process.name}: {cluster.healthcheck(process, test)}")
        check_store(cluster, registries, secrets)
    finally:
        cluster.stop()
        etcd.stop()


def start_registries(cluster: Cluster, docs: list[dict[str, Any]],
                     secrets: dict[str, dict[str, bytes]],
                     etcd: EtcdProcess) -> tuple[list[Process], str]:
    """Both registry pods from the manifest's args (ports moved, advertised on loopback),
    on ETCD in place of the manifests' members; (them, PDREG_REGISTRY naming both)."""
    workload = by_name(docs, "StatefulSet")["pdreg-registry"]
    pod = pod_spec(workload)
    [container] = pod["containers"]
    registries, addresses = [], []
    for ordinal in range(int(workload["spec"]["replicas"])):
        name = f"pdreg-registry-{ordinal}"
        env = container_env(container, by_name(docs, "ConfigMap"), pod_name=name)
        argv, ports = with_ports([expand(str(a), env) for a in container["args"]],
                                 ("--port", "--events-port", "--http-port"))
        argv = replaced(argv, "--store", f"etcd://{etcd.endpoint}/pdreg")
        argv = replaced(argv, "--advertise-host", "127.0.0.1")
        registries.append(cluster.run(
            name, argv, env, volume_mounts(pod, container, secrets,
                                           cluster.scratch / "volumes" / name),
            ports["--http-port"]))
        addresses.append(f"127.0.0.1:{ports['--port']}")
    for registry in registries:
        cluster.wait_http(registry, "/healthz")
    return registries, ",".join(addresses)


def check_store(cluster: Cluster, registries: list[Process],
                secrets: dict[str, dict[str, bytes]]) -> None:
    """Each registry lists both in the replica set, and a cordon sent to the first is
    held by every one (a cordon reaches the others through etcd alone)."""
    names = {r.name for r in registries}
    urls = {r.name: f"http://127.0.0.1:{r.http_port}" for r in registries}
    # Bound beyond loopback, reads need a token too: the admin token reads.
    admin = {"authorization": "Bearer " + secrets["pdreg-tokens"]["admin-token"].decode()
             .splitlines()[0]}

    def read(url: str) -> list[dict[str, Any]]:
        response = httpx.get(url, headers=admin, timeout=5)
        if response.status_code != 200:
            raise cluster.failed(f"{url}: {response.status_code} {response.text[:300]}")
        return list(response.json())
    for name, url in urls.items():
        if not wait_until(lambda url=url: {e["id"] for e in read(
                f"{url}/v1/registries")} == names, 20.0):
            raise cluster.failed(f"{name}: the replica set in etcd does not list {names}")
    first = urls[registries[0].name]
    member = next(m["id"] for m in read(f"{first}/v1/members") if m["role"] == "decode")
    answer = httpx.post(f"{first}/v1/members/{member}/cordon", headers=admin, timeout=10)
    if answer.status_code != 200 or not answer.json().get("shared"):
        raise cluster.failed(f"cordon at {registries[0].name}: {answer.status_code} "
                             f"{answer.text[:300]}")

    def cordoned_everywhere() -> bool:
        return all({m["id"]: m["cordoned"] for m in read(f"{url}/v1/members")}.get(member)
                   for url in urls.values())
    if not wait_until(cordoned_everywhere, 10.0):
        raise cluster.failed(f"{member} cordoned at {registries[0].name}, not on every "
                             "registry")
    log(f"etcd: the replica set lists {sorted(names)}; {member} cordoned at "
        f"{registries[0].name} is cordoned on every registry")


def complete(cluster: Cluster, router: Process, api_key: str) -> str:
    """A completion through ROUTER once it has a prefill and a decode (it answers 503
    until the registry has told it about both)."""
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    body = {"model": "tiny", "prompt": "Hello from the image", "max_tokens": 8}
    headers = {"authorization": f"Bearer {api_key}"}
    unauthorized = httpx.post(url, json=body, timeout=10)
    if unauthorized.status_code != 401:
        raise cluster.failed(f"router without the API key: {unauthorized.status_code}")
    deadline = time.monotonic() + START_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        try:
            response = httpx.post(url, json=body, headers=headers, timeout=30)
        except httpx.HTTPError as exc:
            last = str(exc)
        else:
            if response.status_code == 200:
                choice = response.json()["choices"][0]
                usage = response.json()["usage"]
                if usage["completion_tokens"] != body["max_tokens"]:
                    raise cluster.failed(f"completion: {response.text}")
                return str(choice["text"])
            last = f"{response.status_code} {response.text[:300]}"
        time.sleep(0.5)
    raise cluster.failed(f"no completion through the router: {last}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", default=None,
                        help="the tag to build (default: the pdreg image the manifests "
                             "name, as deploy/k8s/images sets it)")
    parser.add_argument("--remove", action="store_true",
                        help="remove the built image afterwards (kept by default: its "
                             "layers make the next build fast)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("test-image: run as root (buildah, chroot and mounts need it)")
    if args.image is None:
        # The name a node would look up: built under it, the manifests' IfNotPresent
        # finds it (buildah keeps a short name as localhost/NAME).
        [args.image] = {c["image"] for d in render(K8S / OVERLAY)
                        if d["kind"] in ("Deployment", "StatefulSet")
                        for c in pod_spec(d)["containers"] if is_pdreg(c)}
    times: dict[str, float] = {}
    started = time.monotonic()
    with timed("base image", times):
        sh([str(REPO / "tests/image/build-base.sh")], timeout=900)
    with timed("image build", times):
        build_image(args.image)
    with timed("OCI archive", times), tempfile.TemporaryDirectory() as archives:
        check_archive(args.image, Path(archives))
    config = image_config(args.image)
    container = sh(["buildah", "from", "--pull-never", args.image]).stdout.strip()
    try:
        rootfs = Path(sh(["buildah", "mount", container]).stdout.strip())
        image = Image(rootfs, config["User"], config.get("Env") or [],
                      config.get("WorkingDir") or "/", config.get("Entrypoint") or [])
        assert image.user and not image.user.startswith("0"), f"image user {image.user!r}"
        test = (config.get("Healthcheck") or {}).get("Test")
        assert test, "the image has no HEALTHCHECK (built without --format docker?)"
        with tempfile.TemporaryDirectory(prefix="pdreg-image-") as scratch:
            os.chmod(scratch, 0o755)
            with timed("packages and --help", times):
                check_packages(image)
                check_help(image)
            with timed("cluster in the image", times):
                run_cluster(image, test, Path(scratch))
    finally:
        subprocess.run(["buildah", "umount", container], capture_output=True)
        subprocess.run(["buildah", "rm", container], capture_output=True)
        if args.remove:
            subprocess.run(["buildah", "rmi", args.image], capture_output=True)
    log("passed: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
        + f"; total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
