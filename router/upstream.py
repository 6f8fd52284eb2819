"""The one pooled HTTP client every request to an engine goes through.

Keep-alive connections are the point: a new TCP connection per leg would cost more CPU
than the rest of the router together.
"""

from __future__ import annotations

from typing import Final

import aiohttp

__all__ = ["CONNECT_TIMEOUT_S", "make_session"]

CONNECT_TIMEOUT_S: Final = 3.0  # an engine that cannot accept in this long is treated as down
KEEPALIVE_S: Final = 60.0  # idle pooled connections live this long
# No total timeout: a long generation streams for as long as it streams.
_TIMEOUT: Final = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)


def make_session() -> aiohttp.ClientSession:
    """Call from inside the running event loop that will use it."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S,
                                     ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector, timeout=_TIMEOUT, auto_decompress=False,
        skip_auto_headers=("User-Agent",), raise_for_status=False)
