"""vLLM's NixlConnector handshake (`vllm-nixl`): the prefill computes, the decode pulls.

P gets the body with max_tokens=1, stream=false and the request-side
`kv_transfer_params`; P's response's top-level `kv_transfer_params` go to D, with the KV
address (`remote_host`, `remote_port`) the prefill registered, not the one it wrote: a
prefill's answer cannot send a decode to pull from elsewhere.
"""

from __future__ import annotations

import time
from typing import Any, Final

import msgspec

from router.handshakes.exchange import Exchange, LegFailure
from router.handshakes.legs import (
    kv_endpoint,
    post_leg,
    prefill_json,
    reported_cached_tokens,
)
from router.http.upstream import UpstreamPool
from router.table import Candidate, Pair
from wire.protocol import Handshake

__all__ = ["NIXL_PREFILL_PARAMS", "VllmNixlHandshake"]

# What vLLM's NixlConnector expects on the prefill request (request side of the handshake).
NIXL_PREFILL_PARAMS: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_encode = msgspec.json.encode


class VllmNixlHandshake:
    name = Handshake.VLLM_NIXL

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange:
        prefill_body = dict(body)
        prefill_body["max_tokens"] = 1
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)  # vLLM refuses it when stream is false
        prefill_body["kv_transfer_params"] = NIXL_PREFILL_PARAMS
        # Checked before any work: a prefill whose KV address may not be used does none.
        kv_host, kv_port, _ = await kv_endpoint(pool, pair.prefill)
        started = time.monotonic()
        reply = await prefill_json(pool, pair.prefill, path, _encode(prefill_body),
                                   request_id)
        prefill_s = time.monotonic() - started
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not isinstance(params, dict):
            raise LegFailure(pair.prefill, "prefill",
                             "response has no kv_transfer_params (is a kv_producer "
                             "connector configured?)", kind="reply")
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = _registered_kv_params(params, pair.prefill,
                                                                  kv_host, kv_port)
        # The decode's 5xx may be the prefill's fault (KV gone): retry, quarantine neither.
        decode_started = time.monotonic()
        return Exchange(await post_leg(pool, pair.decode, "decode", path, _encode(decode_body),
                                       request_id, quarantine_on_5xx=False), prefill_s=prefill_s,
                        prefill_started=started, decode_started=decode_started,
                        prefill_cached_tokens=reported_cached_tokens(reply))


def _registered_kv_params(params: dict[str, Any], prefill: Candidate, host: str,
                          port: int) -> dict[str, Any]:
    """P's `kv_transfer_params` with the KV address P registered. vLLM's side channel
    is one port per data-parallel rank from the registered one up, so a reported port in
    that range is kept; any other is replaced."""
    if not port:
        raise LegFailure(prefill, "prefill", "no KV port registered (endpoints.kv_port)",
                         kind="reply")
    dp_size = prefill.member.record.spec.parallel.dp_size if prefill.member else 1
    reported = params.get("remote_port")
    in_range = (isinstance(reported, int) and not isinstance(reported, bool)
                and port <= reported < port + max(1, dp_size))
    return {**params, "remote_host": host, "remote_port": reported if in_range else port}
