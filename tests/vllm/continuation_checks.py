"""Continuing a cut generation from token ids over P/D (NIXL), on the engines directly.

The facts request migration relies on (docs/engines.md: the table under "Real vLLM P/D",
and section 6), checked on every run with real vLLM, no router involved. A stream is
served whole by one instance (the prefill asked plainly); then, for several cuts k, a new
prefill + decode pair gets `prompt` = the prompt's ids + the ids of the chunks sent before
the cut, and `max_tokens` = N - k, as a `/v1/completions` request (also for chat: the chat's
`prompt_token_ids` are the rendered template). Asserted:
- the continuation's token ids are exactly the uninterrupted ids after the cut, at every
  cut;
- at a clean cut (after a chunk with text), the text sent before the cut + the
  continuation's text = the uninterrupted text. After a chunk with empty text (bytes of
  a character not yet complete) vLLM's detokenizer re-emits the whole prompt's text, so
  the router never cuts there: such a cut is tried for its ids only;
- the body's `request_id` "X" is the continuation's response id "cmpl-X";
- usage counts the resent ids as prompt: prompt = P + k, completion = N - k.
Cuts alternate between the decodes, so every decode pulls KV from the prefill.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from cluster import Engine
from sse import Streamed, choice_text, post_stream

from router.handshakes.vllm_nixl import NIXL_PREFILL_PARAMS

N = 24
REQUEST_TIMEOUT_S = 120.0
SAMPLING: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


@dataclass(frozen=True)
class Case:
    name: str
    chat: bool

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        prompt = f"continue {self.name}: the registry keeps the live membership"
        body: dict[str, Any] = {"model": model, "max_tokens": N, **SAMPLING}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


CASES = (Case("completion", chat=False), Case("chat", chat=True))


def pd_stream(prefill: Engine, decode: Engine, path: str, body: dict[str, Any]) -> Streamed:
    """One request through a P/D pair, as the router's vllm-nixl adapter drives it."""
    prefill_body = {**body, "max_tokens": 1, "stream": False,
                    "kv_transfer_params": NIXL_PREFILL_PARAMS}
    prefill_body.pop("stream_options", None)
    reply = httpx.post(f"{prefill.url}{path}", json=prefill_body, timeout=REQUEST_TIMEOUT_S)
    assert reply.status_code == 200, f"prefill answered {reply.status_code}: {reply.text}"
    params = reply.json().get("kv_transfer_params")
    assert isinstance(params, dict), f"prefill reply has no kv_transfer_params: {reply.text}"
    return post_stream(f"{decode.url}{path}", {**body, "kv_transfer_params": params,
                                               "stream_options": {"include_usage": True}},
                       REQUEST_TIMEOUT_S)


def chunk_pieces(reference: Streamed) -> list[tuple[str, list[int]]]:
    """(text, ids) of each chunk that carries ids, in order."""
    pieces = []
    for chunk in reference.chunks:
        for choice in chunk.get("choices", []):
            if choice.get("token_ids"):
                pieces.append((choice_text(choice), list(choice["token_ids"])))
    return pieces


@dataclass(frozen=True)
class Cut:
    sent_ids: list[int]
    sent_text: str
    clean: bool  # the last chunk sent had text: no character is half sent


def cuts(reference: Streamed) -> list[Cut]:
    """The first, middle and last clean cut, and the first cut after an empty-text chunk."""
    pieces = chunk_pieces(reference)
    every: list[Cut] = []
    for n in range(1, len(pieces)):
        sent = pieces[:n]
        every.append(Cut([i for _, ids in sent for i in ids], "".join(t for t, _ in sent),
                         clean=bool(sent[-1][0])))
    clean = [cut for cut in every if cut.clean]
    dirty = [cut for cut in every if not cut.clean]
    chosen = [clean[0], clean[len(clean) // 2], clean[-1]] if clean else []
    return [*_unique(chosen), *dirty[:1]]


def _unique(chosen: list[Cut]) -> list[Cut]:
    seen: set[int] = set()
    out = []
    for cut in chosen:
        if len(cut.sent_ids) not in seen:
            seen.add(len(cut.sent_ids))
            out.append(cut)
    return out


def check_continuations(prefill: Engine, decodes: list[Engine], model: str,
                        say: Callable[[str], None]) -> None:
    turn = 0
    for case in CASES:
        reference = post_stream(f"{prefill.url}{case.path}", case.body(model),
                                REQUEST_TIMEOUT_S)
        prompt_ids, whole = reference.prompt_token_ids, reference.token_ids
        assert len(whole) == N and prompt_ids, (case.name, reference.chunks[:2])
        for cut in cuts(reference):
            decode = decodes[turn % len(decodes)]
            turn += 1
            k = len(cut.sent_ids)
            request_id = f"continue-{case.name}-{k}-{uuid.uuid4().hex[:8]}"
            body = {"model": model, "prompt": prompt_ids + cut.sent_ids, "max_tokens": N - k,
                    "request_id": request_id, **SAMPLING}
            cont = pd_stream(prefill, decode, "/v1/completions", body)
            where = (f"{case.name} cut after {k} of {N} tokens "
                     f"({'clean' if cut.clean else 'mid-character'}), continued on "
                     f"{decode.name}")
            assert cont.token_ids == whole[k:], (
                f"{where}: ids differ\n  continued: {cont.token_ids}\n"
                f"  expected:  {whole[k:]}")
            text_exact = cut.sent_text + cont.text == reference.text
            assert text_exact or not cut.clean, (
                f"{where}: text differs: {cut.sent_text!r} + {cont.text!r} != "
                f"{reference.text!r}")
            assert cont.ids == {f"cmpl-{request_id}"}, f"{where}: response ids {cont.ids}"
            usage = cont.usage or {}
            assert (usage.get("prompt_tokens"), usage.get("completion_tokens")) == (
                len(prompt_ids) + k, N - k), f"{where}: usage {usage}"
            say(f"ok: {where}: ids exact, text {'exact' if text_exact else 'NOT exact'}"
                f"{'' if cut.clean else ' (not required: the router does not cut here)'}, "
                f"id cmpl-{request_id}")
