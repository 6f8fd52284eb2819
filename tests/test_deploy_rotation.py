"""A client key rotated as deploy/k8s/secrets says, against real registries: the Secrets
rendered by kubectl's kustomize after each step of rotate-client-key.sh, laid out as the
registry's manifest mounts them (the allowlist Secret whole: every key), and a registry
started on them each time, as `rollout restart statefulset/pdreg-registry` does. At no
step is a client refused whose key the fleet is using or moving to; the old key is out
only once every client has the new one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from deploy_support import K8S, generate_secrets, pod_spec, render, rendered_secrets

from registry.addresses import request_snapshot
from registry.security import ClientCurve, ServerCurve
from registry.server import RegistryServer

REGISTRY_ALLOWED = "/etc/pdreg/allowed-clients"


def _allowlist_mount() -> str:
    """Where the registry's manifest mounts the allowlist, and that it mounts it whole."""
    pod = pod_spec(next(d for d in render(K8S / "vllm") if d["kind"] == "StatefulSet"
                        and d["metadata"]["name"] == "pdreg-registry"))
    volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName")
                  == "pdreg-allowed-clients")
    assert "items" not in volume["secret"], "every allowed key, not a chosen few"
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    return str(mount["mountPath"])


def _start(registry_factory: Callable[..., RegistryServer],
           secrets: Mapping[str, Mapping[str, bytes]], root: Path) -> RegistryServer:
    """A registry on the Secrets as mounted: its key pair, and the allowlist directory
    holding every key of pdreg-allowed-clients."""
    root.mkdir(parents=True)
    (root / "registry.key_secret").write_bytes(secrets["pdreg-curve"]["registry.key_secret"])
    allowed = root / "allowed-clients"
    allowed.mkdir()
    for name, data in secrets["pdreg-allowed-clients"].items():
        (allowed / name).write_bytes(data)
    return registry_factory(curve=ServerCurve.from_files(root / "registry.key_secret",
                                                         allowed_clients=allowed))


def _client(secrets: Mapping[str, Mapping[str, bytes]], root: Path) -> ClientCurve:
    """The clients' pair from pdreg-curve, as a router or sidecar mounts it."""
    root.mkdir(parents=True)
    (root / "registry.key").write_bytes(secrets["pdreg-curve"]["registry.key"])
    (root / "client.key_secret").write_bytes(secrets["pdreg-curve"]["client.key_secret"])
    return ClientCurve.from_files(root / "registry.key", root / "client.key_secret")


def _reaches(registry: RegistryServer, client: ClientCurve) -> bool:
    try:
        request_snapshot(registry.control_address, curve=client, timeout_s=1.5)
    except TimeoutError:  # a key ZAP refuses gets no answer at all
        return False
    return True


def test_a_client_key_rotates_without_a_refused_client(
        tmp_path: Path, registry_factory: Callable[..., RegistryServer]) -> None:
    assert _allowlist_mount() == REGISTRY_ALLOWED
    files, before = generate_secrets(tmp_path / "credentials")
    directory = files.parent
    env = {**os.environ, "PDREG": f"{sys.executable} -m pdreg"}

    def rotate(step: str) -> dict[str, dict[str, bytes]]:
        result = subprocess.run([str(directory / "rotate-client-key.sh"), step],
                                capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        return rendered_secrets(directory)

    old = _client(before, tmp_path / "old-client")
    assert set(before["pdreg-allowed-clients"]) == {"client.key"}
    first = _start(registry_factory, before, tmp_path / "r1")
    assert _reaches(first, old)

    during = rotate("begin")
    assert set(during["pdreg-allowed-clients"]) == {"client.key", "client-next.key"}
    assert during["pdreg-curve"] == before["pdreg-curve"]  # clients keep their pair
    # The registries restart onto both keys; the clients then move, one by one.
    second = _start(registry_factory, during, tmp_path / "r2")
    new_pair = tmp_path / "new-pair"
    new_pair.mkdir()
    (new_pair / "registry.key").write_bytes(before["pdreg-curve"]["registry.key"])
    (new_pair / "client.key_secret").write_bytes(
        (files / "curve-next/client.key_secret").read_bytes())
    new = ClientCurve.from_files(new_pair / "registry.key", new_pair / "client.key_secret")
    assert _reaches(second, old) and _reaches(second, new)

    after = rotate("finish")
    assert set(after["pdreg-allowed-clients"]) == {"client.key"}
    assert after["pdreg-allowed-clients"]["client.key"] == during["pdreg-allowed-clients"][
        "client-next.key"]
    assert _client(after, tmp_path / "after-client").public == new.public
    # Clients restarted onto the new pair while the running registries still accept
    # both; then the registries restart, and the old key is out.
    assert _reaches(second, new)
    third = _start(registry_factory, after, tmp_path / "r3")
    assert _reaches(third, new)
    assert not _reaches(third, old)


def test_rotation_refuses_steps_out_of_order(tmp_path: Path) -> None:
    files, _ = generate_secrets(tmp_path / "credentials")
    script = files.parent / "rotate-client-key.sh"
    env = {**os.environ, "PDREG": f"{sys.executable} -m pdreg"}
    finish = subprocess.run([str(script), "finish"], capture_output=True, text=True,
                            timeout=60, env=env)
    assert finish.returncode == 1 and "begin first" in finish.stderr
    assert subprocess.run([str(script), "begin"], capture_output=True, timeout=60,
                          env=env).returncode == 0
    again = subprocess.run([str(script), "begin"], capture_output=True, text=True,
                           timeout=60, env=env)
    assert again.returncode == 1 and "under way" in again.stderr


def test_the_allowlist_refuses_key_file_names_a_secret_cannot_hold(tmp_path: Path) -> None:
    files, _ = generate_secrets(tmp_path / "credentials")
    (files / "allowed-clients" / "bad name.key").write_text("x")
    result = subprocess.run([str(files.parent / "generate.sh")], capture_output=True,
                            text=True, timeout=60,
                            env={**os.environ, "PDREG": f"{sys.executable} -m pdreg"})
    assert result.returncode != 0 and "key file names" in result.stderr
