"""Any client, over real sockets, tries to starve the `kv` router with prompts that cost
it to tokenize: 4 MB prompts, a 100,000-message chat, and prompts just long enough to be
tokenized, sent as fast as the router answers. Another client's small requests must
still be answered, and matched exactly; the long ones are paired as `peak_ewma`,
counted (docs/security.md). The router tokenizes with a Hugging Face tokenizer.json,
as for a real model. With one whose tokens cover a bounded number of characters, the
router answers what is surely over the engines' context with a 400 itself, and no
engine sees it (router/kv/limits.py). Timings are bench/bench_kv_starvation.py's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from reference_helpers import EngineHandle
from test_kv_e2e import SYSTEM, ask, kv_members, ready_pair, router_metric
from test_kv_tokenizer import make_byte_level_tokenizer, make_hf_tokenizer

from pdreg.testing import wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from router.guard import LOOPBACK_ALLOW
from router.kv.routing import MAX_CHAT_MESSAGES, KvOptions
from router.service import RouterConfig, RouterServer

WAIT_S = 30.0
HUGE = "hello world " * 350_000  # 4.2 MB: over the limit, never tokenized
LONG = "hello world " * 40_000  # 480 KB, 80,001 tokens: tokenized, in a long-prompt thread
CHAT = [{"role": "user", "content": "hello"}] * (MAX_CHAT_MESSAGES * 25)  # 102,400 messages


@pytest.fixture
def router(view: MembershipView, tmp_path: Path) -> Iterator[RouterServer]:
    make_hf_tokenizer(tmp_path)
    config = RouterConfig(port=0, policy="kv", allow_upstream=LOOPBACK_ALLOW,
                          kv=KvOptions(tokenizers=(("tiny", str(tmp_path)),)))
    server = RouterServer(config, view).start()
    try:
        yield server
    finally:
        server.close()


class Attacker(threading.Thread):
    """Sends one kind of costly request in a loop until told to stop; counts answers
    (any status: the engine refuses prompts over its context) and connection failures."""

    def __init__(self, url: str, body: dict, path: str = "/v1/completions") -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.path = url + path, body, path
        self.stop = threading.Event()
        self.answered = self.failed = 0

    def run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                try:
                    http.post(self.url, json={"model": "tiny", "max_tokens": 1, **self.body})
                    self.answered += 1
                except httpx.HTTPError:
                    self.failed += 1


def test_long_prompts_do_not_starve_small_requests(
        registry: RegistryServer, view: MembershipView, router: RouterServer,
        handles: list[EngineHandle]) -> None:
    p, _ = ready_pair(registry, view, handles, ["--kv-events"])
    assert wait_until(lambda: kv_members(router).get(p.id, {}).get("state") == "live",
                      WAIT_S)
    attackers = [Attacker(router.url, {"prompt": HUGE}), Attacker(router.url, {"prompt": LONG}),
                 Attacker(router.url, {"prompt": LONG}),
                 Attacker(router.url, {"messages": CHAT}, "/v1/chat/completions")]
    for a in attackers:
        a.start()
    try:
        # Under attack once each kind has been answered at least once.
        assert wait_until(lambda: all(a.answered for a in attackers), WAIT_S)
        exact_before = router_metric(router, "pdreg_router_prompt_tokens_total")
        with httpx.Client(timeout=60) as http:
            for question in ("Name a colour.", "Why is the sky blue?", "Count to three."):
                assert ask(http, router, SYSTEM + question)  # 200, tokens streamed
        # ...and matched exactly: their tokens were routed by the index.
        assert router_metric(router, "pdreg_router_prompt_tokens_total") > exact_before
    finally:
        for a in attackers:
            a.stop.set()
        for a in attackers:
            a.join(timeout=WAIT_S)
    assert not any(a.is_alive() for a in attackers)
    assert all(a.failed == 0 for a in attackers)  # every attack got an answer, no reset
    text = httpx.get(router.url + "/metrics", timeout=10).text
    too_long = [line for line in text.splitlines()
                if line.startswith("pdreg_router_kv_inexact_requests_total{")
                and 'why="too_long"' in line]
    assert too_long and float(too_long[0].rsplit(" ", 1)[1]) >= 2  # the 4 MB and the chat
    assert router_metric(router, "pdreg_router_kv_exact") == 1  # the model still exact


def engine_answered(router: RouterServer) -> float:
    """Requests an engine refused (its 400 passed on to the client)."""
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdreg_router_requests_total{")
               and 'outcome="client_error"' in line)


def refused_for_context(router: RouterServer) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdreg_router_refused_total{")
               and 'reason="context_length"' in line)


def test_a_prompt_surely_over_the_context_is_refused_before_an_engine_sees_it(
        registry: RegistryServer, view: MembershipView, handles: list[EngineHandle],
        tmp_path: Path) -> None:
    make_byte_level_tokenizer(tmp_path)  # a token covers at most 6 characters
    config = RouterConfig(port=0, policy="kv", allow_upstream=LOOPBACK_ALLOW,
                          kv=KvOptions(tokenizers=(("tiny", str(tmp_path)),)))
    router = RouterServer(config, view).start()
    try:
        ready_pair(registry, view, handles, ["--kv-events"])
        # Both register a 65,536-token context: more than 393,216 characters cannot fit.
        assert {m.record.spec.max_model_len for m in view.members().values()} == {65536}
        with httpx.Client(timeout=60) as http:
            assert ask(http, router, SYSTEM + "Name a colour.")  # followed, and served
            for path, body in (("/v1/completions", {"prompt": HUGE}),
                               ("/v1/completions", {"prompt": LONG}),
                               ("/v1/completions", {"prompt": list(range(70_000))}),
                               ("/v1/chat/completions", {"messages": CHAT})):
                r = http.post(router.url + path, json={"model": "tiny", **body})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["code"] == "context_length_exceeded"
                assert "maximum context length is 65536 tokens" in error["message"]
            assert refused_for_context(router) == 4
            assert engine_answered(router) == 0  # no engine saw any of them
            # Not surely too long for the router (360,000 characters): the engine says.
            r = http.post(router.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "hello world " * 30_000})
            assert r.status_code == 400  # the engine's byte tokens: 360,001 of them
            assert engine_answered(router) == 1 and refused_for_context(router) == 4
            assert ask(http, router, SYSTEM + "Why is the sky blue?")  # others unaffected
    finally:
        router.close()
