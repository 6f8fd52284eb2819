"""Request migration over real sockets: a decode fails mid-stream, the client never knows.

Contract stand-ins (vLLM's token-id contract, tests/standins_engines.py) behind a real
router. d1 fails after a few tokens (connection cut, an error event, or silence); the
router continues the stream on d2 from the token ids already sent.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from standins_engines import generate_ids, prompt_ids, token_text
from standins_fleet import Fleet, LoopThread

from router.config import Retries, Timeouts
from router.guard import LOOPBACK_ALLOW
from router.service import RouterConfig, RouterServer
from wire.protocol import Handshake, Role

P, D = Role.PREFILL, Role.DECODE
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FAULTS = ("cut", "error", "stall")


def start_router(servers: list[RouterServer], fleet: Fleet, **config: Any) -> RouterServer:
    config.setdefault("policy", "round_robin")  # d1 (the faulty one) is picked first
    config.setdefault("upstream", Timeouts(idle_read_s=0.5))
    config.setdefault("allow_upstream", LOOPBACK_ALLOW)
    server = RouterServer(RouterConfig(port=0, **config), fleet.view).start()
    servers.append(server)
    return server


def two_decodes(loop_thread: LoopThread, protocol: str, fault: str, after: int) -> Fleet:
    fleet = Fleet(loop_thread, protocol)
    fleet.add("p1", P)
    bad = fleet.add("d1", D)
    fleet.add("d2", D)
    if fault == "cut":
        bad.faults.cut_after_chunks = after
    elif fault == "error":
        bad.faults.error_after_chunks = after
    else:
        bad.faults.stall_after_chunks = after
    return fleet


def sse(response: httpx.Response) -> list[Any]:
    assert response.status_code == 200, response.text
    out: list[Any] = []
    for line in response.text.split("\n"):
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def metric(server: RouterServer, series: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def body_for(path: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 10}
    if path == CHAT:
        base["messages"] = [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hello there"}]
    else:
        base["prompt"] = "once upon a time"
    return {**base, **extra}


def texts(events: list[Any], chat: bool) -> list[str]:
    out = []
    for e in events[:-1]:
        for choice in e.get("choices", ()):
            out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return [t for t in out if t]


# SGLang streams no token ids on chat (see the next test); everything else migrates.
MIGRATING = [(protocol, path) for protocol in Handshake for path in (COMPLETIONS, CHAT)
             if not (protocol == Handshake.SGLANG and path == CHAT)]


@pytest.mark.parametrize(("protocol", "path"), MIGRATING)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_stream_survives_its_decode(loop_thread: LoopThread, routers: list[RouterServer],
                                      protocol: str, path: str, fault: str) -> None:
    fleet = two_decodes(loop_thread, protocol, fault, after=4)
    server = start_router(routers, fleet)
    body = body_for(path, stream_options={"include_usage": True})
    events = sse(httpx.post(server.url + path, json=body, timeout=30))
    prompt = prompt_ids(path, body)
    want = generate_ids(prompt, 10)
    chat = path == CHAT
    assert events[-1] == "[DONE]"
    assert texts(events, chat) == [token_text(t) for t in want]  # none lost, none twice
    assert len({e["id"] for e in events[:-1]}) == 1  # one response id
    assert {e["object"] for e in events[:-1]} == {
        "chat.completion.chunk" if chat else "text_completion"}
    assert events[-2]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 10,
                                   "total_tokens": len(prompt) + 10}
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
    assert finishes.count("length") == 1
    # The client did not ask for token ids: like vLLM, the stream says null.
    assert not any(e.get("prompt_token_ids") or c.get("token_ids")
                   or c.get("prompt_token_ids") for e in events[:-1] for c in e["choices"])
    reason = {"cut": "eof", "error": "error_event", "stall": "idle_timeout"}[fault]
    if protocol != Handshake.VLLM_P2P or fault != "cut":
        assert metric(server, f'pdreg_router_migrations_total{{reason="{reason}"}}') == 1
    assert metric(server, 'pdreg_router_requests_total{model="m",outcome="ok"}') == 1
    # d2 continued from the ids: prompt + the 4 tokens sent, 6 left to generate.
    d2 = fleet.engines["d2"]
    continued = d2.requests[-1][1]
    assert d2.requests[-1][0] == COMPLETIONS
    assert continued["prompt"] == list(prompt) + want[:4]
    assert continued["max_tokens"] == 6 and continued["return_token_ids"] is True


def test_an_sglang_chat_stream_falls_back_to_the_error_event(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = two_decodes(loop_thread, Handshake.SGLANG, "cut", after=3)
    server = start_router(routers, fleet)
    events = sse(httpx.post(server.url + CHAT, json=body_for(CHAT), timeout=30))
    assert len(texts(events, True)) == 3
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert metric(server, 'pdreg_router_unmigratable_total{why="no_token_ids"}') == 1
    # It never asked SGLang for what SGLang refuses.
    assert all("return_token_ids" not in body for _, body, _ in
               fleet.engines["d1"].requests)


def test_the_cut_reason_is_a_reset_or_eof(loop_thread: LoopThread,
                                          routers: list[RouterServer]) -> None:
    fleet = two_decodes(loop_thread, Handshake.VLLM_P2P, "cut", after=2)
    server = start_router(routers, fleet)
    events = sse(httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS), timeout=30))
    assert len(texts(events, False)) == 10
    text = httpx.get(server.url + "/metrics").text
    assert 'pdreg_router_migrations_total{reason="eof"} 1.0' in text or \
        'pdreg_router_migrations_total{reason="reset"} 1.0' in text


def test_a_client_that_asked_for_ids_gets_all_of_them_once(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = two_decodes(loop_thread, Handshake.VLLM_NIXL, "cut", after=3)
    server = start_router(routers, fleet)
    body = body_for(CHAT, return_token_ids=True)
    events = sse(httpx.post(server.url + CHAT, json=body, timeout=30))
    prompt = list(prompt_ids(CHAT, body))
    assert events[0]["prompt_token_ids"] == prompt
    assert sum(e.get("prompt_token_ids") is not None for e in events[:-1]) == 1
    ids = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == generate_ids(prompt, 10)


def test_a_chat_without_max_tokens_continues_to_the_context_length(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = two_decodes(loop_thread, Handshake.VLLM_NIXL, "cut", after=3)
    for engine in fleet.engines.values():
        engine.max_model_len = 40
    server = start_router(routers, fleet)
    body = body_for(CHAT)
    del body["max_tokens"]
    events = sse(httpx.post(server.url + CHAT, json=body, timeout=30))
    prompt = prompt_ids(CHAT, body)
    assert texts(events, True) == [token_text(t) for t in generate_ids(prompt, 40 - len(prompt))]
    assert fleet.engines["d2"].requests[-1][1]["max_tokens"] is None


@pytest.mark.parametrize(("config", "extra", "why"), [
    ({"retries": Retries(max_migrations=0)}, {}, "budget"),
    ({}, {"n": 2}, "request_shape"),
])
def test_what_cannot_migrate_ends_with_an_error_event(
        loop_thread: LoopThread, routers: list[RouterServer], config: dict[str, Any],
        extra: dict[str, Any], why: str) -> None:
    fleet = two_decodes(loop_thread, Handshake.VLLM_NIXL, "cut", after=3)
    server = start_router(routers, fleet, **config)
    events = sse(httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS, **extra),
                            timeout=30))
    assert len(texts(events, False)) == 3
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert metric(server, f'pdreg_router_unmigratable_total{{why="{why}"}}') == 1
    assert metric(server, 'pdreg_router_requests_total{model="m",outcome="failed_midstream"}') == 1


def test_every_decode_failing_is_bounded_by_max_migrations(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    for i in range(4):
        fleet.add(f"d{i}", D).faults.cut_after_chunks = 2
    server = start_router(routers, fleet, retries=Retries(max_migrations=2))
    events = sse(httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS), timeout=30))
    assert len(texts(events, False)) == 6  # 2 tokens from each of three decodes
    assert "error" in events[-2]
    assert metric(server, 'pdreg_router_unmigratable_total{why="budget"}') == 1


def test_a_stream_whose_last_token_was_sent_is_completed_not_migrated(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = two_decodes(loop_thread, Handshake.VLLM_NIXL, "cut", after=10)  # all 10 sent
    server = start_router(routers, fleet)
    body = body_for(COMPLETIONS, stream_options={"include_usage": True})
    events = sse(httpx.post(server.url + COMPLETIONS, json=body, timeout=30))
    assert len(texts(events, False)) == 10 and events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 10
    assert len(fleet.engines["d2"].requests) == 0
    assert "pdreg_router_migrations_total{" not in httpx.get(server.url + "/metrics").text


def test_a_non_streaming_request_is_reissued_whole(loop_thread: LoopThread,
                                                   routers: list[RouterServer]) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D).faults.drop = True
    fleet.add("d2", D)
    server = start_router(routers, fleet)
    body = body_for(COMPLETIONS, stream=False)
    r = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
    assert r.status_code == 200
    want = generate_ids(prompt_ids(COMPLETIONS, body), 10)
    assert r.json()["choices"][0]["text"] == "".join(token_text(t) for t in want)


def test_a_silent_decode_is_left_within_the_idle_timeout(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = two_decodes(loop_thread, Handshake.VLLM_NIXL, "stall", after=2)
    server = start_router(routers, fleet, upstream=Timeouts(idle_read_s=0.3))
    started = time.monotonic()
    events = sse(httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS), timeout=30))
    assert len(texts(events, False)) == 10
    assert time.monotonic() - started < 5.0  # not the 3600 s the decode stays silent
    assert metric(server, 'pdreg_router_quarantines_total{member="d1"}') == 1
    # Not reported: a slow engine is not a dead one; a hung one stops heartbeating.
    assert fleet.view.reports == []


def test_a_stream_continues_on_a_quarantined_decode_rather_than_fail(
        loop_thread: LoopThread, routers: list[RouterServer]) -> None:
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", P)
    fleet.add("d1", D).faults.cut_after_chunks = 4  # the only decode, flaky
    server = start_router(routers, fleet)
    events = sse(httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS), timeout=30))
    assert len(texts(events, False)) == 10 and "error" not in events[-2]
    # A new request is not sent to it meanwhile: 503, as no member is left.
    r = httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS))
    assert r.status_code == 503


def test_itl_and_ttft_are_observed(loop_thread: LoopThread,
                                   routers: list[RouterServer]) -> None:
    fleet = two_decodes(loop_thread, Handshake.VLLM_NIXL, "cut", after=-1)
    fleet.engines["d1"].faults.token_delay_s = 0.01  # one token per read
    server = start_router(routers, fleet)
    sse(httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS), timeout=30))
    r = httpx.post(server.url + COMPLETIONS, json=body_for(COMPLETIONS, stream=False))
    assert r.status_code == 200
    assert metric(server, 'pdreg_router_ttft_seconds_count{model="m"}') == 2  # both kinds
    assert metric(server, 'pdreg_router_itl_seconds_count{model="m"}') >= 1
