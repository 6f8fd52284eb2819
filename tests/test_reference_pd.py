"""Prefill + decode reference engines (torch backend, real processes) reproduce a mixed
engine's output token for token, over both handshakes, streamed or not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from reference_helpers import (
    EngineHandle,
    collect,
    metrics,
    read_sse,
    sglang_pd,
    start_engines,
    stop_all,
    vllm_pd,
)

PROMPTS = [
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode, disaggregated: " * 4,
    "Ünïcödé ✓ 日本語 — bytes that span tokens",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineHandle]]:
    handles = start_engines([
        {"role": "mixed", "backend": "torch"},
        {"role": "prefill", "backend": "torch", "extra_args": ["--kv-lease", "5"]},
        {"role": "decode", "backend": "torch"},
    ])
    try:
        yield dict(zip(("mixed", "prefill", "decode"), handles, strict=True))
    finally:
        assert stop_all(handles) == [0, 0, 0]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def _body(prompt: str, path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                            "temperature": 0, "return_token_ids": True, "stream": stream,
                            **extra}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("handshake", ["vllm", "sglang"])
def test_pd_output_is_token_identical_to_mixed(engines: dict[str, EngineHandle],
                                               client: httpx.Client, handshake: str,
                                               stream: bool, path: str) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    for prompt in PROMPTS:
        body = _body(prompt, path, stream)
        expected = collect(client.post(engines["mixed"].url + path, json=body, timeout=60),
                           stream)
        if handshake == "vllm":
            response = vllm_pd(client, prefill.url, decode.url, body, path)
        else:
            response = sglang_pd(client, prefill, decode.url, body, path)
        got = collect(response, stream)
        assert len(expected[0]) == MAX_TOKENS
        assert got == expected, f"prompt {prompt!r}"


def test_seeded_sampling_is_reproduced_by_decode(engines: dict[str, EngineHandle],
                                                 client: httpx.Client) -> None:
    body = _body(PROMPTS[1], "/v1/completions", False, temperature=0.9, seed=1234)
    mixed = collect(client.post(engines["mixed"].url + "/v1/completions", json=body), False)
    pd = collect(vllm_pd(client, engines["prefill"].url, engines["decode"].url, body), False)
    assert pd == mixed
    greedy = collect(client.post(engines["mixed"].url + "/v1/completions",
                                 json=_body(PROMPTS[1], "/v1/completions", False)), False)
    assert greedy != mixed  # the seed actually sampled


def test_prefill_response_is_shaped_like_vllm(engines: dict[str, EngineHandle],
                                              client: httpx.Client) -> None:
    prompt = PROMPTS[2]
    response = client.post(engines["prefill"].url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}}).json()
    params = response["kv_transfer_params"]
    n = len(prompt.encode()) + 1  # + BOS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == engines["prefill"].engine_id
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == engines["prefill"].kv_port
    assert params["remote_num_tokens"] == n
    assert len(params["remote_block_ids"]) == -(-n // 16)
    assert params["tp_size"] == 1 and params["remote_request_id"]
    assert len(response["choices"][0]["text"].encode()) <= 4  # one byte token
    # Pull it, so the module leaves no KV behind.
    out = client.post(engines["decode"].url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params})
    assert out.status_code == 200, out.text
    decode_metrics = metrics(engines["decode"].url)
    assert decode_metrics["vllm:prompt_tokens_by_source_total"] >= n


def test_decode_refuses_kv_it_cannot_trust(engines: dict[str, EngineHandle],
                                           client: httpx.Client) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    body = _body(PROMPTS[1], "/v1/completions", False)
    stage1 = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = client.post(prefill.url + "/v1/completions", json=stage1).json()[
        "kv_transfer_params"]
    cases = {
        "unknown handle": {**params, "remote_request_id": "0" * 32},
        "another engine": {**params, "remote_engine_id": "f" * 32},
        "missing host": {**params, "remote_host": None},
    }
    for name, bad in cases.items():
        response = client.post(decode.url + "/v1/completions",
                               json={**body, "kv_transfer_params": bad})
        assert response.status_code in (400, 502), f"{name}: {response.status_code}"
        assert "error" in response.json(), name
        assert "choices" not in response.json(), name
    # Another prompt (same length) against the right handle: refused, not decoded from
    # foreign KV; the prefill frees that KV since the request must be retried anyway.
    wrong_prompt = {**body, "prompt": PROMPTS[1].upper(), "kv_transfer_params": params}
    response = client.post(decode.url + "/v1/completions", json=wrong_prompt)
    assert response.status_code == 502
    assert "another prompt" in response.json()["error"]["message"]
    assert metrics(prefill.url)["pdreg:kv_held_entries"] == 0


# --- the migration contract (vLLM's, docs/engines.md §6): continue from ids, exactly -------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_generation_continued_from_its_ids_is_the_same_generation(
        engines: dict[str, EngineHandle], client: httpx.Client, path: str) -> None:
    mixed = engines["mixed"].url
    for prompt in PROMPTS:
        whole = client.post(mixed + path, json=_body(prompt, path, True), timeout=60)
        want_ids, want_text = collect(whole, True)
        events = read_sse(whole)
        prompt_ids = (events[0]["prompt_token_ids"] if path.endswith("chat/completions")
                      else events[0]["choices"][0]["prompt_token_ids"])
        # The text each token's chunk carried (a chat stream opens with a role chunk).
        pieces = [c["delta"]["content"] if "delta" in c else c["text"]
                  for e in events for c in e["choices"] if c.get("token_ids")]
        for k in (1, 5, MAX_TOKENS - 1):
            rest = {"model": "tiny", "prompt": prompt_ids + want_ids[:k], "ignore_eos": True,
                    "max_tokens": MAX_TOKENS - k, "return_token_ids": True, "stream": True}
            ids, text = collect(client.post(mixed + "/v1/completions", json=rest,
                                            timeout=60), True)
            assert ids == want_ids[k:], (prompt, k)
            # Text too, even when a character is split across the seam.
            assert "".join(pieces[:k]) + text == want_text, (prompt, k)
