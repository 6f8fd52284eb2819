"""What runs where the manifests name an image that cannot run here.

- the model-download Job (in the engine's image): the mark its script leaves once the
  cache is filled, which the engine pods' init containers wait for; no download.
- `vllm-openai`, `sglang`: the reference engine with its sim backend (`pdreg engine
  --backend sim --no-register`), serving what the pod's sidecar reads of vLLM or SGLang
  (/health or /ready, /metrics, /v1/models, /server_info) and speaking the handshake of
  the engine it stands for, on the container's own --port, model name (--served-model-name)
  and KV port (vLLM's NIXL side channel) or bootstrap port (SGLang's). The sidecar beside
  it is the manifest's own `pdreg agent`, and registers it.
- `etcd`: Debian's etcd (3.4; the manifests pin 3.6, whose flags these are too), the
  container's own flags: the members form their cluster over the pod addresses, and the
  registries keep their store there.
- `prometheus`: Debian's Prometheus, the container's own flags, the rendered
  prometheus.yml. Debian builds it without Kubernetes service discovery, so the
  `kubernetes_sd_configs` block becomes a file the run writes (`write_pod_targets`) with
  the same `__meta_kubernetes_pod_*` labels Kubernetes discovery gives, one target per
  pod of the namespace: the rendered relabelling then picks the address and port.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from deploy_support import flag
from kubelet import Pod, StandIn

__all__ = ["SIM", "stand_ins", "write_pod_targets"]

# A GPU's timings, slowed so that two cores carry the load: seconds per prompt token
# (prefill) and per output token (decode); requests computed at once per engine.
SIM = {"prefill_s_per_token": 0.006, "decode_s_per_token": 0.03, "max_running": 8}


def _engine(protocol: str) -> StandIn:
    def run(pod: Pod, spec: dict[str, Any], args: list[str], env: dict[str, str],
            mounts: dict[str, Path]) -> list[str]:
        if "pdreg.io/role" not in pod.labels:  # the model-download Job, in the image
            return _download(spec, mounts)
        role = pod.labels["pdreg.io/role"]
        argv = [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "engine",
                "--role", role, "--backend", "sim", "--no-register",
                "--host", flag(args, "--host"), "--port", flag(args, "--port"),
                "--advertise-host", pod.ip, "--model", flag(args, "--served-model-name"),
                "--protocol", protocol, "--max-running", str(SIM["max_running"]),
                "--sim-prefill-delay", str(SIM["prefill_s_per_token"]),
                "--sim-decode-delay", str(SIM["decode_s_per_token"])]
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
            argv += ["--kv-port", env["VLLM_NIXL_SIDE_CHANNEL_PORT"]]
        if "--disaggregation-bootstrap-port" in args:
            argv += ["--bootstrap-port", flag(args, "--disaggregation-bootstrap-port")]
        return argv
    return run


def _download(spec: dict[str, Any], mounts: dict[str, Path]) -> list[str]:
    """The model-download Job leaves what its script leaves, the mark the engine pods
    wait for, without the download (no model hub here)."""
    script = next(part for part in spec["command"] if ".pdreg-filled" in part)
    mark = re.search(r'"(/[^"]+\.pdreg-filled)"', script)
    assert mark, script
    inside = mark.group(1)
    mount = next(m for m in sorted(mounts, key=len, reverse=True) if inside.startswith(m + "/"))
    local = mounts[mount] / inside[len(mount) + 1:]
    return [sys.executable, "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text("
            "sys.argv[2])", str(local), str(spec["command"][-1])]


def _prometheus(targets: Path, interval_s: float) -> StandIn:
    def run(pod: Pod, spec: dict[str, Any], args: list[str], env: dict[str, str],
            mounts: dict[str, Path]) -> list[str]:
        config_file = Path(flag(args, "--config.file"))
        config = yaml.safe_load(config_file.read_text())
        config["global"]["scrape_interval"] = f"{interval_s:g}s"
        config["global"]["evaluation_interval"] = f"{interval_s:g}s"
        for job in config["scrape_configs"]:
            [sd] = job.pop("kubernetes_sd_configs")
            assert sd == {"role": "pod", "namespaces": {"own_namespace": True}}, sd
            job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "1s"}]
        config_file.write_text(yaml.safe_dump(config))
        return ["prometheus", *args, "--log.level=warn"]
    return run


def _etcd(pod: Pod, spec: dict[str, Any], args: list[str], env: dict[str, str],
          mounts: dict[str, Path]) -> list[str]:
    """The image's etcd, Debian's here, with the container's flags as the kubelet made
    them (addresses the pod's, the data directory on the pod's claim)."""
    assert Path(spec["command"][0]).name == "etcd", spec["command"]
    return ["etcd", *args]


def stand_ins(targets: Path, scrape_interval_s: float) -> dict[str, StandIn]:
    return {"vllm-openai": _engine("vllm-nixl"), "sglang": _engine("sglang"),
            "prometheus": _prometheus(targets, scrape_interval_s), "etcd": _etcd}


def _label(name: str) -> str:
    """Kubernetes discovery's label-name sanitising: anything but [a-zA-Z0-9_] -> _."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def write_pod_targets(path: Path, pods: Iterable[Pod],
                      annotations: Mapping[str, Mapping[str, str]]) -> None:
    """The namespace's pods as Kubernetes pod discovery would list them (ANNOTATIONS: each
    pod's, by workload), written whole and renamed into place (file discovery may read
    at any moment)."""
    groups = []
    for pod in pods:
        labels = {"__meta_kubernetes_namespace": pod.namespace,
                  "__meta_kubernetes_pod_name": pod.name,
                  "__meta_kubernetes_pod_ip": pod.ip,
                  "__meta_kubernetes_pod_node_name": pod.node,
                  "__meta_kubernetes_pod_ready": "true"}
        for key, value in pod.labels.items():
            labels[f"__meta_kubernetes_pod_label_{_label(key)}"] = value
            labels[f"__meta_kubernetes_pod_labelpresent_{_label(key)}"] = "true"
        for key, value in annotations.get(pod.workload, {}).items():
            labels[f"__meta_kubernetes_pod_annotation_{_label(key)}"] = value
            labels[f"__meta_kubernetes_pod_annotationpresent_{_label(key)}"] = "true"
        port = next(iter(pod.ports.values()), 80)
        groups.append({"targets": [f"{pod.ip}:{port}"], "labels": labels})
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(groups, indent=1))
    scratch.replace(path)
