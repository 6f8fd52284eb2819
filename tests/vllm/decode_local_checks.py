"""Conditional disaggregation on real vLLM: a chat's next turn served by the decode alone.

Run by check_vllm_kv.py on its running cluster: two prefills and a decode, every one
with prefix caching and KV events. vLLM's decode keeps the KV it pulls over NIXL in its
own prefix cache (v1 scheduler `_update_waiting_for_remote_kv` caches the received
blocks, "iff caching is enabled") and publishes them as `BlockStored` like blocks it
computed. A second router, with conditional disaggregation on (the default
`--disagg-min-uncached-tokens 256`), follows the decode's events too:
1. a chat's first turn, which no decode holds, keeps its prefill leg (the prefills'
   `vllm:prompt_tokens_total` grows by the prompt), and the router tokenizes it exactly
   as vLLM does (vLLM's `prompt_token_ids`);
2. the router's index then shows the decode holding the conversation's full blocks;
3. the second turn (the conversation so far, the first answer, a new question) is
   answered; the decode's own `vllm:prefix_cache_hits_total` grows by exactly what the
   router predicted, at least the conversation's full blocks; the prefills see no
   prompt token of it (no prefill leg); the answer is token-identical to one instance's.
Then a figure, not a check: the time to first token of next turns, always disaggregated
(the first router, conditional disaggregation off) against decode-local, alternated.

The chat template is vLLM's `--chat-template` file, which a router cannot read from the
engine: the router is given a tokenizer folder whose tokenizer_config.json carries the
same template (`--tokenizer tiny=DIR`), as an operator whose vLLM takes --chat-template
would do.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import httpx
from cluster import CHAT_TEMPLATE, MODEL_NAME, Engine, Router, Steps, say, wait_logged
from kv_probes import (
    CPU_BLOCK,
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    VLLM_PROMPT_TOKENS,
    chat,
    kv_status,
    router_cached,
    vllm_counter,
    vllm_hits,
)
from sse import events

from router.kv.keys import block_keys
from router.kv.tokenizer import PromptTokenizer, load_tokenizer

STEP_TIMEOUT_S = 60.0
SYSTEM = ("You answer questions about the registry, which keeps every member of the fleet "
          "in one table; each router keeps a view of it that follows its events. ") * 4
FIRST = "user", "How does a router learn that a member left?"
SECOND = "user", "And how does it learn that one joined?"
TTFT_PAIRS = 5  # next turns timed each way, alternated (a figure for bench/RESULTS.md)


def chat_tokenizer_dir(model_dir: Path, out: Path) -> Path:
    """The model's tokenizer with vLLM's --chat-template in its tokenizer_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def prefill_prompt_tokens(prefills: list[Engine]) -> float:
    return sum(vllm_counter(e, VLLM_PROMPT_TOKENS) for e in prefills)


def check_decode_local(steps: Steps, registry: str, prefills: list[Engine], decode: Engine,
                       routers: tuple[Router, Router], tokenizer_dir: Path) -> None:
    """`routers`: the running one (conditional disaggregation off, `tokenizer_dir` given)
    and the one to start here with it on."""
    router = routers[1]
    steps.begin("a router with conditional disaggregation follows the decode's KV events")
    router.start(registry, 3, ["--policy", "kv", "--no-register",
                               "--tokenizer", f"{MODEL_NAME}={tokenizer_dir}"])
    members = {e.member_id for e in [*prefills, decode]}
    wait_logged("prefills and decode indexed and live", lambda: {
        m for m, status in kv_status(router).items() if status["state"] == "live"} == members,
        STEP_TIMEOUT_S, lambda: json.dumps(kv_status(router)))
    tokenizer = load_tokenizer(str(tokenizer_dir))
    assert tokenizer is not None
    conversation, held = first_turn(steps, prefills, decode, router, tokenizer)
    local_turn(steps, prefills, decode, router, [*conversation, message(*SECOND)], held)
    compare_ttft(steps, routers, conversation)


