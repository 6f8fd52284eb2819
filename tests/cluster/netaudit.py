"""Every connection a run made, checked against the rendered NetworkPolicies.

Each process ran under `strace -e trace=connect` (kubelet.py), so its trace file lists
every TCP connection it opened or tried, by destination address and port. The source is
the pod whose process wrote the file (or a pod the run plays: an operator's CLI, KEDA);
the destination is the pod that holds the address. A connection within one pod is
always allowed (in a cluster it never leaves the pod's network namespace); any other is
held to `deploy_policy.ingress_allowed`, the NetworkPolicy semantics the unit tests
check. One the policies would drop fails the run; one to an address no pod holds is
reported too (nothing in the fleet should reach outside the pod network here).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy_policy import Pod, ingress_allowed

__all__ = ["Audit", "Peer", "audit", "connections_in"]

# 1234 connect(7, {sa_family=AF_INET, sin_port=htons(7600), sin_addr=inet_addr("10.1.2.3")}, 16)
_CONNECT_V4 = re.compile(r'connect\(\d+, \{sa_family=AF_INET, sin_port=htons\((\d+)\), '
                         r'sin_addr=inet_addr\("([\d.]+)"\)')
_CONNECT_V6 = re.compile(r'connect\(\d+, \{sa_family=AF_INET6, sin6_port=htons\((\d+)\), '
                         r'[^}]*inet_pton\(AF_INET6, "([0-9a-fA-F:.]+)"')
_LOOPBACK = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class Peer:
    """One side of a connection: a pod as the policies see it, and a name to print."""

    name: str  # the workload (or the played actor: operator, keda, client)
    pod: Pod
    ip: str = ""


@dataclass(frozen=True)
class Audit:
    allowed: Counter[tuple[str, str, str]]  # (source, destination, port name) -> count
    denied: Counter[tuple[str, str, str]]
    outside: Counter[tuple[str, str]]  # (source, "address:port") -> count

    @property
    def ok(self) -> bool:
        return not self.denied and not self.outside

    def report(self) -> str:
        lines = [f"  {'allowed' if key in self.allowed else 'DENIED':8} {src} -> {dst}:{port}"
                 f" ({(self.allowed | self.denied)[key]}x)"
                 for key in sorted({*self.allowed, *self.denied})
                 for src, dst, port in [key]]
        lines += [f"  OUTSIDE  {src} -> {where} ({count}x)"
                  for (src, where), count in sorted(self.outside.items())]
        return "\n".join(lines)


def connections_in(trace: Path) -> list[tuple[str, int]]:
    """(address, port) of every IPv4/IPv6 connect() in one strace output file."""
    found = []
    for line in trace.read_text(errors="replace").splitlines():
        match = _CONNECT_V4.search(line) or _CONNECT_V6.search(line)
        if match:
            found.append((match.group(2), int(match.group(1))))
    return found


def audit(policies: Iterable[Mapping[str, Any]], made: Iterable[tuple[Peer, str, int]],
          pod_at: Callable[[str], Peer | None]) -> Audit:
    """Judge each (source, destination address, port) the run made."""
    policies = list(policies)
    allowed: Counter[tuple[str, str, str]] = Counter()
    denied: Counter[tuple[str, str, str]] = Counter()
    outside: Counter[tuple[str, str]] = Counter()
    for source, address, port in made:
        if address in _LOOPBACK or address == source.ip:
            continue  # within the pod
        target = pod_at(address)
        if target is None:
            outside[(source.name, f"{address}:{port}")] += 1
            continue
        port_name = next((n for n, p in target.pod.ports.items() if p == port), str(port))
        key = (source.name, target.name, port_name)
        if ingress_allowed(policies, source.pod, target.pod, port):
            allowed[key] += 1
        else:
            denied[key] += 1
    return Audit(allowed, denied, outside)
