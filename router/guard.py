"""What keeps the router from being turned against its own network.

- `UpstreamPolicy`: the addresses the router may send traffic to (`--allow-upstream`),
  checked against the *resolved* address of every new engine connection, so neither a
  registered URL nor a DNS answer can point it at a cloud metadata service or at a
  service that trusts its own network. The KV addresses a handshake hands to an engine
  pass the same policy, and only in canonical form (`kv_address_problem`). The host's
  own addresses are denied too, public ones included (router/host_addresses.py): a
  service bound to all interfaces answers on them as on loopback.
- `strip_internal_fields`: the request-body fields that drive engines' P/D handshakes and
  request identity are the router's to set, never the client's, at the top level or in
  the nested places an engine reads them from (vLLM's `vllm_xargs`).
- `HOP_HEADER`: every request the router sends carries it; a request arriving with it came
  from a router (a member whose URL is a router, maybe this one) and is refused, so no
  loop forms.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from router.host_addresses import own_addresses

__all__ = [
    "DEFAULT_ALLOW",
    "DEFAULT_DENY",
    "HOP_HEADER",
    "INTERNAL_FIELDS",
    "LOOPBACK_ALLOW",
    "UpstreamPolicy",
    "kv_address_problem",
    "parse_networks",
    "strip_internal_fields",
]

logger = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

HOP_HEADER: Final = "X-Pdreg-Hop"
MAX_REMEMBERED_ADDRESSES: Final = 4096

# By default an engine may be anywhere public. Loopback, private and link-local ranges
# are denied unless --allow-upstream names them: an insider registering
# http://localhost:PORT must not make the router fetch a loopback-only service, and
# 169.254.169.254 is the metadata service of AWS, GCP, Azure, OpenStack... The local
# demo and the tests pass LOOPBACK_ALLOW; a cluster passes its pod network.
DEFAULT_ALLOW: Final = ("0.0.0.0/0", "::/0")
DEFAULT_DENY: Final = (
    "127.0.0.0/8",  # loopback
    "::1/128",
    "10.0.0.0/8",  # private (RFC 1918)
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",  # carrier-grade NAT, Alibaba Cloud's metadata (100.100.100.200)
    "fc00::/7",  # IPv6 unique local, incl. AWS metadata over IPv6 (fd00:ec2::254)
    "169.254.0.0/16",  # IPv4 link-local, incl. the common metadata address
    "fe80::/10",  # IPv6 link-local
    "0.0.0.0/8",  # "this network": 0.0.0.0 reaches the local host
    "::/128",
    "224.0.0.0/4",  # multicast
    "ff00::/8",
    "255.255.255.255/32",
)
# What the local demo, the tests and the benches allow: engines on this host.
LOOPBACK_ALLOW: Final = "127.0.0.0/8,::1/128"

# Body fields the router owns. kv_transfer_params and bootstrap_* steer which KV a decode
# pulls and from where; request_id (vLLM) and rid (SGLang) set engine-side request ids,
# which a client could use to collide with another request's.
INTERNAL_FIELDS: Final = frozenset({"kv_transfer_params", "request_id", "rid"})
INTERNAL_PREFIXES: Final = ("bootstrap_",)
# Dicts whose keys an engine reads as if they were top-level fields: vLLM copies
# `vllm_xargs` into the sampling params' extra args, where its KV connector finds
# `kv_transfer_params` when the request has none of its own.
NESTED_FIELD_HOLDERS: Final = ("vllm_xargs",)


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
    contains it is an allowed one. A tie goes to allow: `--allow-upstream 10.0.0.0/8`
    names exactly a denied range, and means it."""

    allow: tuple[Network, ...]
    deny: tuple[Network, ...]
    # address -> allowed: every new connection and KV address asks, with a handful of
    # distinct addresses (a dict lookup, not a walk over the networks).
    _answers: dict[str, bool] = field(default_factory=dict, compare=False, hash=False,
                                      repr=False)

    @classmethod
    def build(cls, allow: str | Sequence[str] = "", *, deny: Sequence[str] = DEFAULT_DENY,
              own: Sequence[str] | None = None) -> UpstreamPolicy:
        """`allow` empty: the default (every public address: everything but `deny`).
        `own`: this host's addresses (default: read from the host), each but loopback
        (denied by `deny`, allowed by naming it: LOOPBACK_ALLOW) denied as a host route,
        so a network that holds one does not allow it, only naming the address itself
        (`--allow-upstream 192.0.2.2/32`, a tie) does."""
        networks = parse_networks(allow) if allow else parse_networks(DEFAULT_ALLOW)
        host_routes = [ip for ip in (own_addresses() if own is None else own)
                       if not ipaddress.ip_address(ip).is_loopback]
        return cls(allow=networks, deny=parse_networks([*deny, *host_routes]))

    def allows(self, address: str) -> bool:
        allowed = self._answers.get(address)
        if allowed is None:
            allowed = _allows(self.allow, self.deny, address)
            if len(self._answers) < MAX_REMEMBERED_ADDRESSES:
                self._answers[address] = allowed
        return allowed

    def describe(self) -> str:
        return (f"allow {', '.join(map(str, self.allow))}; "
                f"deny {', '.join(map(str, self.deny))}")


def _allows(allow: Sequence[Network], deny: Sequence[Network], address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:169.254.169.254 is 169.254.169.254
    best_allow = _longest(allow, ip)
    best_deny = _longest(deny, ip)
    return best_allow >= 0 and best_allow >= best_deny


def _longest(networks: Sequence[Network], ip: ipaddress.IPv4Address | ipaddress.IPv6Address
             ) -> int:
    """The prefix length of the most specific network holding `ip`, -1 if none."""
    best = -1
    for network in networks:
        if network.version == ip.version and ip in network:
            best = max(best, network.prefixlen)
    return best


def strip_internal_fields(body: dict[str, Any]) -> list[str]:
    """Remove router-owned fields from a client's body, in place, at the top level and
    in every dict an engine reads as top-level fields; the names removed."""
    removed = _strip(body)
    for holder in NESTED_FIELD_HOLDERS:
        nested = body.get(holder)
        if isinstance(nested, dict):
            removed.extend(f"{holder}.{key}" for key in _strip(nested))
    return removed


def _strip(fields: dict[str, Any]) -> list[str]:
    removed = [key for key in fields
               if key in INTERNAL_FIELDS or key.startswith(INTERNAL_PREFIXES)]
    for key in removed:
        del fields[key]
    return removed


def kv_address_problem(host: str, policy: UpstreamPolicy) -> str | None:
    """Why a KV address from a member's record may not go to an engine, or None.

    Only a canonical IP literal passes: an engine resolves what it is given with its
    own resolver, where `2852039166` and `0xa9fea9fe` are 169.254.169.254 and a name is
    whatever DNS says at that moment, so neither can be checked here once and for all.
    """
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        return f"KV host {host!r} is not an IP address (names are not checkable)"
    if str(ip) != literal:
        return f"KV host {host!r} is not in canonical form ({ip})"
    if not policy.allows(literal):
        return f"KV host {host!r} is outside --allow-upstream"
    return None