def first_turn(steps: Steps, prefills: list[Engine], decode: Engine, router: Router,
               tokenizer: PromptTokenizer) -> tuple[list[dict[str, str]], int]:
    """The conversation after its first turn (the answer included), and the prompt
    tokens the decode holds of it."""
    steps.begin("a chat's first turn keeps its prefill leg; the decode keeps what it pulled")
    conversation = [message("system", SYSTEM), message(*FIRST)]
    ids = tokenizer.chat_ids(conversation)
    assert ids is not None, "the router's tokenizer has no chat template"
    held = len(block_keys(ids, CPU_BLOCK)) * CPU_BLOCK
    assert held >= 2 * CPU_BLOCK, f"{len(ids)} tokens: lengthen SYSTEM to 2+ blocks"
    prefilled_before = prefill_prompt_tokens(prefills)
    decode_blocks = kv_status(router)[decode.member_id]["blocks"]
    first = chat(router.url, conversation)
    assert first["prompt_token_ids"] == ids, "the router renders the chat unlike vLLM"
    wait_logged(f"the prefills computed the first turn's {len(ids)} prompt tokens",
                lambda: prefill_prompt_tokens(prefills) - prefilled_before >= len(ids),
                STEP_TIMEOUT_S)
    wait_logged(f"the decode's events show the conversation's {held // CPU_BLOCK} blocks",
                lambda: kv_status(router)[decode.member_id]["blocks"]
                >= decode_blocks + held // CPU_BLOCK, STEP_TIMEOUT_S,
                lambda: json.dumps(kv_status(router)[decode.member_id]))
    answer = first["choices"][0]["message"]["content"]
    return [*conversation, message("assistant", answer)], held


def local_turn(steps: Steps, prefills: list[Engine], decode: Engine, router: Router,
               conversation: list[dict[str, str]], held: int) -> None:
    steps.begin("the second turn is served by the decode alone, from its prefix cache")
    hits_before, predicted_before = vllm_hits(decode), router_cached(router)
    prefilled_before = prefill_prompt_tokens(prefills)
    second = chat(router.url, conversation)
    predicted = router_cached(router) - predicted_before
    assert predicted >= held, f"the router predicted {predicted} cached tokens, not {held}+"
    wait_logged("the decode's prefix-cache hits", lambda: vllm_hits(decode) - hits_before
                >= predicted, STEP_TIMEOUT_S, lambda: f"{vllm_hits(decode) - hits_before}")
    gained = vllm_hits(decode) - hits_before
    assert gained == predicted, f"the decode hit {gained} tokens, the router predicted " \
                                f"{predicted}"
    # Read once the decode's counters moved: a prefill leg would have been counted
    # before the decode was even asked.
    prefilled = prefill_prompt_tokens(prefills) - prefilled_before
    assert prefilled == 0, f"the prefills computed {prefilled} tokens of a local turn"
    say(f"ok: turn 2 ({len(second['prompt_token_ids'])} prompt tokens) served by the decode "
        f"alone: vLLM's decode hit {gained:.0f} tokens, the router predicted "
        f"{predicted:.0f}, the prefills computed none of it")
    single = chat(prefills[0].url, conversation)  # one instance computing it all
    assert second["choices"][0]["token_ids"] == single["choices"][0]["token_ids"], (
        second, single)
    say(f"ok: the local turn's {len(single['choices'][0]['token_ids'])} tokens equal one "
        f"instance's")


def compare_ttft(steps: Steps, routers: tuple[Router, Router],
                 conversation: list[dict[str, str]]) -> None:
    """A figure, not a check (bench/RESULTS.md): time to the first token of a next turn,
    always disaggregated (prefill leg, NIXL pull) against decode-local, alternated."""
    steps.begin("time to first token of a next turn: always disaggregated, decode-local")
    ttft: dict[str, list[float]] = {"disaggregated": [], "decode-local": []}
    for i in range(TTFT_PAIRS):
        for (name, samples), router in zip(ttft.items(), routers, strict=True):
            question = message("user", f"Question {i} for the {name} turn: and the planner?")
            samples.append(chat_ttft_s(router.url, [*conversation, question]))
    always, local = (statistics.median(v) for v in ttft.values())
    say(f"TTFT medians of {TTFT_PAIRS}: always disaggregated {1000 * always:.0f} ms, "
        f"decode-local {1000 * local:.0f} ms ({local / always:.2f}x); samples (ms): "
        + json.dumps({k: [round(1000 * x) for x in v] for k, v in ttft.items()}))


def chat_ttft_s(url: str, messages: list[dict[str, str]]) -> float:
    """Seconds from sending a streamed chat turn to its first generated token."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": True}
    first = None
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200, f"{url}: {response.status_code}"
        for event in events(response):
            if first is None and event and any(c.get("token_ids")
                                               for c in event.get("choices", [])):
                first = time.perf_counter() - started
    assert first is not None, f"{url}: a stream without a token"
    return first
