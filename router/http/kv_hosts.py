"""Whether a KV host from a member's record may be handed to an engine.

An engine resolves the KV address it is given with its own resolver, so the router
checks the address the way the engine will meet it: an IP literal must be canonical and
allowed by --allow-upstream (`kv_address_problem`, router/guard.py); a name must not be
a number in disguise (glibc's inet_aton reads `2852039166` and `0xa9fea9fe` as
169.254.169.254) and must resolve, here, only to allowed addresses. Answers are kept
for KV_HOST_CHECK_TTL_S: a handshake asks once per leg.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from functools import lru_cache
from typing import Final

from router.guard import UpstreamPolicy, kv_address_problem

__all__ = ["KV_HOST_CHECK_TTL_S", "KvHostChecks", "is_ip"]

KV_HOST_CHECK_TTL_S: Final = 30.0  # a name's answer (resolved, every address checked)
MAX_KV_HOST_CHECKS: Final = 4096


@lru_cache(maxsize=1024)
def is_ip(host: str) -> bool:
    """`host` is an IP literal (no brackets)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class KvHostChecks:
    """The checks of one policy, with their answers kept a while. Use on one event loop."""

    def __init__(self, policy: UpstreamPolicy) -> None:
        self.policy = policy
        self._answers: dict[str, tuple[float, str | None]] = {}  # host -> (until, problem)

    async def problem(self, host: str) -> str | None:
        """Why `host` may not be handed to an engine, or None."""
        now = time.monotonic()
        cached = self._answers.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        if is_ip(host.strip("[]")):
            problem = kv_address_problem(host, self.policy)
        else:
            problem = await self._check_name(host)
        if len(self._answers) >= MAX_KV_HOST_CHECKS:
            self._answers.clear()
        self._answers[host] = (now + KV_HOST_CHECK_TTL_S, problem)
        return problem

    async def _check_name(self, host: str) -> str | None:
        try:
            socket.inet_aton(host)
        except OSError:
            pass
        else:
            return f"KV host {host!r} is an IPv4 address in non-canonical form"
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                                 type=socket.SOCK_STREAM)
        except OSError as exc:
            return f"KV host {host!r} does not resolve: {exc}"
        for info in infos:
            problem = kv_address_problem(str(info[4][0]), self.policy)
            if problem is not None:
                return f"KV host {host!r} resolves to {info[4][0]}: {problem}"
        return None
