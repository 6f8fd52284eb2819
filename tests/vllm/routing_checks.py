"""The routing half of `make test-vllm`: real vLLM prefill + decodes behind `pdreg router`.

Run by check_vllm_sidecar.py once both engines are READY. Through the router, with the
real `openai` client, it asserts:
- /v1/models lists the model;
- completions and chat completions, streaming and not (greedy, `ignore_eos`, fixed
  `max_tokens`, `return_token_ids`), give exactly the token ids and text that one vLLM
  instance gives for the same request: the reference is the prefill engine itself,
  asked plainly (no `kv_transfer_params`), which serves the request locally — checked:
  it answers with all `max_tokens` tokens and no `kv_transfer_params`;
- the decodes' `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`, summed,
  grew by exactly the routed prompts' lengths: the KV travelled from P to D over NIXL
  rather than being recomputed on D;
- the router picked the prefill and the decodes, and retried nothing.

Every prompt starts with its own case name, so no request hits another's prefix cache on
the decode (a local cache hit would be counted under another source).

On a shared 2-core machine the whole box can stall for tens of seconds; the router then
sees its 3 s connect timeout expire and, with one P and one D, answers 502 after its own
retries. Such a routed request is tried again here (at most OVERLOAD_RETRIES times, each
said loudly); the token comparison holds for the attempt that succeeded, and the KV and
retry accounting allow for the failed attempts (and only for them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from engine_agent.probes import parse_gauges
from pdreg.testing import wait_until

logger = logging.getLogger(__name__)

MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0  # one request; vLLM on a loaded 2-core machine can stall a while
METRICS_SETTLE_S = 30.0  # vLLM records prompt-token stats just after the response
OVERLOAD_RETRIES = 2  # extra tries of a routed request that failed in transit (see above)
OVERLOAD_PAUSE_S = 5.0
# What a stalled machine looks like from the client: the router's 502/503, or a timeout.
TRANSIT_STATUSES = (502, 503, 504)
PROMPT_SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
EXTERNAL_SOURCE = "external_kv_transfer"
# Greedy, fixed length whatever the random model emits, and the ids to compare.
SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
EXTRA_BODY: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}


@dataclass
class Output:
    """What one request produced: generated ids and text, prompt length, P/D params."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    kv_transfer_params: Any = None


@dataclass(frozen=True)
class Case:
    name: str
    chat: bool
    stream: bool

    @property
    def prompt(self) -> str:
        return f"{self.name}: the registry keeps the live membership of every engine"


CASES = (
    Case("completion", chat=False, stream=False),
    Case("completion-stream", chat=False, stream=True),
    Case("chat", chat=True, stream=False),
    Case("chat-stream", chat=True, stream=True),
)


def client(base_url: str, api_key: str = "") -> openai.OpenAI:
    # No retries: a request that needed one is a failure this check must see.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "unused",
                         timeout=REQUEST_TIMEOUT_S, max_retries=0)


def run_case(api: openai.OpenAI, model: str, case: Case) -> Output:
    extra = dict(EXTRA_BODY)
    if case.stream:
        # Usage comes in a last chunk; the router must drop stream_options on its
        # (non-streaming) prefill leg, or vLLM refuses that leg.
        extra_args: dict[str, Any] = {"stream_options": {"include_usage": True}}
    else:
        extra_args = {}
    if case.chat:
        messages = [{"role": "user", "content": case.prompt}]
        if case.stream:
            stream = api.chat.completions.create(model=model, messages=messages, stream=True,
                                                 extra_body=extra, **SAMPLING, **extra_args)
            return _collect_stream(stream, lambda choice: choice.delta.content)
        reply = api.chat.completions.create(model=model, messages=messages,
                                            extra_body=extra, **SAMPLING)
        choice = reply.choices[0]
        return _finished(reply, choice, choice.message.content)
    if case.stream:
        stream = api.completions.create(model=model, prompt=case.prompt, stream=True,
                                        extra_body=extra, **SAMPLING, **extra_args)
        return _collect_stream(stream, lambda choice: choice.text)
    reply = api.completions.create(model=model, prompt=case.prompt, extra_body=extra,
                                   **SAMPLING)
    choice = reply.choices[0]
    return _finished(reply, choice, choice.text)


