"""What the KV checks of `make test-vllm` read and send: vLLM's own counters, the
router's index (GET /v1/kv) and counters, and plain greedy requests.

Shared by check_vllm_kv.py, decode_local_checks.py and lora_checks.py.
"""

from __future__ import annotations

from typing import Any

import httpx
from cluster import MODEL_NAME, Engine, Router

from pdreg.testing import wait_until

CPU_BLOCK = 128  # vLLM's CPU backend caches 128-token blocks
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 120.0
VLLM_HITS = "vllm:prefix_cache_hits_total"  # prompt tokens found in the local prefix cache
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens_total"  # prompt tokens of every request served
ROUTER_CACHED = "pdreg_router_prompt_tokens_cached_total"  # the router's predicted hits
HITS_SETTLE_S = 5.0  # vLLM's counters catch up with an answer within this


def metric(text: str, name: str) -> float:
    """The sum of a metric's series in a Prometheus text page (0 when absent)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def vllm_counter(engine: Engine, name: str) -> float:
    return metric(httpx.get(engine.url + "/metrics", timeout=10).text, name)


def vllm_hits(engine: Engine) -> float:
    return vllm_counter(engine, VLLM_HITS)


def router_cached(router: Router) -> float:
    return metric(router.metrics(), ROUTER_CACHED)


def kv_status(router: Router) -> dict[str, dict[str, Any]]:
    """The router's index per member id (state, blocks...); {} while it does not answer."""
    try:
        body = httpx.get(router.url + "/v1/kv", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {m["id"]: m for m in body["members"]}


def completion(url: str, prompt: str, model: str = MODEL_NAME,
               **extra: str) -> dict[str, Any]:
    """One greedy completion of MAX_TOKENS tokens with its token ids; its first choice."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert reply.status_code == 200, f"{url}: {reply.status_code} {reply.text[:300]}"
    return reply.json()["choices"][0]


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One greedy chat completion of MAX_TOKENS tokens, with vLLM's `prompt_token_ids`;
    the whole answer (its message is not empty)."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert reply.status_code == 200, f"{url}: {reply.status_code} {reply.text[:300]}"
    answer = reply.json()
    assert answer["choices"][0]["message"]["content"], f"{url}: an empty answer: {answer}"
    return answer


def routed_hits(router: Router, prefills: list[Engine], prompt: str,
                **extra: str) -> tuple[dict[str, float], float, dict[str, Any]]:
    """One completion through the router: vLLM's prefix-cache hits it gained per prefill,
    the tokens the router predicted cached, and its first choice."""
    before = {e.name: vllm_hits(e) for e in prefills}
    predicted_before = router_cached(router)
    choice = completion(router.url, prompt, **extra)
    predicted = router_cached(router) - predicted_before

    def gained() -> dict[str, float]:
        return {e.name: vllm_hits(e) - before[e.name] for e in prefills}
    # vLLM counts a request's hits as its stats arrive, which may be after the answer:
    # give its counters a moment to reach the prediction (a miss stays a miss).
    wait_until(lambda: sum(gained().values()) >= predicted, HITS_SETTLE_S)
    return gained(), predicted, choice


def indexed_blocks(router: Router) -> int:
    """Blocks the router's index holds, all members together."""
    return sum(m["blocks"] for m in kv_status(router).values())
