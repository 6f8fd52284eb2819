"""Pods of the rendered manifests run as local processes, the way a kubelet runs them.

Each pod gets an address of its own on the loopback network (`POD_NETWORK`, this
cluster's pod CIDR): where a manifest binds 0.0.0.0 the pod binds its address, and where
it says 127.0.0.1 (a container reaching another of its pod) it means that address. So
every port stays the manifest's, two pods never collide, and the address a connection
goes to names the pod it reaches. The rest is what a kubelet does:

- commands, args and env from the pod template; env from values, the downward API
  (status.podIP, spec.nodeName, metadata.*) and ConfigMap keys; `$(VAR)` expanded;
- cluster DNS: a StatefulSet pod's `NAME-N.SERVICE[.NAMESPACE[.svc.cluster.local]]`
  and a Service's name resolve to pod addresses (a Service to its first ready pod);
- volumes: Secret and ConfigMap items as files, emptyDirs as directories of the pod's,
  a PersistentVolumeClaim as one directory every pod that mounts it shares, a
  StatefulSet's volumeClaimTemplates as a directory per pod (`TEMPLATE-POD`, kept when
  the pod goes); a path under a mount point becomes the same path under that directory;
- a StatefulSet's pods are all created (named, addressed) before any starts, as its
  controller does with podManagementPolicy Parallel: members that name each other (etcd's
  --initial-cluster) resolve every name;
- stop: every container's preStop hook, then SIGTERM, SIGKILL after the grace period.

Images are not run: a pdreg container runs `python -m pdreg ARGS` (the image's
ENTRYPOINT) or its own `command` with this Python, and others run what `stand_ins`
says (a sim engine for vLLM or SGLang, Debian's Prometheus). Init containers run to
completion first, in order. Every process runs under `strace -e trace=connect`, so the
connections each pod makes can be checked against the NetworkPolicies afterwards.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets as random_names
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy_support import image_name

POD_NETWORK = ipaddress.ip_network("127.77.0.0/16")
NODES = ("node-a", "node-b")  # spec.nodeName, alternately
_VAR = re.compile(r"\$\((\w+)\)")
_ANY_HOST = re.compile(r"(?<![\w.])(?:0\.0\.0\.0|127\.0\.0\.1|localhost)(?![\w.])")


@dataclass
class Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    ready_url: str | None  # the readiness probe's URL; None: no probe
    pre_stop: list[str] | None
    trace: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    past_traces: list[Path] = field(default_factory=list)  # of runs before a restart


@dataclass
class Pod:
    name: str
    workload: str
    namespace: str
    ip: str
    node: str
    labels: dict[str, str]
    ports: dict[str, int]  # named container ports
    grace_s: float
    init: list[Container] = field(default_factory=list)  # run to completion, in order
    containers: list[Container] = field(default_factory=list)
    hooks: list[subprocess.Popen[bytes]] = field(default_factory=list)
    terminating_since: float | None = None
    killed_at: float | None = None

    def running(self) -> bool:
        return any(c.proc is not None and c.proc.poll() is None for c in self.containers)


# A stand-in, by image name (`vllm-openai`, `sglang`, `prometheus`): (pod, container
# spec, its args and env as the kubelet made them, local directories by mount path) ->
# the command to run instead of the image.
StandIn = Callable[[Pod, dict[str, Any], list[str], dict[str, str], dict[str, Path]],
                   list[str]]


def traced(argv: list[str], trace: Path) -> list[str]:
    """ARGV under strace, recording every connect() of every thread and child.

    Nothing outlives the run: strace takes fatal signals (`-I 1`; with `-o` it would
    block them), and ARGV gets SIGTERM when strace dies (setpriv --pdeathsig, kept
    across exec), so a run killed any way takes its pods with it."""
    return ["strace", "-I", "1", "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect",
            "-e", "signal=none", "-o", str(trace),
            "setpriv", "--pdeathsig", "SIGTERM", "--", *argv]


class Kubelet:
    """Holds the rendered objects (the API server's view), gives out pod addresses,
    resolves names, and starts and stops pods."""

    def __init__(self, docs: list[dict[str, Any]], work: Path,
                 secrets: Mapping[str, Mapping[str, bytes]],
                 stand_ins: Mapping[str, StandIn]) -> None:
        self.docs = docs
        self.work = work
        self.secrets = secrets
        self.stand_ins = stand_ins
        self.namespace = next(d["metadata"]["name"] for d in docs if d["kind"] == "Namespace")
        self.workloads = {d["metadata"]["name"]: d for d in docs
                          if d["kind"] in ("Deployment", "StatefulSet", "Job")}
        self.config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        self.pods: dict[str, Pod] = {}  # every pod ever started, by name (gone ones too)
        self._hosts = iter(POD_NETWORK.hosts())
        next(self._hosts)  # .0.1 stays unused: easy to tell from a pod

    # --- names ---------------------------------------------------------------------

    def live(self, workload: str | None = None) -> list[Pod]:
        return [p for p in self.pods.values() if p.terminating_since is None
                and (workload is None or p.workload == workload)]

    def by_ip(self, ip: str) -> Pod | None:
        return next((p for p in self.pods.values() if p.ip == ip), None)

    def resolve(self, name: str) -> str | None:
        """Cluster DNS for NAME: a StatefulSet pod through its headless Service, or a
        Service (its first live pod)."""
        for suffix in (".svc.cluster.local", ".svc", f".{self.namespace}"):
            name = name.removesuffix(suffix)
        pod_name, _, service = name.partition(".")
        if service:
            pod = self.pods.get(pod_name)
            workload = self.workloads.get(pod.workload) if pod else None
            if pod and workload and workload["spec"].get("serviceName") == service:
                return pod.ip
            return None
        svc = self.services.get(name)
        if svc is None:
            return None
        selector = svc["spec"]["selector"]
        for pod in self.live():
            if all(pod.labels.get(k) == v for k, v in selector.items()):
                return pod.ip
        return None

    def dns(self, text: str) -> str:
        """Every `name:port` whose name the cluster resolves, as `address:port`."""
        def swap(match: re.Match[str]) -> str:
            return self.resolve(match.group(1)) or match.group(1)
        return re.sub(r"(?<![\w.-])([a-z0-9][a-z0-9.-]*[a-z0-9])(?=:\d)", swap, text)

    # --- pods --------------------------------------------------------------------------

    def new_pod(self, workload_name: str, ordinal: int | None = None) -> Pod:
        pod = self._place(workload_name, ordinal)
        self._build(pod)
        return pod

    def new_stateful_pods(self, workload_name: str, count: int) -> list[Pod]:
        """A StatefulSet's pods 0..COUNT-1: every one named and addressed first, so that
        each pod's args resolve the others' stable names."""
        pods = [self._place(workload_name, i) for i in range(count)]
        for pod in pods:
            self._build(pod)
        return pods

    def _place(self, workload_name: str, ordinal: int | None) -> Pod:
        template = self.workloads[workload_name]["spec"]["template"]
        name = (f"{workload_name}-{ordinal}" if ordinal is not None
                else f"{workload_name}-{random_names.token_hex(3)}")
        spec = template["spec"]
        pod = Pod(name, workload_name, self.namespace, str(next(self._hosts)),
                  NODES[len(self.pods) % len(NODES)], dict(template["metadata"]["labels"]),
                  {p["name"]: p["containerPort"] for c in spec["containers"]
                   for p in c.get("ports", [])},
                  float(spec.get("terminationGracePeriodSeconds", 30)))
        self.pods[name] = pod
        return pod

    def _build(self, pod: Pod) -> None:
        workload = self.workloads[pod.workload]
        spec = workload["spec"]["template"]["spec"]
        # A StatefulSet's claims, one per pod by template name (Kubernetes' naming).
        claims = {t["metadata"]["name"]: f"{t['metadata']['name']}-{pod.name}"
                  for t in workload["spec"].get("volumeClaimTemplates", [])}
        mounts_root = self.work / "pods" / pod.name
        for key, into in (("initContainers", pod.init), ("containers", pod.containers)):
            for container in spec.get(key, []):
                mounts = self._volumes(spec, container, mounts_root / container["name"],
                                       claims)
                into.append(self._container(pod, container, mounts))

    def _container(self, pod: Pod, spec: dict[str, Any], mounts: dict[str, Path]) -> Container:
        env = self._env(pod, spec, mounts)
        args = [self._local(pod, _expand(str(a), env), mounts) for a in spec.get("args", [])]
        image = image_name(spec["image"])
        if image == "pdreg" and spec.get("command"):  # its Python, another program
            command = [sys.executable if c in ("python", "python3") else
                       self._local(pod, _expand(str(c), env), mounts) for c in spec["command"]]
            argv = [*command, *args]
        elif image == "pdreg":
            argv = [sys.executable, "-m", "pdreg", *args]  # the image's ENTRYPOINT
        else:
            argv = self.stand_ins[image](pod, spec, args, env, mounts)
        probe = spec.get("readinessProbe", {}).get("httpGet")
        ready_url = None
        if probe:
            port = probe["port"]
            port = pod.ports[port] if isinstance(port, str) else port
            ready_url = f"http://{pod.ip}:{port}{probe['path']}"
        hook = spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        pre_stop = None
        if hook:
            pre_stop = [sys.executable if part in ("python", "python3")
                        else self._local(pod, _expand(str(part), env), mounts) for part in hook]
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stem = f"{pod.name}.{spec['name']}"
        if pre_stop:
            pre_stop = traced(pre_stop, logs / f"{stem}.prestop.strace")
        return Container(spec["name"], argv, env, ready_url, pre_stop,
                         logs / f"{stem}.strace", logs / f"{stem}.log")

    def _env(self, pod: Pod, spec: dict[str, Any], mounts: dict[str, Path]) -> dict[str, str]:
        downward = {"status.podIP": pod.ip, "spec.nodeName": pod.node,
                    "metadata.name": pod.name, "metadata.namespace": pod.namespace}
        env: dict[str, str] = {}
        for item in spec.get("env", []):
            source = item.get("valueFrom", {})
            if "value" in item:
                value = _expand(str(item["value"]), env)
            elif "fieldRef" in source:
                value = downward[source["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                value = str(self.config_maps[ref["name"]]["data"][ref["key"]])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                data = self.secrets.get(ref["name"], {})
                if ref["key"] not in data and ref.get("optional"):
                    continue
                value = data[ref["key"]].decode()
            else:
                raise ValueError(f"{pod.name}: env {item['name']}: unsupported source")
            env[item["name"]] = self._local(pod, value, mounts)
        return env

    def _local(self, pod: Pod, text: str, mounts: Mapping[str, Path]) -> str:
        """TEXT as this pod sees it here: its own address for the wildcard and loopback,
        cluster names resolved, mounted paths under their local directories."""
        flag = ""
        if text.startswith("--") and "=" in text:  # --config.file=/etc/prometheus/...
            name, _, text = text.partition("=")
            flag = f"{name}="
            if re.fullmatch(r":\d+", text):  # --web.listen-address=:9090: every address
                text = pod.ip + text
        for inside in sorted(mounts, key=len, reverse=True):
            if text == inside or text.startswith(inside + "/"):
                text = str(mounts[inside]) + text[len(inside):]
                break
        return flag + self.dns(_ANY_HOST.sub(pod.ip, text))

    def _volumes(self, spec: dict[str, Any], container: dict[str, Any], root: Path,
                 claims: Mapping[str, str]) -> dict[str, Path]:
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes |= {name: {"persistentVolumeClaim": {"claimName": claim}}
                    for name, claim in claims.items()}
        mounts = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            claim = volume.get("persistentVolumeClaim")
            # A claim outlives its pods: every pod that mounts it sees the same files.
            local = self.work / "claims" / claim["claimName"] if claim else root / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                data = self.secrets[volume["secret"]["secretName"]]
                _write_items(local, volume["secret"], data)
            elif "configMap" in volume:
                data = self.config_maps[volume["configMap"]["name"]]["data"]
                _write_items(local, volume["configMap"],
                             {k: str(v).encode() for k, v in data.items()})
            mounts[mount["mountPath"]] = local
        return mounts

    def start(self, pod: Pod, init_timeout_s: float = 120.0) -> None:
        """Run POD's init containers, one after the other, to success; then start every
        container. From the main thread (children die with it)."""
        for init in pod.init:
            with init.log.open("ab") as log:
                result = subprocess.run(traced(init.argv, init.trace), stdout=log,
                                        stderr=subprocess.STDOUT, env=_process_env(init.env),
                                        timeout=init_timeout_s)
            if result.returncode != 0:
                raise SystemExit(f"{pod.name}: init container {init.name} failed "
                                 f"({result.returncode}):\n{init.log.read_text()[-2000:]}")
        for container in pod.containers:
            with container.log.open("ab") as log:
                container.proc = subprocess.Popen(
                    traced(container.argv, container.trace), stdout=log,
                    stderr=subprocess.STDOUT, env=_process_env(container.env),
                    preexec_fn=_die_with_parent)

    def crash_and_restart(self, pod: Pod) -> None:
        """Every container of POD killed -9 and started again, as the kubelet restarts a
        crashed container: the same pod, address and volumes, nothing of its memory."""
        for container in pod.containers:
            if container.proc is not None and container.proc.poll() is None:
                _signal_traced(container.proc, signal.SIGKILL)
                container.proc.wait(10)
            past = container.trace.with_suffix(f".{len(container.past_traces)}.strace")
            container.trace.rename(past)
            container.past_traces.append(past)
        self.start(pod)

    def terminate(self, pod: Pod, now: float) -> None:
        """Begin POD's end: every container's preStop hook at once (each container gets
        SIGTERM when its hook returns: `reap`)."""
        pod.terminating_since = now
        for container in pod.containers:
            if container.pre_stop:
                log = container.log.open("ab")
                pod.hooks.append(subprocess.Popen(container.pre_stop, stdout=log,
                                                  stderr=subprocess.STDOUT,
                                                  env=_process_env(container.env),
                                                  preexec_fn=_die_with_parent))
                log.close()
                container.pre_stop = None  # run once
            elif container.proc is not None and container.proc.poll() is None:
                _signal_traced(container.proc, signal.SIGTERM)

    def reap(self, pod: Pod, now: float) -> bool:
        """Advance a terminating POD; True once every container has exited."""
        assert pod.terminating_since is not None
        if pod.hooks and all(h.poll() is not None for h in pod.hooks):
            pod.hooks.clear()
            for container in pod.containers:
                if container.proc is not None and container.proc.poll() is None:
                    _signal_traced(container.proc, signal.SIGTERM)
        if now - pod.terminating_since > pod.grace_s and pod.killed_at is None:
            pod.killed_at = now
            for process in [*pod.hooks, *(c.proc for c in pod.containers if c.proc)]:
                if process.poll() is None:
                    _signal_traced(process, signal.SIGKILL)
        return not pod.running()


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR): a defined variable's value, else the text as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _write_items(directory: Path, source: Mapping[str, Any], data: Mapping[str, bytes]) -> None:
    items = source.get("items") or [{"key": k, "path": k} for k in data]
    for item in items:
        path = directory / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[item["key"]])
        path.chmod(item.get("mode", source.get("defaultMode", 0o644)) | 0o400)


def _process_env(env: Mapping[str, str]) -> dict[str, str]:
    """The container's env over this process's, minus anything pdreg reads that the
    container does not set."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDREG_")}
    return {**base, **env}


def _die_with_parent() -> None:
    from pdreg.testing import die_with_parent
    die_with_parent()


def _signal_traced(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the traced program, not strace (strace then exits with it)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    try:
        pids = children.read_text().split()
    except OSError:
        pids = []
    for pid in pids or [str(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signum)