def _extra(obj: Any, name: str) -> Any:
    """A vLLM-specific field the openai types do not declare (kept in model_extra)."""
    return (getattr(obj, "model_extra", None) or {}).get(name)


def _finished(reply: Any, choice: Any, text: str | None) -> Output:
    token_ids = _extra(choice, "token_ids")
    assert isinstance(token_ids, list), f"no token_ids in the reply (return_token_ids): {reply}"
    assert reply.usage is not None, f"no usage in the reply: {reply}"
    return Output(token_ids=token_ids, text=text or "", prompt_tokens=reply.usage.prompt_tokens,
                  completion_tokens=reply.usage.completion_tokens,
                  kv_transfer_params=_extra(reply, "kv_transfer_params"))


def _collect_stream(stream: Any, text_of: Callable[[Any], str | None]) -> Output:
    out = Output()
    for chunk in stream:
        for choice in chunk.choices:
            out.text += text_of(choice) or ""
            out.token_ids.extend(_extra(choice, "token_ids") or [])
        if chunk.usage is not None:
            out.prompt_tokens = chunk.usage.prompt_tokens
            out.completion_tokens = chunk.usage.completion_tokens
    assert out.prompt_tokens > 0, "the stream carried no usage chunk (stream_options)"
    return out


@dataclass
class Transit:
    """Routed requests that failed in transit and were tried again, and their prompts."""

    failures: int = 0
    prompt_tokens: int = 0


def run_routed(api: openai.OpenAI, model: str, case: Case, prompt_tokens: int,
               transit: Transit, say: Callable[[str], None]) -> Output:
    for attempt in range(OVERLOAD_RETRIES + 1):
        try:
            return run_case(api, model, case)
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            status = getattr(exc, "status_code", None)
            transient = status in TRANSIT_STATUSES or isinstance(
                exc, openai.APIConnectionError)
            if not transient or attempt == OVERLOAD_RETRIES:
                raise
            transit.failures += 1
            transit.prompt_tokens += prompt_tokens
            say(f"WARNING: {case.name} through the router failed in transit ({exc}); "
                f"machine overloaded? trying again in {OVERLOAD_PAUSE_S:.0f}s")
            time.sleep(OVERLOAD_PAUSE_S)  # let the machine catch up; no condition to wait on
    raise AssertionError("unreachable")


def prompt_tokens_by_source(engine_url: str) -> dict[str, float]:
    """The engine's prompt-token counters by source, summed over its engine cores."""
    response = httpx.get(f"{engine_url}/metrics", timeout=10)
    response.raise_for_status()
    totals: dict[str, float] = {}
    for labels, value in parse_gauges(response.text, [PROMPT_SOURCE_METRIC]).get(
            PROMPT_SOURCE_METRIC, []):
        source = labels.get("source", "")
        totals[source] = totals.get(source, 0.0) + value
    return totals


