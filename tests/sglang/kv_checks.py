"""KV-aware pairing against real SGLang, for `make test-sglang` (check_sglang.py).

The two prefills run with `--kv-events-config` (SGLang's radix cache is on by default; on
CPU its page is 1 token, so every prompt token is a block: docs/engines.md §9). A second
`pdreg router --policy kv` (unregistered) runs beside the round-robin one. Checked:

1. each prefill registers the events endpoints the sidecar read from SGLang's own flags,
   and the block size SGLang reports in /server_info's `kv_events`;
2. the router subscribes to both (index live) and tokenizes as SGLang does;
3. after one long request, the router's index holds exactly the blocks SGLang stored:
   the holder's own replay socket, from seq 0, gives the engine's whole cache (stores
   less removals, as content keys); it holds every block of the prompt, and the router
   indexes as many blocks as it does;
4. a second request sharing a long prefix goes to that holder; SGLang's own
   `sglang:cached_tokens_total` grows there by exactly the shared tokens, not at all on
   the other prefill, and the router's predicted-cached counter says the same;
5. both answers are token-identical to a single plain SGLang server.
After a prefill is killed and starts again, `relearned` checks that the router follows
its new incarnation (index live again).

With PDREG_KV_CAPTURE=FILE it writes the holder's replayed frames there and the two
prompts' token ids to FILE.ids.json: tests/data/ keeps one such capture, which
tests/test_kv_events.py decodes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import msgspec
import sglang_cases as cases
import zmq
from harness import Engine, Proc, say, wait_logged

from engine_agent.reference.kv_blocks import ROOT_KEY, block_keys, chain_key
from router.kv.tokenizer import load_tokenizer
from wire.kv_events import REPLAY_END, BlockRemoved, BlockStored, decode_batch
from wire.protocol import KvEventsSpec

TOPIC = "kv"
SGLANG_CPU_BLOCK = 1  # SGLang's page size on CPU: /server_info kv_events.block_size
CACHED_TOKENS = "sglang:cached_tokens_total"
SHARED = ("The registry keeps every member of the fleet in one table, and each router "
          "keeps a view of it that follows the events. ") * 5  # ~270 tokens
PROMPTS = (SHARED + "First question: what does the registry keep?",
           SHARED + "Second question: and the routers?")
MAX_TOKENS = 8


def kv_flags(pub: int, replay: int) -> tuple[str, ...]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": TOPIC}
    return ("--kv-events-config", json.dumps(config))


def completion(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=cases.REQUEST_TIMEOUT_S)
    assert reply.status_code == 200, f"{url}: {reply.status_code} {reply.text[:300]}"
    choice: dict[str, Any] = reply.json()["choices"][0]
    return choice


def references(plain_url: str) -> list[dict[str, Any]]:
    """The plain server's answers to PROMPTS (token ids and prompt token ids)."""
    return [completion(plain_url, prompt) for prompt in PROMPTS]


