"""The sim backend on real processes: KV really travels and is always freed, queueing
and load figures, SGLang rooms, router probes, bad input, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from reference_helpers import (
    EngineHandle,
    collect,
    metrics,
    sglang_pd,
    start_engines,
    stop_all,
    vllm_pd,
)

from pdreg.testing import wait_until

BODY = {"model": "tiny", "prompt": "sim prompt " * 8, "max_tokens": 8, "ignore_eos": True,
        "return_token_ids": True}
SIM_KV_BYTES_PER_TOKEN = "256"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineHandle]]:
    kv = ["--sim-kv-bytes-per-token", SIM_KV_BYTES_PER_TOKEN]
    names = ("mixed", "prefill", "decode", "short_lease", "impatient_decode", "slow")
    handles = start_engines([
        {"role": "mixed", "extra_args": kv},
        {"role": "prefill", "extra_args": kv},
        {"role": "decode", "extra_args": kv},
        {"role": "prefill", "extra_args": [*kv, "--kv-lease", "0.5"]},
        {"role": "decode", "extra_args": [*kv, "--kv-fetch-timeout", "0.5"]},
        {"role": "mixed", "extra_args": ["--max-running", "2", "--sim-decode-delay", "0.01",
                                         "--kv-capacity-tokens", "1000"]},
    ])
    try:
        yield dict(zip(names, handles, strict=True))
    finally:
        assert stop_all(handles) == [0] * len(handles)


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def test_pd_matches_mixed_on_sim(engines: dict[str, EngineHandle],
                                 client: httpx.Client) -> None:
    expected = collect(client.post(engines["mixed"].url + "/v1/completions", json=BODY), False)
    assert collect(vllm_pd(client, engines["prefill"].url, engines["decode"].url, BODY),
                   False) == expected
    assert collect(sglang_pd(client, engines["prefill"], engines["decode"].url, BODY),
                   False) == expected


async def _thousand_pd_requests(prefill: EngineHandle, decode: EngineHandle) -> int:
    """1,000 requests, 16 at a time, alternating vLLM and SGLang handshakes; # of 200s."""
    ok = 0
    limit = asyncio.Semaphore(16)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json()

        async def one(i: int) -> None:
            nonlocal ok
            body = {**BODY, "prompt": f"request {i} " * (1 + i % 20)}
            async with limit:
                if i % 2:
                    first = await post(prefill.url, {
                        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
                    out = await post(decode.url, {**body, "kv_transfer_params":
                                                  first["kv_transfer_params"]})
                else:
                    room = random.getrandbits(63)
                    full = {**body, "bootstrap_host": prefill.host,
                            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
                    _, out = await asyncio.gather(post(prefill.url, full),
                                                  post(decode.url, full))
                if len(out["choices"][0]["token_ids"]) == BODY["max_tokens"]:
                    ok += 1

        await asyncio.gather(*(one(i) for i in range(1000)))
    return ok


def test_no_kv_left_on_prefill_after_1000_requests(engines: dict[str, EngineHandle]) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    before = metrics(prefill.url)["pdreg:kv_transfers_total"]
    assert asyncio.run(_thousand_pd_requests(prefill, decode)) == 1000
    after = metrics(prefill.url)
    assert after["pdreg:kv_transfers_total"] - before == 1000
    assert after["pdreg:kv_held_entries"] == 0
    assert after["pdreg:kv_held_tokens"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["pdreg:kv_expired_total"] == 0
    assert metrics(decode.url)["vllm:kv_cache_usage_perc"] == 0


def test_unclaimed_kv_is_freed_when_its_lease_ends(engines: dict[str, EngineHandle],
                                                   client: httpx.Client) -> None:
    prefill = engines["short_lease"]
    first = client.post(prefill.url + "/v1/completions", json={
        **BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    assert metrics(prefill.url)["pdreg:kv_held_entries"] == 1
    assert metrics(prefill.url)["vllm:kv_cache_usage_perc"] > 0
    assert wait_until(lambda: metrics(prefill.url)["pdreg:kv_held_entries"] == 0, 10)
    assert metrics(prefill.url)["pdreg:kv_expired_total"] == 1
    assert metrics(prefill.url)["vllm:kv_cache_usage_perc"] == 0
    late = client.post(engines["decode"].url + "/v1/completions",
                       json={**BODY, "kv_transfer_params": first["kv_transfer_params"]})
    assert late.status_code == 502
    assert "expired" in late.json()["error"]["message"]


def test_decode_fails_clearly_when_the_prefill_is_unreachable(
        engines: dict[str, EngineHandle], client: httpx.Client) -> None:
    params = client.post(engines["prefill"].url + "/v1/completions", json={
        **BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()[
        "kv_transfer_params"]
    # Pull it properly first, so nothing stays held; then point at a port nobody serves.
    assert client.post(engines["decode"].url + "/v1/completions",
                       json={**BODY, "kv_transfer_params": params}).status_code == 200
    dead = {**params, "remote_port": engines["mixed"].kv_port or 1}
    response = client.post(engines["impatient_decode"].url + "/v1/completions",
                           json={**BODY, "kv_transfer_params": dead})
    assert response.status_code == 504
    assert "did not answer" in response.json()["error"]["message"]
    # The decode is still healthy afterwards.
    assert client.get(engines["impatient_decode"].url + "/health").status_code == 200


def test_sglang_decode_waits_for_its_room(engines: dict[str, EngineHandle],
                                          client: httpx.Client) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    room = random.getrandbits(63)
    full = {**BODY, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room}
    result: dict[str, httpx.Response] = {}
    decode_thread = threading.Thread(target=lambda: result.setdefault(
        "d", client.post(decode.url + "/v1/completions", json=full)))
    decode_thread.start()  # the decode asks first; the prefill comes later
    try:
        assert client.post(prefill.url + "/v1/completions", json=full).status_code == 200
    finally:
        decode_thread.join(30)
    expected = collect(client.post(engines["mixed"].url + "/v1/completions", json=BODY), False)
    assert collect(result["d"], False) == expected


def test_sglang_room_that_never_comes_times_out(engines: dict[str, EngineHandle],
                                                client: httpx.Client) -> None:
    prefill = engines["prefill"]
    full = {**BODY, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    response = client.post(engines["impatient_decode"].url + "/v1/completions", json=full)
    assert response.status_code == 504
    assert "no prefill produced KV" in response.json()["error"]["message"]


def test_requests_beyond_max_running_queue_and_complete(engines: dict[str, EngineHandle],
                                                        client: httpx.Client) -> None:
    engine = engines["slow"]  # --max-running 2, 10 ms per token
    seen: list[dict[str, float]] = []
    responses: list[httpx.Response] = []

    def send() -> None:
        responses.append(client.post(engine.url + "/v1/completions",
                                     json={**BODY, "max_tokens": 30}))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        assert wait_until(lambda: seen.append(metrics(engine.url)) or (
            seen[-1]["vllm:num_requests_running"] == 2
            and seen[-1]["vllm:num_requests_waiting"] >= 1), 20, 0.01)
    finally:
        for thread in threads:
            thread.join(30)
    assert max(m["vllm:num_requests_running"] for m in seen) == 2  # never above the limit
    assert max(m["vllm:kv_cache_usage_perc"] for m in seen) > 0
    assert [r.status_code for r in responses] == [200] * 8
    assert all(len(r.json()["choices"][0]["token_ids"]) == 30 for r in responses)
    final = metrics(engine.url)
    assert (final["vllm:num_requests_running"], final["vllm:num_requests_waiting"],
            final["vllm:kv_cache_usage_perc"]) == (0, 0, 0)


def test_probes_peer_routers_make(engines: dict[str, EngineHandle],
                                  client: httpx.Client) -> None:
    prefill = engines["prefill"]
    assert client.get(prefill.url + "/health").status_code == 200
    info = client.get(prefill.url + "/server_info").json()
    assert info["disaggregation_mode"] == "prefill"
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert os.path.isdir(info["model_path"]) and not os.listdir(info["model_path"])
    assert client.get(engines["decode"].url + "/get_server_info").json()[
        "disaggregation_mode"] == "decode"
    for path in ("/model_info", "/get_model_info"):
        assert client.get(prefill.url + path).json()["model_path"] == info["model_path"]
    assert client.get(prefill.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    text = client.get(prefill.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", 'model_name="tiny"'):
        assert name in text
    # vllm-router's X-Request-Id names the request, as in vLLM: cmpl-<id>.
    response = client.post(engines["mixed"].url + "/v1/completions", json=BODY,
                           headers={"X-Request-Id": "___prefill_addr_a___decode_addr_b_1f"})
    assert response.json()["id"] == "cmpl-___prefill_addr_a___decode_addr_b_1f"


@pytest.mark.parametrize(("body", "fragment"), [
    ({"prompt": "x", "n": 2}, "n must be 1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 999]}, "outside the vocabulary"),
    ({"prompt": ["a", "b"]}, "one prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}, "not a prefill"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}, "remote_request_id"),
])
def test_bad_requests_get_a_clear_400(engines: dict[str, EngineHandle], client: httpx.Client,
                                      body: dict[str, Any], fragment: str) -> None:
    response = client.post(engines["mixed"].url + "/v1/completions", json=body)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]
    assert client.get(engines["mixed"].url + "/health").status_code == 200


def test_streaming_chat_ends_with_done(engines: dict[str, EngineHandle],
                                       client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    response = client.post(engines["mixed"].url + "/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":5' in response.text


def test_sigterm_drains_in_flight_requests(engines: dict[str, EngineHandle]) -> None:
    [engine] = start_engines([{"role": "mixed",
                               "extra_args": ["--sim-decode-delay", "0.02"]}])
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        engine.url + "/v1/completions", json={**BODY, "max_tokens": 40}, timeout=30)))
    try:
        thread.start()
        assert wait_until(lambda: metrics(engine.url)["vllm:num_requests_running"] == 1, 10,
                          0.01)
        engine.proc.send_signal(signal.SIGTERM)
        thread.join(30)
        assert engine.proc.wait(30) == 0
    finally:
        engine.stop()
    assert result["r"].status_code == 200
    assert len(result["r"].json()["choices"][0]["token_ids"]) == 40
