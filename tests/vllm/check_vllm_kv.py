"""Real-engine check of KV-aware pairing: two vLLM prefills with prefix caching and KV
events on, one decode, each under `pdreg agent`, behind `pdreg router --policy kv`. Run
by `make test-vllm` after check_vllm_sidecar.py (setup.sh first).

    .venv/bin/python tests/vllm/check_vllm_kv.py [--vllm-venv V] [--model-dir M]

With PDREG_KV_CAPTURE=FILE it also writes the frames vLLM's replay socket answered (and
FILE.ids.json, the prompt's token ids): tests/data/ keeps one such capture, which
tests/test_kv_events.py decodes.

Asserts, in this order:
1. every member READY; the prefills' registration carries the KV events endpoints the
   sidecar read from vLLM's own --kv-events-config (advertised, not `*`);
2. the router subscribes to both prefills (index live);
3. the router tokenizes a completion exactly as vLLM does (vLLM's prompt_token_ids);
4. after one request, the router's index holds the blocks vLLM stored: replayed from
   the holder's own replay socket, their content keys equal the router's keys of the
   prompt's full blocks (128 tokens each on CPU);
5. a second request sharing that long prefix goes to the prefill holding it: vLLM's own
   `vllm:prefix_cache_hits_total` grows there by the shared blocks, not on the other, and
   the router's predicted-cached counter says the same;
6. a request with `cache_salt` and the same prefix hits nothing in vLLM and is predicted
   to hit nothing; a second one with that salt hits its salted blocks, exactly as many
   tokens as the router predicts;
7. the second request's output is token-identical to a single instance (the other
   prefill, asked directly).
Every process it starts is killed at the end, pass or fail; on failure it names the step
and prints the logs' tails.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
from cluster import (
    MODEL_NAME,
    SIDECAR_EXIT_TIMEOUT_S,
    Engine,
    Proc,
    Registry,
    Router,
    Steps,
    run_check,
    say,
    wait_logged,
)

from engine_agent.reference.kv_blocks import ROOT_KEY, block_keys, chain_key
from pdreg.testing import free_low_port
from router.kv.tokenizer import load_tokenizer
from wire.kv_events import REPLAY_END, BlockStored, decode_batch

STARTUP_TIMEOUT_S = 360.0
STEP_TIMEOUT_S = 60.0
HEARTBEAT_INTERVAL_S = 0.5
LEASE_S = 5.0
CPU_BLOCK = 128  # vLLM's CPU backend caches 128-token blocks
TOPIC = "kv"
SHARED = ("The registry keeps every member of the fleet in one table, and each router "
          "keeps a view of it that follows the events. ") * 5  # 2 blocks of 128 (512 max)


class KvCluster:
    def __init__(self, workdir: Path) -> None:
        def proc(name: str) -> Proc:
            return Proc(name, workdir / f"{name}.log", uuid.uuid4().hex)

        self.registry = Registry(free_low_port(), free_low_port(), free_low_port(),
                                 proc("registry"))
        self.prefills = [Engine(n, "prefill", free_low_port(), free_low_port(), "nobind",
                                proc(n)) for n in ("prefill-1", "prefill-2")]
        self.decode = Engine("decode", "decode", free_low_port(), free_low_port(), "nobind",
                             proc("decode"))
        self.router = Router(free_low_port(), proc("router"))
        self.kv_ports = {e.name: (free_low_port(), free_low_port()) for e in self.prefills}
        self._stopped = False

    @property
    def engines(self) -> list[Engine]:
        return [*self.prefills, self.decode]

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.router.proc.stop()
        for engine in self.engines:
            engine.proc.stop(SIDECAR_EXIT_TIMEOUT_S)
        self.registry.proc.stop()


def kv_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                       "topic": TOPIC})


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def vllm_hits(engine: Engine) -> float:
    return metric(httpx.get(engine.url + "/metrics", timeout=10).text,
                  "vllm:prefix_cache_hits_total")


def kv_status(router: Router) -> dict[str, dict[str, Any]]:
    try:
        body = httpx.get(router.url + "/v1/kv", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {m["id"]: m for m in body["members"]}


def replayed_keys(replay_endpoint: str, capture: Path | None = None) -> list[int]:
    """Every block the engine says it stored, as content keys (parents followed).
    `capture`: also write the replayed frames there (msgpack list of [seq, payload])."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(replay_endpoint)
    keys: dict[int | bytes, int] = {}
    order: list[int] = []
    captured: list[list[bytes]] = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = dealer.recv_multipart()
            if frames[-2] == REPLAY_END:
                break
            captured.append(frames)
            for event in decode_batch(frames[-1]).events:
                if not isinstance(event, BlockStored):
                    continue
                parent = ROOT_KEY if event.parent_block_hash is None else \
                    keys[event.parent_block_hash]
                size = event.block_size
                for i, h in enumerate(event.block_hashes):
                    parent = keys[h] = chain_key(parent, event.token_ids[i * size:(i + 1) * size])
                    order.append(parent)
    finally:
        dealer.close(0)
        ctx.term()
    if capture is not None:
        capture.write_bytes(msgspec.msgpack.encode(captured))
        say(f"captured {len(captured)} replayed batches (all frames) in {capture}")
    return order


