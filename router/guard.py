"""What keeps the router from being turned against its own network.

- `UpstreamPolicy`: the addresses the router may send traffic to (`--allow-upstream`),
  checked against the *resolved* address of every new engine connection, so neither a
  registered URL nor a DNS answer can point it at a cloud metadata service.
- `strip_internal_fields`: the request-body fields that drive engines' P/D handshakes and
  request identity are the router's to set, never the client's.
- `HOP_HEADER`: every request the router sends carries it; a request arriving with it came
  from a router (a member whose URL is a router, maybe this one) and is refused, so no
  loop forms.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

__all__ = [
    "DEFAULT_ALLOW",
    "DEFAULT_DENY",
    "HOP_HEADER",
    "INTERNAL_FIELDS",
    "UpstreamPolicy",
    "parse_networks",
    "strip_internal_fields",
]

logger = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

HOP_HEADER: Final = "X-Pdreg-Hop"

# Every address, minus the ranges below: a member's URL is whatever its registrant said.
DEFAULT_ALLOW: Final = ("0.0.0.0/0", "::/0")
# Never an engine, always dangerous: link-local (169.254.169.254 is the metadata service
# of AWS, GCP, Azure, OpenStack...), cloud metadata addresses outside it, "this host" and
# multicast. An explicit, more specific --allow-upstream entry overrides one of these.
DEFAULT_DENY: Final = (
    "169.254.0.0/16",  # IPv4 link-local, incl. the common metadata address
    "fe80::/10",  # IPv6 link-local
    "fd00:ec2::254/128",  # AWS metadata over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
    "0.0.0.0/8",  # "this network": 0.0.0.0 reaches the local host
    "::/128",
    "224.0.0.0/4",  # multicast
    "ff00::/8",
    "255.255.255.255/32",
)

# Body fields the router owns. kv_transfer_params and bootstrap_* steer which KV a decode
# pulls and from where; request_id (vLLM) and rid (SGLang) set engine-side request ids,
# which a client could use to collide with another request's.
INTERNAL_FIELDS: Final = frozenset({"kv_transfer_params", "request_id", "rid"})
INTERNAL_PREFIXES: Final = ("bootstrap_",)


def parse_networks(text: str | Iterable[str]) -> tuple[Network, ...]:
    """'10.0.0.0/8,fd00::/8' -> networks; ValueError naming the bad entry."""
    items = text.split(",") if isinstance(text, str) else list(text)
    networks = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise ValueError(f"{item!r} is not a CIDR network (e.g. 10.0.0.0/8): {exc}") \
                from None
    return tuple(networks)


@dataclass(frozen=True, slots=True)
class UpstreamPolicy:
    """Longest prefix wins: an address is allowed when the most specific network that
    contains it is an allowed one (ties go to deny)."""

    allow: tuple[Network, ...]
    deny: tuple[Network, ...]

    @classmethod
    def build(cls, allow: str | Sequence[str] = "", *,
              deny: Sequence[str] = DEFAULT_DENY) -> UpstreamPolicy:
        """`allow` empty: the default (everything but `deny`)."""
        networks = parse_networks(allow) if allow else parse_networks(DEFAULT_ALLOW)
        return cls(allow=networks, deny=parse_networks(deny))

    def allows(self, address: str) -> bool:
        return _allows(self, address)

    def describe(self) -> str:
        return (f"allow {', '.join(map(str, self.allow))}; "
                f"deny {', '.join(map(str, self.deny))}")


@lru_cache(maxsize=4096)
def _allows(policy: UpstreamPolicy, address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:169.254.169.254 is 169.254.169.254
    best_allow = _longest(policy.allow, ip)
    best_deny = _longest(policy.deny, ip)
    return best_allow > best_deny


def _longest(networks: Sequence[Network], ip: ipaddress.IPv4Address | ipaddress.IPv6Address
             ) -> int:
    """The prefix length of the most specific network holding `ip`, -1 if none."""
    best = -1
    for network in networks:
        if network.version == ip.version and ip in network:
            best = max(best, network.prefixlen)
    return best


def strip_internal_fields(body: dict[str, Any]) -> list[str]:
    """Remove router-owned fields from a client's body, in place; the names removed."""
    removed = [key for key in body
               if key in INTERNAL_FIELDS or key.startswith(INTERNAL_PREFIXES)]
    for key in removed:
        del body[key]
    return removed
