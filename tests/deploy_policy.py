"""Rules a cluster applies to pod specs, written from the Kubernetes sources and docs, so the
rendered manifests can be held to them without a cluster:

- the kubelet's runAsNonRoot check (pkg/kubelet/kuberuntime `verifyRunAsNonRoot`): a
  container that must not run as root needs a numeric non-zero user, from its security
  context or from the image; a user *name* cannot be verified and the pod is refused
  with CreateContainerConfigError;
- which Secret/ConfigMap files a non-root process can read (files are root-owned; with
  fsGroup their group is fsGroup and the process holds it as a supplementary group);
- NetworkPolicy ingress semantics (networking.k8s.io/v1): a pod selected by any policy
  accepts only what some rule of those policies allows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SECURITY_FIELDS = ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile")
DEFAULT_VOLUME_MODE = 0o644


def effective_security(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, Any]:
    """The container's security context with the pod's as fallback (as the kubelet does)."""
    merged = {key: value for key, value in pod.get("securityContext", {}).items()
              if key in SECURITY_FIELDS}
    merged.update(container.get("securityContext", {}))
    return merged


def run_as_non_root_errors(pod: Mapping[str, Any], container: Mapping[str, Any],
                           image_user: str | None) -> list[str]:
    """What the kubelet refuses for CONTAINER; IMAGE_USER is the image's USER ("" or None
    when it sets none, i.e. root)."""
    security = effective_security(pod, container)
    name = container["name"]
    if not security.get("runAsNonRoot"):
        return []
    if "runAsUser" in security:
        return [f"{name}: runAsNonRoot with runAsUser 0"] if security["runAsUser"] == 0 else []
    uid = (image_user or "0").partition(":")[0]
    if not uid.isdigit():
        return [f"{name}: runAsNonRoot and the image has non-numeric user ({image_user}), "
                f"cannot verify user is non-root (CreateContainerConfigError)"]
    if int(uid) == 0:
        return [f"{name}: runAsNonRoot and the image will run as root"]
    return []


def unreadable_files(pod: Mapping[str, Any], container: Mapping[str, Any],
                     image_uid: int) -> list[str]:
    """Secret and ConfigMap files mounted into CONTAINER that its user cannot read."""
    security = effective_security(pod, container)
    uid = security.get("runAsUser", image_uid)
    if uid == 0:
        return []
    fs_group = pod.get("securityContext", {}).get("fsGroup")
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    problems = []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        source = volume.get("secret") or volume.get("configMap")
        if source is None:
            continue
        default = source.get("defaultMode", DEFAULT_VOLUME_MODE)
        for item in source.get("items") or [{"path": "*"}]:
            mode = item.get("mode", default)
            if not (mode & 0o004 or (mode & 0o040 and fs_group is not None)):
                problems.append(f"{container['name']}: {mount['mountPath']}/{item['path']} "
                                f"mode {mode:o} is unreadable for uid {uid} "
                                f"(fsGroup {fs_group})")
    return problems


def hardening_errors(pod: Mapping[str, Any], container: Mapping[str, Any],
                     uid: int, gid: int) -> list[str]:
    """Pod Security "restricted" for a pdreg container, and the image's own user."""
    security = effective_security(pod, container)
    name = container["name"]
    wanted = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid,
              "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
              "seccompProfile": {"type": "RuntimeDefault"}}
    problems = [f"{name}: {key} is {security.get(key)!r}, want {value!r}"
                for key, value in wanted.items() if security.get(key) != value]
    if "ALL" not in security.get("capabilities", {}).get("drop", []):
        problems.append(f"{name}: capabilities are not dropped")
    return problems


# --- Pod Security Standards: baseline -------------------------------------------------

# What "baseline" lets a container add (Pod Security Standards, "Capabilities").
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER",
                                   "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
                                   "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})


def baseline_violations(pod: Mapping[str, Any]) -> list[str]:
    """What a namespace enforcing Pod Security "baseline" refuses in POD (the checks its
    admission applies that these manifests could meet: host namespaces, hostPath
    volumes, privileged containers, added capabilities, host ports)."""
    problems = [f"spec.{key}" for key in ("hostNetwork", "hostPID", "hostIPC")
                if pod.get(key)]
    problems += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", [])
                 if "hostPath" in v]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        name = container["name"]
        security = container.get("securityContext", {})
        if security.get("privileged"):
            problems.append(f"{name}: privileged")
        added = set(security.get("capabilities", {}).get("add", []))
        problems += [f"{name}: capability {c}" for c in sorted(added - BASELINE_CAPABILITIES)]
        problems += [f"{name}: hostPort {p['hostPort']}" for p in container.get("ports", [])
                     if p.get("hostPort")]
    return problems


# --- NetworkPolicy ----------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int] = field(default_factory=dict)  # named container ports


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector: matchLabels AND matchExpressions; {} matches everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(_expression_holds(e, labels) for e in selector.get("matchExpressions", []))


def _expression_holds(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    if operator == "In":
        return labels.get(key) in expression["values"]
    if operator == "NotIn":
        return labels.get(key) not in expression["values"]
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"unknown selector operator {operator}")


def _namespace_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}  # set by the API server, immutable


def _peer_matches(peer: Mapping[str, Any], source: Pod, policy_namespace: str) -> bool:
    assert "ipBlock" not in peer, "ipBlock peers are not modelled"
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], _namespace_labels(source.namespace)):
            return False
    elif source.namespace != policy_namespace:
        return False  # a bare podSelector means pods of the policy's own namespace
    return selector_matches(peer.get("podSelector", {}), source.labels)


def _port_matches(rule_port: Mapping[str, Any], target: Pod, port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):
        return target.ports.get(wanted) == port
    return wanted <= port <= rule_port.get("endPort", wanted)


def ingress_allowed(policies: Iterable[Mapping[str, Any]], source: Pod, target: Pod,
                    port: int) -> bool:
    """Whether SOURCE may open a TCP connection to TARGET:PORT under POLICIES."""
    selecting = [p for p in policies
                 if p["metadata"]["namespace"] == target.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selector_matches(p["spec"]["podSelector"], target.labels)]
    if not selecting:
        return True  # a pod no policy selects is open
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            ports = rule.get("ports")
            if (not peers or any(_peer_matches(peer, source, target.namespace)
                                 for peer in peers)) and \
               (not ports or any(_port_matches(p, target, port) for p in ports)):
                return True
    return False
