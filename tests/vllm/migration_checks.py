"""A decode killed with kill -9 while it streams: the client's stream still completes.

Run by check_vllm_sidecar.py with one prefill and two decodes behind `pdreg router`.
Streams (completions and chat, with and without `return_token_ids`, all with usage) go
through the router at once; when every one of them has delivered tokens, the decode
holding the most of them (by the router's `pdreg_router_in_flight`) is killed with
SIGKILL, sidecar and vLLM processes at once (a lost machine: the registry only learns of
it when the lease runs out). The router must
continue each cut stream on the surviving decode from the token ids already sent
(docs/engines.md §6: exact on vLLM over NIXL), so every client gets:
- a 200 stream ending in `[DONE]`, with no error event;
- exactly the text (and, where asked, the token ids) one vLLM instance gives for the
  same request: the prefill engine asked plainly;
- the same usage as that instance (prompt tokens of the original prompt, every
  completion token counted once), one finish reason and one response id throughout.
And the router counts the migrations (`pdreg_router_migrations_total`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster import Engine, Router, wait_logged
from sse import Streamed, post_stream

from engine_agent.probes import parse_gauges

# Long enough that streams are still generating at the kill: ~300 tokens take 2 s here.
# Prompts are ~20-35 tokens and --max-model-len is 512.
MAX_TOKENS = 440
TOKENS_BEFORE_KILL = 2  # content chunks each stream must have delivered first
STREAM_TIMEOUT_S = 180.0
START_TIMEOUT_S = 120.0
MIGRATIONS_METRIC = "pdreg_router_migrations_total"
IN_FLIGHT_METRIC = "pdreg_router_in_flight"
SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class Case:
    name: str
    chat: bool
    token_ids: bool  # whether the client asks for them (the router tracks ids either way)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        prompt = f"migrate {self.name}: heartbeats carry the load of every engine"
        body: dict[str, Any] = {"model": model, **SAMPLING}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.token_ids:
            body["return_token_ids"] = True
        return body


CASES = (
    Case("completion-ids", chat=False, token_ids=True),
    Case("chat-ids", chat=True, token_ids=True),
    Case("completion-text", chat=False, token_ids=False),
    Case("chat-text", chat=True, token_ids=False),
)


@dataclass
class Run:
    """One client stream, read in its own thread."""

    case: Case
    streamed: Streamed = field(default_factory=Streamed)
    error: Exception | None = None
    thread: threading.Thread | None = None

    def content_chunks(self) -> int:
        return sum(1 for chunk in list(self.streamed.chunks) if chunk.get("choices"))


def in_threads(calls: list[Callable[[], None]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    return threads


def migrations(router: Router) -> dict[str, float]:
    samples = parse_gauges(router.metrics(), [MIGRATIONS_METRIC])
    by_reason: dict[str, float] = {}
    for labels, value in samples.get(MIGRATIONS_METRIC, []):
        reason = labels.get("reason", "")
        by_reason[reason] = by_reason.get(reason, 0.0) + value
    return by_reason


def in_flight(router: Router) -> dict[str, float]:
    """Requests the router has open, by member id."""
    samples = parse_gauges(router.metrics(), [IN_FLIGHT_METRIC])
    return {labels.get("member", ""): value
            for labels, value in samples.get(IN_FLIGHT_METRIC, [])}


def references(prefill: Engine, model: str) -> dict[str, Streamed]:
    """Every case served by one instance (the prefill asked plainly), all at once."""
    out: dict[str, Streamed] = {}
    errors: list[Exception] = []

    def one(case: Case) -> Callable[[], None]:
        def call() -> None:
            try:
                body = {**case.body(model), "return_token_ids": True}
                out[case.name] = post_stream(f"{prefill.url}{case.path}", body,
                                             STREAM_TIMEOUT_S)
            except Exception as exc:  # re-raised in the main thread
                errors.append(exc)
        return call

    for thread in in_threads([one(case) for case in CASES]):
        thread.join(STREAM_TIMEOUT_S)
    if errors:
        raise errors[0]
    for case in CASES:
        ref = out[case.name]
        assert len(ref.token_ids) == MAX_TOKENS and ref.done, (
            f"{case.name}: the prefill alone gave {len(ref.token_ids)} tokens, "
            f"not {MAX_TOKENS}, done={ref.done}")
    return out


def check_kill_decode_mid_stream(router: Router, prefill: Engine, decodes: list[Engine],
                                 model: str, say: Callable[[str], None]) -> Engine:
    """Kill -9 the busiest decode while every stream is under way; returns the victim."""
    refs = references(prefill, model)
    say(f"ok: {len(refs)} reference streams of {MAX_TOKENS} tokens from one instance")
    before = migrations(router)
    runs = [Run(case) for case in CASES]

    def reader(run: Run) -> Callable[[], None]:
        def call() -> None:
            try:
                post_stream(f"{router.url}{run.case.path}", run.case.body(model),
                            STREAM_TIMEOUT_S, headers=router.headers, into=run.streamed)
            except Exception as exc:  # reported below
                run.error = exc
        return call

    for run, thread in zip(runs, in_threads([reader(run) for run in runs]), strict=True):
        run.thread = thread

    def time_to_kill() -> bool:
        """Every stream under way, or one of them half done: on a loaded machine streams
        start unevenly, and waiting for the last could let the first ones finish."""
        for run in runs:
            if run.error is not None:
                raise AssertionError(f"{run.case.name} failed before the kill: {run.error!r}")
        chunks = [run.content_chunks() for run in runs]
        return min(chunks) >= TOKENS_BEFORE_KILL or max(chunks) >= MAX_TOKENS // 2

    wait_logged(f"every stream has delivered {TOKENS_BEFORE_KILL} chunks (or one is half "
                f"done)", time_to_kill, START_TIMEOUT_S,
                lambda: str([run.content_chunks() for run in runs]))
    # Which decode holds which stream, by the router's own account (vLLM's gauges lag).
    open_on = in_flight(router)
    held = {decode.name: int(open_on.get(decode.member_id, 0)) for decode in decodes}
    victim = max(decodes, key=lambda d: held[d.name])
    victim.proc.kill_all()
    seen = [run.content_chunks() for run in runs]
    say(f"killed {victim.name} (sidecar and vLLM, SIGKILL) holding {held[victim.name]} of "
        f"{len(runs)} streams (streams open per decode: {held}); chunks seen by then: "
        f"{seen}")
    assert held[victim.name] >= 1, (
        f"no decode held a stream at the kill (the router had {open_on} open): the streams "
        f"were too short to test migration (MAX_TOKENS)")

    for run in runs:
        assert run.thread is not None
        run.thread.join(STREAM_TIMEOUT_S)
        assert not run.thread.is_alive(), f"{run.case.name}: stream still open after " \
                                          f"{STREAM_TIMEOUT_S:.0f}s"
    failures = [f"{run.case.name}: {run.error!r}" for run in runs if run.error is not None]
    assert not failures, "client-visible failures after the kill: " + "; ".join(failures)
    for run in runs:
        check_same(run, refs[run.case.name])
        say(f"ok: {run.case.name} = single instance ({len(refs[run.case.name].token_ids)} "
            f"tokens, usage {run.streamed.usage})")

    after = migrations(router)
    grew = {reason: after.get(reason, 0.0) - before.get(reason, 0.0) for reason in after}
    total = sum(grew.values())
    # At least one: a stream the victim held may have ended between the count and the kill.
    assert total >= 1, (f"{MIGRATIONS_METRIC} grew by {grew}; the killed decode held "
                        f"{held[victim.name]} streams, so some must have migrated")
    say(f"ok: router migrated {total:.0f} streams of the {held[victim.name]} the killed "
        f"decode held (by reason: {grew})")
    return victim


def check_same(run: Run, ref: Streamed) -> None:
    name, got = run.case.name, run.streamed
    assert got.done, f"{name}: the stream did not end with [DONE]"
    errors = [chunk for chunk in got.chunks if "error" in chunk]
    assert not errors, f"{name}: error events in the stream: {errors}"
    if run.case.token_ids:
        assert got.token_ids == ref.token_ids, (
            f"{name}: token ids differ from one instance's\n  routed:    {got.token_ids}\n"
            f"  reference: {ref.token_ids}")
    assert got.text == ref.text, (
        f"{name}: text differs from one instance's\n  routed:    {got.text!r}\n"
        f"  reference: {ref.text!r}")
    assert len(got.ids) == 1, f"{name}: more than one response id: {got.ids}"
    assert got.finish_reason == ref.finish_reason, (name, got.finish_reason, ref.finish_reason)
    usage, ref_usage = got.usage, ref.usage
    assert usage is not None and ref_usage is not None, f"{name}: no usage chunk"
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage.get(key) == ref_usage.get(key), (
            f"{name}: usage {usage} differs from one instance's {ref_usage}")