def completion(url: str, prompt: str, **extra: str) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, f"{url}: {reply.status_code} {reply.text[:300]}"
    return reply.json()["choices"][0]


def check(steps: Steps, cluster: KvCluster, vllm_venv: Path, model_dir: Path) -> None:
    steps.begin("start registry, two prefills with prefix caching and KV events, a decode")
    registry = cluster.registry
    registry.start(HEARTBEAT_INTERVAL_S, LEASE_S, [])
    wait_logged("registry answers", registry.answers, STEP_TIMEOUT_S)
    for engine in cluster.prefills:
        pub, replay = cluster.kv_ports[engine.name]
        engine.start(registry.address, vllm_venv, model_dir, [],
                     ("--enable-prefix-caching", "--kv-events-config", kv_config(pub, replay)))
    cluster.decode.start(registry.address, vllm_venv, model_dir, [])

    def all_ready() -> bool:
        for engine in cluster.engines:
            engine.proc.assert_alive()
        view = registry.members()
        return all(view.get(e.member_id, {}).get("state") == "ready" for e in cluster.engines)

    wait_logged("all three members READY", all_ready, STARTUP_TIMEOUT_S)

    steps.begin("registration carries the KV events endpoints from vLLM's command line")
    view = registry.members()
    for engine in cluster.prefills:
        pub, replay = cluster.kv_ports[engine.name]
        kv = view[engine.member_id]["kv_events"]
        assert kv and kv["endpoint"] == f"tcp://127.0.0.1:{pub}", view[engine.member_id]
        assert kv["replay_endpoint"] == f"tcp://127.0.0.1:{replay}" and kv["topic"] == TOPIC
        assert kv["tokenizer"] == str(model_dir), kv
        say(f"ok: {engine.name} advertises {kv}")

    steps.begin("pdreg router --policy kv subscribes to both prefills")
    router = cluster.router
    router.start(registry.address, 3, ["--policy", "kv", "--no-register"])
    wait_logged("router lists the model", lambda: router.lists(MODEL_NAME), STEP_TIMEOUT_S)
    wait_logged("both prefills indexed and live", lambda: [
        m["state"] for m in kv_status(router).values()] == ["live", "live"], STEP_TIMEOUT_S,
        lambda: json.dumps(kv_status(router)))

    steps.begin("the router tokenizes as vLLM does; its index holds the blocks vLLM stored")
    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer is not None
    first_prompt = SHARED + "First question: what does the registry keep?"
    first = completion(router.url, first_prompt)
    ids = tokenizer.completion_ids(first_prompt)
    assert first["prompt_token_ids"] == ids, "router tokenization differs from vLLM's"
    full_blocks = len(ids) // CPU_BLOCK
    assert 2 <= full_blocks <= 3, f"{len(ids)} tokens: adjust SHARED for 2-3 blocks"
    wait_logged(f"a prefill indexed with {full_blocks} blocks", lambda: any(
        m["blocks"] >= full_blocks for m in kv_status(router).values()), STEP_TIMEOUT_S,
        lambda: json.dumps(kv_status(router)))
    status = kv_status(router)
    holder = next(e for e in cluster.prefills if status[e.member_id]["blocks"] >= full_blocks)
    other = next(e for e in cluster.prefills if e is not holder)
    capture = Path(os.environ["PDREG_KV_CAPTURE"]) if os.environ.get("PDREG_KV_CAPTURE") \
        else None
    stored = replayed_keys(f"tcp://127.0.0.1:{cluster.kv_ports[holder.name][1]}", capture)
    if capture is not None:
        capture.with_suffix(".ids.json").write_text(json.dumps(ids))
    predicted = block_keys(ids, CPU_BLOCK)
    assert stored == predicted, (f"vLLM stored {len(stored)} blocks, the router predicts "
                                 f"{len(predicted)}; keys differ: {stored} vs {predicted}")
    say(f"ok: {holder.name} stored exactly the {len(predicted)} blocks the router predicts")

    steps.begin("a second request sharing the prefix goes to its holder; vLLM counts the hit")
    hits_before = {e.name: vllm_hits(e) for e in cluster.prefills}
    cached_before = metric(router.metrics(), "pdreg_router_prompt_tokens_cached_total")
    second_prompt = SHARED + "Second question: and the routers?"
    second = completion(router.url, second_prompt)
    shared_blocks = len(block_keys(tokenizer.completion_ids(SHARED), CPU_BLOCK))
    gained = {e.name: vllm_hits(e) - hits_before[e.name] for e in cluster.prefills}
    assert gained[holder.name] >= shared_blocks * CPU_BLOCK and gained[other.name] == 0, (
        f"vLLM prefix-cache hits gained: {gained}; expected {shared_blocks * CPU_BLOCK}+ on "
        f"{holder.name}")
    cached = metric(router.metrics(), "pdreg_router_prompt_tokens_cached_total") - cached_before
    assert cached == shared_blocks * CPU_BLOCK, f"router predicted {cached} cached tokens"
    say(f"ok: {holder.name} hit {gained[holder.name]:.0f} tokens (vLLM's counter); the "
        f"router predicted {cached:.0f}")

    steps.begin("a salted request: the same tokens hit nothing, its own salt hits exactly")

    def salted(question: str) -> tuple[dict[str, float], float]:
        """(vLLM's hits gained per prefill, the router's predicted cached tokens) for one
        request with SHARED under the salt."""
        before = {e.name: vllm_hits(e) for e in cluster.prefills}
        predicted_before = metric(router.metrics(), "pdreg_router_prompt_tokens_cached_total")
        completion(router.url, SHARED + question, cache_salt="tenant-a")
        return ({e.name: vllm_hits(e) - before[e.name] for e in cluster.prefills},
                metric(router.metrics(), "pdreg_router_prompt_tokens_cached_total")
                - predicted_before)

    def indexed() -> int:
        return sum(m["blocks"] for m in kv_status(router).values())

    blocks_before = indexed()
    gained, cached = salted("Third question: and the planner?")
    assert not any(gained.values()) and cached == 0, (gained, cached)
    say("ok: a salted request with the indexed prefix: vLLM hit nothing, the router "
        "predicted nothing")
    wait_logged("the salted blocks indexed", lambda: indexed() >= blocks_before
                + shared_blocks, STEP_TIMEOUT_S, lambda: json.dumps(kv_status(router)))
    gained, cached = salted("Fourth question: and the sidecar?")
    assert sum(gained.values()) >= shared_blocks * CPU_BLOCK, gained
    assert cached == sum(gained.values()), f"router predicted {cached}, vLLM hit {gained}"
    say(f"ok: the same salt again: vLLM hit {sum(gained.values()):.0f} tokens, the router "
        f"predicted {cached:.0f}")

    steps.begin("output token-identical to a single instance")
    single = completion(other.url, second_prompt)
    assert second["token_ids"] == single["token_ids"], (second, single)
    say(f"ok: {len(single['token_ids'])} tokens identical")


def main() -> int:
    return run_check(__doc__.splitlines()[0], "pdreg-vllm-kv-", KvCluster, check)


if __name__ == "__main__":
    sys.exit(main())
