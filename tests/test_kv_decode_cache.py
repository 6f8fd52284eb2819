"""A decode keeps the KV it pulls, as vLLM's does (real processes: a registry, reference
engines publishing KV events, a `kv` router): the next turn of a chat finds the
conversation cached on the decode, by the decode's own counters, both when the prefill
leg runs again and when the router sends the turn to the decode alone (conditional
disaggregation), and the answers are those of a single engine (the torch model too:
the decode reuses KV it pulled, token for token the same)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from reference_helpers import EngineHandle, collect, metrics, start_engine, start_engines, vllm_pd

from pdreg.testing import wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from router.guard import LOOPBACK_ALLOW
from router.kv.routing import KvOptions
from router.service import RouterConfig, RouterServer
from wire.protocol import MemberState

WAIT_S = 30.0
BLOCK = 16
SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite nothing, and "
          "never apologise. ") * 8  # ~750 bytes: ~47 blocks of 16 tokens
# Under this many uncached prompt tokens on the decode, the router skips the prefill leg:
# more than one new turn, less than the whole conversation.
DISAGG_MIN = 256


@pytest.fixture
def router(view: MembershipView) -> Iterator[RouterServer]:
    config = RouterConfig(port=0, policy="kv", allow_upstream=LOOPBACK_ALLOW,
                          kv=KvOptions(disagg_min_uncached_tokens=DISAGG_MIN))
    server = RouterServer(config, view).start()
    try:
        yield server
    finally:
        server.close()


def chat(http: httpx.Client, url: str, messages: list[dict[str, str]]) -> tuple[list[int], str]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True}
    r = http.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return collect(r, False)


def counter(handle: EngineHandle, name: str) -> float:
    return metrics(handle.url)[name]


def indexed_blocks(router: RouterServer, member_id: str) -> int:
    members = httpx.get(router.url + "/v1/kv", timeout=10).json()["members"]
    return next((m["blocks"] for m in members if m["id"] == member_id), 0)


@pytest.mark.parametrize("backend", ["sim", "torch"])  # torch: reused KV, same answer
def test_the_next_turn_finds_the_conversation_on_the_decode(
        registry: RegistryServer, view: MembershipView, router: RouterServer,
        handles: list[EngineHandle], backend: str) -> None:
    control = registry.control_address
    p, d = start_engines([
        {"role": role, "registry": control, "extra_args": ["--kv-events"], "backend": backend}
        for role in ("prefill", "decode")])
    handles += [p, d]
    # Not registered: the single-instance reference.
    mixed = start_engine(role="mixed", backend=backend)
    handles.append(mixed)
    assert view.wait_for(lambda m: all(i in m and m[i].record.state is MemberState.READY
                                       for i in (p.id, d.id)), WAIT_S)
    with httpx.Client(timeout=60) as http:
        turn1 = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "What is 2+2?"}]
        _, answer = chat(http, router.url, turn1)  # uncached everywhere: P then D
        assert counter(p, "pdreg:engine_prompt_tokens_total") > 40 * BLOCK
        # The decode kept the blocks it pulled and published them: the router indexes them.
        assert wait_until(lambda: indexed_blocks(router, d.id) >= 40, WAIT_S)

        # The next turn through the router: the decode holds all but the answer and the
        # new question, under DISAGG_MIN tokens, so it serves the turn alone and its own
        # prefix cache counts the hit; the prefill computes nothing more.
        turn2 = [*turn1, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And 3+3?"}]
        prefilled = counter(p, "pdreg:engine_prompt_tokens_total")
        ids, _ = chat(http, router.url, turn2)
        assert counter(p, "pdreg:engine_prompt_tokens_total") == prefilled
        assert counter(d, "pdreg:engine_prefix_cache_hit_tokens_total") >= 40 * BLOCK
        assert ids == chat(http, mixed.url, turn2)[0]  # the answer is unchanged

        # The P/D handshake again (straight to the engines): the decode still pulls the
        # prompt, and vLLM's counters on it show the local hit, as vLLM's decode shows it.
        turn3 = [*turn2, {"role": "assistant", "content": "six"},
                 {"role": "user", "content": "And 4+4?"}]
        hits = counter(d, "vllm:prefix_cache_hits_total")
        body: dict[str, Any] = {"model": "tiny", "messages": turn3, "max_tokens": 8,
                                "ignore_eos": True, "return_token_ids": True}
        r = vllm_pd(http, p.url, d.url, body, "/v1/chat/completions")
        assert r.status_code == 200, r.text
        assert collect(r, False)[0] == chat(http, mixed.url, turn3)[0]
        assert counter(d, "vllm:prefix_cache_hits_total") - hits >= 40 * BLOCK
        assert counter(d, "pdreg:engine_pulled_prompt_cached_tokens_total") >= 40 * BLOCK