def kv_status(router_url: str) -> dict[str, dict[str, Any]]:
    try:
        body = httpx.get(router_url + "/v1/kv", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {m["id"]: m for m in body["members"]}


def cached_tokens(engine: Engine) -> float:
    samples = cases.metric_samples(engine.url, [CACHED_TOKENS]).get(CACHED_TOKENS, [])
    return sum(value for labels, value in samples if labels.get("cache_source") == "device")


def router_metric(router_url: str, name: str) -> float:
    return sum(value for _, value in cases.metric_samples(router_url, [name]).get(name, []))


def replay(endpoint: str) -> list[list[bytes]]:
    """Every batch the engine's replay socket still holds, from seq 0, as frames."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(endpoint)
    frames: list[list[bytes]] = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            got = dealer.recv_multipart()
            if got[-2] == REPLAY_END:
                return frames
            frames.append(got)
    finally:
        dealer.close(0)
        ctx.term()


def engine_blocks(frames: list[list[bytes]]) -> set[int]:
    """The content keys of the blocks the engine holds after these batches (stores less
    removals; a clear empties it), parents followed through the engine's hashes."""
    keys: dict[int | bytes, int] = {}
    for frame in frames:
        for event in decode_batch(frame[-1]).events:
            if isinstance(event, BlockStored):
                parent = ROOT_KEY if event.parent_block_hash is None else \
                    keys[event.parent_block_hash]
                size = event.block_size
                assert size == SGLANG_CPU_BLOCK, f"SGLang stored {size}-token blocks"
                for i, block_hash in enumerate(event.block_hashes):
                    parent = keys[block_hash] = chain_key(
                        parent, event.token_ids[i * size:(i + 1) * size])
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    keys.pop(block_hash, None)
            else:
                keys.clear()
    return set(keys.values())


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_registration(engine: Engine, spec: KvEventsSpec | None, ports: tuple[int, int],
                       model_dir: Path) -> None:
    pub, replay_port = ports
    assert spec is not None, f"{engine.name} registered no kv_events"
    assert spec.endpoint == f"tcp://127.0.0.1:{pub}", spec
    assert spec.replay_endpoint == f"tcp://127.0.0.1:{replay_port}", spec
    assert spec.topic == TOPIC and spec.tokenizer == str(model_dir), spec
    assert spec.block_size == SGLANG_CPU_BLOCK, (
        f"{engine.name} registered block size {spec.block_size}; SGLang's /server_info "
        f"says {SGLANG_CPU_BLOCK}")
    say(f"ok: {engine.name} advertises {spec}")


def check_kv(prefills: tuple[Engine, Engine], kv_router: Proc, router_url: str,
             kv_ports: dict[str, tuple[int, int]], model_dir: Path,
             reference: list[dict[str, Any]], timeout_s: float) -> None:
    """Steps 2-5 of the module docstring (registration is checked by the caller)."""
    kv_router.assert_alive()
    wait_logged("the kv router indexes both prefills, live", lambda: [
        kv_status(router_url).get(p.member_id, {}).get("state") for p in prefills]
        == ["live", "live"], timeout_s, lambda: json.dumps(kv_status(router_url)))

    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer is not None, f"no tokenizer in {model_dir}"
    ids = [tokenizer.completion_ids(prompt) for prompt in PROMPTS]
    for mine, theirs in zip(ids, reference, strict=True):
        assert mine == theirs["prompt_token_ids"], "router tokenization differs from SGLang's"
    shared = common_prefix(ids[0], ids[1])
    assert shared >= 200 and len(ids[1]) > shared, f"{shared} shared tokens of {len(ids[1])}"
    say(f"ok: the router tokenizes as SGLang: {len(ids[0])} and {len(ids[1])} tokens, "
        f"{shared} shared")

    first = completion(router_url, PROMPTS[0])
    assert first["token_ids"] == reference[0]["token_ids"], (first, reference[0])
    predicted = block_keys(ids[0], SGLANG_CPU_BLOCK)
    held: dict[str, set[int]] = {}

    def indexed() -> bool:
        """A prefill holds every block of the prompt (its replay says) and the router
        indexes exactly as many blocks as that prefill holds."""
        status = kv_status(router_url)
        for p in prefills:
            held[p.name] = engine_blocks(replay(f"tcp://127.0.0.1:{kv_ports[p.name][1]}"))
        return any(held[p.name].issuperset(predicted)
                   and status.get(p.member_id, {}).get("blocks") == len(held[p.name])
                   for p in prefills)

    wait_logged(f"a prefill stored the prompt's {len(predicted)} blocks and the router "
                "indexed them", indexed, timeout_s, lambda: json.dumps(
                    {**kv_status(router_url), "engine": {k: len(v) for k, v in held.items()}}))
    holder = next(p for p in prefills if held[p.name].issuperset(predicted))
    other = prefills[1] if holder is prefills[0] else prefills[0]
    assert predicted[-1] not in held[other.name], "both prefills hold the prompt"
    say(f"ok: {holder.name} stored all {len(predicted)} blocks the router predicts "
        f"({len(held[holder.name])} in its cache, as many in the router's index)")

    hits_before = {p.name: cached_tokens(p) for p in prefills}
    picks_before = cases.RouterCounts.read(router_url)
    cached_before = router_metric(router_url, "pdreg_router_prompt_tokens_cached_total")
    second = completion(router_url, PROMPTS[1])
    picked = cases.RouterCounts.read(router_url).picked(picks_before, "prefill")
    assert picked == {holder.member_id: 1.0}, f"the kv router picked {picked}"
    gained: dict[str, float] = {}

    def counted() -> bool:
        gained.update({p.name: cached_tokens(p) - hits_before[p.name] for p in prefills})
        return gained[holder.name] >= shared

    wait_logged(f"{holder.name} counts {shared} cached tokens ({CACHED_TOKENS})", counted,
                timeout_s, lambda: str(gained))
    assert gained == {holder.name: shared, other.name: 0}, (
        f"SGLang's cached tokens gained {gained}; expected {shared} on {holder.name} only")
    cached = router_metric(router_url, "pdreg_router_prompt_tokens_cached_total") \
        - cached_before
    assert cached == shared, f"the router predicted {cached} cached tokens, SGLang hit {shared}"
    say(f"ok: the second request went to {holder.name}, which hit {shared} tokens "
        f"(SGLang's counter); the router predicted {cached:.0f}")

    assert second["token_ids"] == reference[1]["token_ids"], (second, reference[1])
    say(f"ok: both answers token-identical to the plain server ({MAX_TOKENS} tokens each)")

    capture = os.environ.get("PDREG_KV_CAPTURE")
    if capture:
        frames = replay(f"tcp://127.0.0.1:{kv_ports[holder.name][1]}")
        Path(capture).write_bytes(msgspec.msgpack.encode(frames))
        Path(capture).with_suffix(".ids.json").write_text(json.dumps(ids))
        say(f"captured {len(frames)} replayed batches of {holder.name} in {capture}")


def relearned(router_url: str, engine: Engine, incarnation_before: int,
              timeout_s: float) -> None:
    """The kv router follows a restarted prefill: a new incarnation, indexed live."""
    def fresh() -> bool:
        m = kv_status(router_url).get(engine.member_id, {})
        return m.get("state") == "live" and m.get("incarnation") != incarnation_before

    wait_logged(f"the kv router indexes the restarted {engine.name} (new incarnation, live)",
                fresh, timeout_s, lambda: json.dumps(kv_status(router_url)))