def prompt_tokens_by_decodes(decode_urls: list[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for url in decode_urls:
        for source, value in prompt_tokens_by_source(url).items():
            totals[source] = totals.get(source, 0.0) + value
    return totals


def check_models(router_url: str, model: str, api_key: str = "") -> None:
    listed = [m.id for m in client(router_url, api_key).models.list().data]
    assert model in listed, f"router /v1/models lists {listed}, not {model!r}"


def check_routed_outputs(router_url: str, api_key: str, prefill_url: str,
                         decode_urls: list[str], model: str,
                         say: Callable[[str], None]) -> Transit:
    """Each case through the router against the same request served by the prefill alone;
    then the decodes' external-KV counters against the routed prompt lengths."""
    router_api, reference_api = client(router_url, api_key), client(prefill_url)
    before = prompt_tokens_by_decodes(decode_urls)
    routed_prompt_tokens = 0
    transit = Transit()
    for case in CASES:
        reference = run_case(reference_api, model, case)
        assert reference.completion_tokens == MAX_TOKENS, (
            f"{case.name}: the prefill alone generated {reference.completion_tokens} tokens, "
            f"not {MAX_TOKENS}: it did not serve the plain request locally")
        assert reference.kv_transfer_params is None, (
            f"{case.name}: a plain request to the prefill came back with kv_transfer_params "
            f"{reference.kv_transfer_params}: not served locally")
        assert len(reference.token_ids) == MAX_TOKENS, (case.name, reference)
        routed = run_routed(router_api, model, case, reference.prompt_tokens, transit, say)
        assert routed.token_ids == reference.token_ids, (
            f"{case.name}: routed token ids differ from a single instance's\n"
            f"  routed:    {routed.token_ids}\n  reference: {reference.token_ids}")
        assert routed.text == reference.text, (
            f"{case.name}: routed text {routed.text!r} != reference {reference.text!r}")
        assert routed.prompt_tokens == reference.prompt_tokens, (case.name, routed, reference)
        routed_prompt_tokens += routed.prompt_tokens
        say(f"ok: {case.name} through the router = single instance "
            f"({routed.prompt_tokens} prompt tokens, ids {routed.token_ids[:6]}...)")

    expected = before.get(EXTERNAL_SOURCE, 0.0) + routed_prompt_tokens
    last: dict[str, float] = {}

    def grown() -> bool:
        last.update(prompt_tokens_by_decodes(decode_urls))
        return last.get(EXTERNAL_SOURCE, 0.0) >= expected

    wait_until(grown, METRICS_SETTLE_S, poll_s=0.5)
    grew = {source: last.get(source, 0.0) - before.get(source, 0.0) for source in last}
    external = grew.get(EXTERNAL_SOURCE, 0.0)
    # A request that failed in transit may or may not have reached the decode's pull.
    assert routed_prompt_tokens <= external <= routed_prompt_tokens + transit.prompt_tokens, (
        f"decodes' {PROMPT_SOURCE_METRIC} grew by {grew} over the routed requests; expected "
        f"{EXTERNAL_SOURCE} to grow by their {routed_prompt_tokens} prompt tokens (the KV "
        f"should travel from the prefill, not be computed on the decode)"
        + (f", plus at most {transit.prompt_tokens} from requests that failed in transit"
           if transit.failures else ""))
    say(f"ok: decodes' prompt tokens from external_kv_transfer grew by {external:.0f}, "
        f"the routed prompts' lengths {routed_prompt_tokens} (by source: {grew})")
    return transit


def check_router_picks(router_url: str, prefill_id: str, decode_ids: list[str],
                       transit: Transit, max_attempts: int) -> None:
    """The router's own account: the prefill picked for every case, the decodes between
    them too, no retry needed (beyond the router's own retries of requests that failed
    in transit)."""
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    samples = parse_gauges(text, ["pdreg_router_picks_total", "pdreg_router_retries_total"])
    picks = {(labels.get("member"), labels.get("role")): value
             for labels, value in samples.get("pdreg_router_picks_total", [])}
    assert picks.get((prefill_id, "prefill"), 0) >= len(CASES), (
        f"router picks {picks}; expected prefill {prefill_id} at least {len(CASES)} times")
    decode_picks = sum(picks.get((member_id, "decode"), 0) for member_id in decode_ids)
    assert decode_picks >= len(CASES), (
        f"router picks {picks}; expected the decodes {decode_ids} at least {len(CASES)} "
        f"times in all")
    retries = sum(value for _, value in samples.get("pdreg_router_retries_total", []))
    allowed = transit.failures * max_attempts  # each failed request: every attempt failed
    assert retries <= allowed, (
        f"the router retried {retries} times (allowed {allowed} for {transit.failures} "
        f"requests that failed in transit): {samples}")
