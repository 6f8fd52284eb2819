"""Long prompts cannot starve the router: over the limit they are not tokenized
(`too_long`), and a client gets one long-prompt tokenization at a time (`busy`) out of
a few for everyone; what is refused is paired as `peak_ewma`, counted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from test_kv_policy import publishing
from test_policies import view

from router.choice import NO_AFFINITY
from router.kv.long_prompts import LongPromptGate
from router.kv.policy import KvAffinity
from router.kv.routing import (
    CHEAP_OFF_LOOP_TOKENS,
    MAX_CHARS_PER_TOKEN,
    MAX_CHAT_MESSAGES,
    KvOptions,
    KvRouting,
)
from router.kv.tokenizer import BYTES_TOKENIZER
from router.metrics import RouterMetrics

MAX_TOKENS = 20_000


@pytest.mark.parametrize(("steps", "answers"), [
    ([("enter", "a")], [True]),
    ([("enter", "a"), ("enter", "a")], [True, False]),  # one per client
    ([("enter", "a"), ("enter", "b"), ("enter", "c")], [True, True, False]),  # two in all
    ([("enter", "a"), ("leave", "a"), ("enter", "a")], [True, None, True]),
    ([("leave", "a"), ("enter", "a"), ("enter", "b")], [None, True, True]),  # stray leave
])
def test_gate_table(steps, answers):
    gate = LongPromptGate(max_in_flight=2, per_client=1)
    got = [gate.enter(client) if op == "enter" else gate.leave(client)
           for op, client in steps]
    assert got == answers
    assert 0 <= gate.in_flight <= 2


@pytest.fixture
def kv() -> Iterator[KvRouting]:
    routing = KvRouting(RouterMetrics(), KvOptions(tokenizers=(("m", BYTES_TOKENIZER),),
                                                   max_prompt_tokens=MAX_TOKENS),
                        allows=lambda a: True)
    routing.on_members(view(publishing("p")))
    try:
        yield routing
    finally:
        routing.close()


def inexact(kv: KvRouting, why: str) -> float:
    return kv.metrics.kv_inexact_requests.labels("m", why).value


@pytest.mark.parametrize(("body", "why"), [
    ({"prompt": "x" * (MAX_TOKENS * MAX_CHARS_PER_TOKEN + 1)}, "too_long"),
    ({"prompt": "x" * (MAX_TOKENS + 1)}, "too_long"),  # tokenized: 20,002 byte tokens
    ({"prompt": list(range(MAX_TOKENS + 1))}, "too_long"),
    ({"messages": [{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1)}, "too_long"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 10**6}]}] * 2},
     "too_long"),
])
def test_prompts_over_the_limit_are_not_matched(kv, body, why):
    assert asyncio.run(kv.affinity({"model": "m", **body}, "m", "10.0.0.1")) is NO_AFFINITY
    assert inexact(kv, why) == 1


def test_a_clients_second_long_prompt_waits_its_turn_not_others():
    routing = KvRouting(RouterMetrics(), KvOptions(tokenizers=(("m", BYTES_TOKENIZER),)),
                        allows=lambda a: True)
    try:
        routing.on_members(view(publishing("p")))
        body = {"model": "m", "prompt": "y" * (CHEAP_OFF_LOOP_TOKENS + 1)}
        assert routing.long_prompts.enter("10.0.0.1")  # its first, still tokenizing
        assert asyncio.run(routing.affinity(body, "m", "10.0.0.1")) is NO_AFFINITY
        assert inexact(routing, "busy") == 1
        other = asyncio.run(routing.affinity(body, "m", "10.0.0.2"))
        assert isinstance(other, KvAffinity) and other.prompt_tokens == CHEAP_OFF_LOOP_TOKENS + 2
        short = asyncio.run(routing.affinity({"model": "m", "prompt": "hi"}, "m", "10.0.0.1"))
        assert isinstance(short, KvAffinity)  # short prompts are tokenized on the loop
        routing.long_prompts.leave("10.0.0.1")
        assert routing.long_prompts.in_flight == 0  # the others' entries were released
    finally:
        routing.close()
