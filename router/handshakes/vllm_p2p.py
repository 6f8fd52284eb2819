"""vLLM's P2P NCCL handshake (`vllm-p2p`): the pair rides in `X-Request-Id`.

P (max_tokens=1) first, then D; each engine reads the other's KV address from the id.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from router.handshakes.exchange import Exchange
from router.handshakes.legs import kv_address, post_leg, read_all, reject_4xx
from router.http.upstream import UpstreamPool
from router.table import Pair
from wire.protocol import Handshake

__all__ = ["VllmP2pHandshake"]

_encode = msgspec.json.encode


class VllmP2pHandshake:
    name = Handshake.VLLM_P2P

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        pair_id = (f"___prefill_addr_{await kv_address(pool, pair.prefill, 'prefill')}"
                   f"___decode_addr_{await kv_address(pool, pair.decode, 'decode')}_"
                   f"{uuid.uuid4().hex}")
        prefill_body = dict(body)
        prefill_body["max_tokens"] = 1
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        started = time.monotonic()
        response = await post_leg(pool, pair.prefill, "prefill", path, _encode(prefill_body),
                                  pair_id)
        await reject_4xx(response, pair.prefill, "prefill")
        await read_all(response, pair.prefill, "prefill")
        decode_started = time.monotonic()
        prefill_s = decode_started - started
        return Exchange(await post_leg(pool, pair.decode, "decode", path, _encode(body),
                                       pair_id, quarantine_on_5xx=False), prefill_s=prefill_s,
                        prefill_started=started, decode_started=decode_started)
