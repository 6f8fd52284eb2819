"""deploy/k8s on a GPU cluster: the model cache every engine reads (one claim, filled once
by a Job, mounted read-only), the GPU pools' taint and a rollout that needs no spare GPU,
Pod Security "baseline" on every pod, and SGLang's RDMA option with what it needs, on the
overlays as kubectl's kustomize renders them (and validated for 1.30 and 1.37)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml
from deploy_policy import baseline_violations, hardening_errors
from deploy_support import (
    DEPLOY,
    K8S,
    KUBERNETES_VERSIONS,
    by_name,
    engine_deployment,
    engine_pair,
    env_of,
    image_user,
    is_pdreg,
    objects,
    overlays,
    pod_spec,
    render,
    run_tool,
    tool,
    workloads_by_name,
)


@overlays
def test_engine_pods_have_gpu_shared_memory_and_the_model_cache(overlay: str) -> None:
    """One model cache for the fleet: the Job fills the claim once and marks it; every
    engine pod mounts it read-only, waits for the mark, and never downloads."""
    docs = render(K8S / overlay)
    [claim] = objects(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    [job] = objects(docs, "Job")
    job_pod = job["spec"]["template"]["spec"]
    [download] = job_pod["containers"]
    job_volumes = {v["name"]: v for v in job_pod["volumes"]}
    [cache_mount] = download["volumeMounts"]
    assert job_volumes[cache_mount["name"]]["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"]}
    mark = next(a for a in download["command"] if ".pdreg-filled" in a)
    mark_path = re.search(r'"(/models/\.pdreg-filled)"', mark)[1]  # type: ignore[index]
    job_env = env_of(download)
    for role in ("prefill", "decode"):
        pod = pod_spec(engine_deployment(overlay, role))
        server, _ = engine_pair(overlay, role)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
        cache = mounts[cache_mount["mountPath"]]
        assert cache["readOnly"] is True
        assert volumes[cache["name"]]["persistentVolumeClaim"] == {
            "claimName": claim["metadata"]["name"], "readOnly": True}
        env = env_of(server)
        assert env["HF_HOME"] == job_env["HF_HOME"] and env["HF_HUB_OFFLINE"] == "1"
        assert "HF_TOKEN" not in env  # nothing to download with it
        # The model the Job fetches is the one the engine serves.
        model = download["command"][-1]
        assert model in [str(a) for a in server["args"]], (model, server["args"])
        [wait] = pod["initContainers"]
        assert mark_path in wait["command"]
        assert is_pdreg(wait) and not hardening_errors(pod, wait, *image_user())
        assert {m["mountPath"] for m in wait["volumeMounts"]} == {cache_mount["mountPath"]}
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for deployment in objects(docs, "Deployment"):
        for container in pod_spec(deployment)["containers"]:
            resources = container["resources"]
            assert resources["requests"]["cpu"] and resources["requests"]["memory"]
            assert resources["limits"]["memory"], container["name"]


@overlays
def test_engines_fit_a_full_gpu_pool(overlay: str) -> None:
    """They tolerate the GPU taint, and an update ends a pod before it starts one (a
    full pool has no GPU for a surge pod)."""
    for role in ("prefill", "decode"):
        deployment = engine_deployment(overlay, role)
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod_spec(deployment)["tolerations"]
    for name in ("pdreg-registry", "pdreg-router"):  # no GPU: no business on those nodes
        assert "tolerations" not in pod_spec(workloads_by_name(render(K8S / overlay))[name])


@overlays
def test_every_pod_passes_pod_security_baseline(overlay: str) -> None:
    """What the namespace enforces: engines' third-party images run as root, and may,
    but nothing asks for host access or an added capability."""
    docs = render(K8S / overlay)
    [namespace] = objects(docs, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    for kind in ("Deployment", "StatefulSet", "Job"):
        for workload in objects(docs, kind):
            assert not baseline_violations(pod_spec(workload)), workload["metadata"]["name"]


def test_rdma_is_an_opt_in_with_what_it_needs(tmp_path: Path) -> None:
    """The sglang-rdma component: Mooncake over RDMA on the NICs named once, an RDMA
    device and IPC_LOCK for each SGLang engine, and the Pod Security level IPC_LOCK
    needs. The default stays TCP."""
    docs = render(K8S / "sglang")
    for role in ("prefill", "decode"):
        server, _ = engine_pair("sglang", role)
        assert env_of(server)["KV_TRANSFER_BACKEND"] == "mooncake_tcp"
        assert "--disaggregation-ib-device" not in server["args"]
    copied = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copied, ignore=shutil.ignore_patterns(".env", "files"))
    path = copied / "k8s/sglang/kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    kustomization["components"].append("../sglang-rdma")
    path.write_text(yaml.safe_dump(kustomization))
    rdma = render(copied / "k8s/sglang")
    [namespace] = objects(rdma, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/warn"] == "restricted"
    for role in ("prefill", "decode"):
        deployment = by_name(rdma, "Deployment")[f"sglang-{role}"]
        server = pod_spec(deployment)["containers"][0]
        assert server["name"] == "sglang"
        env = env_of(server)
        assert env["KV_TRANSFER_BACKEND"] == "mooncake"
        args = [str(a) for a in server["args"]]
        assert args[args.index("--disaggregation-transfer-backend") + 1] == \
            "$(KV_TRANSFER_BACKEND)"
        assert args[args.index("--disaggregation-ib-device") + 1] == "$(RDMA_DEVICES)"
        assert env["RDMA_DEVICES"]
        assert server["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert baseline_violations(pod_spec(deployment)) == ["sglang: capability IPC_LOCK"]
    # Only the engines change.
    plain = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {(d["kind"], d["metadata"]["name"]) for d in rdma} == plain
    rendered = tmp_path / "rdma.yaml"
    rendered.write_text(yaml.safe_dump_all(rdma))
    for version in KUBERNETES_VERSIONS:
        result = run_tool([tool("kubernetes-validate"), "--strict", "--quiet",
                           "--kubernetes-version", version, str(rendered)])
        assert result.returncode == 0, result.stdout + result.stderr
