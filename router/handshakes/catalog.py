"""P/D handshakes, one per registered `protocol`: how a pair is driven for one request.

A `Handshake` turns (pair, path, body) into an `Exchange` (router/handshakes/exchange.py):
the decode's answer with its status and headers in, ready to be relayed, and when the
prefill's part ended. Failures that a retry on another pair can fix raise `LegFailure`
naming the member at fault; a prefill's 4xx (the client's own mistake) raises
`UpstreamRejected`, relayed as is.

    vllm-nixl   router/handshakes/vllm_nixl.py   P computes, D pulls over NIXL
    sglang      router/handshakes/sglang.py      P and D at once, a bootstrap room
    vllm-p2p    router/handshakes/vllm_p2p.py    the pair rides in X-Request-Id
    (mixed)     router/handshakes/direct.py      one member serves both: no handshake
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Final, Protocol

from router.handshakes.direct import DirectHandshake
from router.handshakes.exchange import Exchange, LegFailure
from router.handshakes.sglang import SglangHandshake
from router.handshakes.vllm_nixl import VllmNixlHandshake
from router.handshakes.vllm_p2p import VllmP2pHandshake
from router.http.upstream import UpstreamPool
from router.table import Pair

__all__ = ["DIRECT", "Handshake", "Handshakes", "default_handshakes", "handshake_for"]


class Handshake(Protocol):
    name: str  # the `protocol` members register (wire.protocol.Handshake)

    async def open(self, pool: UpstreamPool, pair: Pair, path: str,
                   body: dict[str, Any], request_id: str) -> Exchange: ...


Handshakes = Mapping[str, Handshake]

DIRECT: Final = DirectHandshake()


def default_handshakes(rng: random.Random | None = None) -> dict[str, Handshake]:
    """One handshake per protocol this router speaks. `rng` seeds SGLang's bootstrap_room
    (tests pass a seeded one; by default the system's randomness)."""
    return {h.name: h for h in (VllmNixlHandshake(), SglangHandshake(rng), VllmP2pHandshake())}


def handshake_for(handshakes: Handshakes, pair: Pair) -> Handshake:
    """The handshake for a pair: direct for one mixed member, else the pair's protocol."""
    if pair.direct:
        return DIRECT
    handshake = handshakes.get(pair.prefill.protocol)
    if handshake is None:  # the pairing table leaves such members out; this is a guard
        raise LegFailure(pair.prefill, "prefill", f"no handshake for protocol "
                         f"{pair.prefill.protocol!r}", kind="reply", quarantine=False)
    return handshake
