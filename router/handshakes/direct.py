"""A mixed member serving both phases: the request goes through unchanged, no handshake."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from router.handshakes.exchange import Exchange
from router.handshakes.legs import post_leg
from router.http.upstream import UpstreamPool
from router.table import Pair

__all__ = ["DirectHandshake"]

_encode = msgspec.json.encode


class DirectHandshake:
    name = "direct"

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        started = time.monotonic()
        return Exchange(await post_leg(pool, pair.decode, "decode", path, _encode(body),
                                       request_id), decode_started=started)
