"""The addresses of the host the router runs on, which its upstream policy denies by
default as it denies loopback: a service bound to all interfaces answers on every one
of them, so "public" addresses of the router's own host reach what loopback reaches.

Read from the kernel's tables on Linux (`/proc/net/fib_trie`: every local IPv4 address,
`/proc/net/if_inet6`: every IPv6 one); elsewhere, what the host name resolves to. Read
once, when the policy is built: an address the host gains later is not denied.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path

__all__ = ["own_addresses"]

logger = logging.getLogger(__name__)

_FIB_TRIE = Path("/proc/net/fib_trie")
_IF_INET6 = Path("/proc/net/if_inet6")


def own_addresses() -> tuple[str, ...]:
    """This host's own IP addresses, loopback included, in a stable order."""
    found: set[str] = set()
    try:
        found.update(_fib_local(_FIB_TRIE.read_text()))
        found.update(_inet6(_IF_INET6.read_text()))
    except OSError:
        pass  # not Linux, or no /proc: fall back to the host name
    if not found:
        try:
            infos = socket.getaddrinfo(socket.gethostname(), None)
        except OSError:
            logger.warning("[router] this host's own addresses are unknown; only "
                           "loopback is denied among them")
            infos = []
        found.update(str(info[4][0]).split("%", 1)[0] for info in infos)
    return tuple(sorted(found))


def _fib_local(text: str) -> list[str]:
    """IPv4 addresses the kernel lists as `/32 host LOCAL` (the host's own)."""
    addresses: list[str] = []
    last = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|-- "):
            last = stripped[4:]
        elif stripped.startswith("/32 host LOCAL") and last:
            addresses.append(last)
    return addresses


def _inet6(text: str) -> list[str]:
    """IPv6 addresses from /proc/net/if_inet6 (32 hex digits, then index, flags...)."""
    addresses = []
    for line in text.splitlines():
        fields = line.split()
        if fields and len(fields[0]) == 32:
            try:
                addresses.append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
            except ValueError:
                continue
    return addresses
