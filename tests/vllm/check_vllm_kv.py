"""Real-engine check of KV-aware pairing: two vLLM prefills and one decode, each with
prefix caching, KV events and a LoRA adapter, under `pdreg agent`, behind `pdreg router
--policy kv`. Run by `make test-vllm` after check_vllm_sidecar.py (setup.sh first).

    .venv/bin/python tests/vllm/check_vllm_kv.py [--vllm-venv V] [--model-dir M]

With PDREG_KV_CAPTURE=FILE it also writes the frames vLLM's replay socket answered (and
FILE.ids.json, the prompt's token ids): tests/data/ keeps one such capture, which
tests/test_kv_events.py decodes.

Asserts, in this order:
1. every member READY; each one's registration (the decode's too) carries the KV events
   endpoints the sidecar read from vLLM's own --kv-events-config (advertised, not `*`);
2. the router (conditional disaggregation off) subscribes to both prefills (index live);
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
   prefill, asked directly);
8. a LoRA adapter's requests are keyed as vLLM keys them (lora_checks.py): over a prefix
   cached for the base model they hit nothing and are predicted to hit nothing, then hit
   exactly what the router predicts;
9. with conditional disaggregation on (a second router), a chat's second turn is served
   by the decode alone, which hits the conversation it pulled for the first turn,
   exactly as the router predicts (decode_local_checks.py).
Every process it starts is killed at the end, pass or fail; on failure it names the step
and prints the logs' tails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import decode_local_checks  # tests/vllm/, beside this script
import lora_checks
import msgspec
import zmq
from cluster import (
    HERE,
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
from kv_probes import (
    CPU_BLOCK,
    completion,
    indexed_blocks,
    kv_status,
    routed_hits,
)

from engine_agent.reference.kv_blocks import ROOT_KEY, block_keys, chain_key
from pdreg.testing import LowPorts
from router.kv.tokenizer import load_tokenizer
from wire.kv_events import REPLAY_END, BlockStored, decode_batch

STARTUP_TIMEOUT_S = 360.0
STEP_TIMEOUT_S = 60.0
HEARTBEAT_INTERVAL_S = 0.5
LEASE_S = 5.0
TOPIC = "kv"
SHARED = ("The registry keeps every member of the fleet in one table, and each router "
          "keeps a view of it that follows the events. ") * 5  # 2 blocks of 128 (512 max)


class KvCluster:
    def __init__(self, workdir: Path) -> None:
        def proc(name: str) -> Proc:
            return Proc(name, workdir / f"{name}.log", uuid.uuid4().hex)

        port = LowPorts()  # distinct: a KV replay port once equalled an engine's HTTP port
        self.registry = Registry(port(), port(), port(),
                                 proc("registry"))
        self.prefills = [Engine(n, "prefill", port(), port(), "nobind",
                                proc(n)) for n in ("prefill-1", "prefill-2")]
        self.decode = Engine("decode", "decode", port(), port(), "nobind",
                             proc("decode"))
        self.router = Router(port(), proc("router"))
        # Conditional disaggregation's router (decode_local_checks.py), started last.
        self.chat_router = Router(port(), proc("router-chat"))
        self.kv_ports = {e.name: (port(), port()) for e in self.engines}
        self.workdir = workdir
        self.tokenizer_dir = workdir / "chat-tokenizer"
        self._stopped = False

    @property
    def engines(self) -> list[Engine]:
        return [*self.prefills, self.decode]

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.router.proc.stop()
        self.chat_router.proc.stop()
        for engine in self.engines:
            engine.proc.stop(SIDECAR_EXIT_TIMEOUT_S)
        self.registry.proc.stop()


def kv_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                       "topic": TOPIC})


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


def start_cluster(steps: Steps, cluster: KvCluster, vllm_venv: Path, model_dir: Path) -> None:
    """Registry; three engines with prefix caching, KV events and the LoRA adapter; the
    router. The router runs without conditional disaggregation: its checks are the
    prefills' choice, and the decode, which keeps what it pulls, would otherwise serve a
    request sharing SHARED alone (decode_local_checks.py runs a router with it on)."""
    steps.begin("start registry, two prefills and a decode, each with prefix caching, KV "
                "events and a LoRA adapter")
    registry = cluster.registry
    registry.start(HEARTBEAT_INTERVAL_S, LEASE_S, [])
    wait_logged("registry answers", registry.answers, STEP_TIMEOUT_S)
    adapter_dir = cluster.workdir / "lora"
    subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "make_tiny_lora.py"),
                    str(model_dir), str(adapter_dir)], check=True, timeout=STEP_TIMEOUT_S)
    for engine in cluster.engines:
        pub, replay = cluster.kv_ports[engine.name]
        engine.start(registry.address, vllm_venv, model_dir, [],
                     ("--enable-prefix-caching", "--kv-events-config", kv_config(pub, replay),
                      *lora_checks.lora_flags(adapter_dir)))

    def all_ready() -> bool:
        for engine in cluster.engines:
            engine.proc.assert_alive()
        view = registry.members()
        return all(view.get(e.member_id, {}).get("state") == "ready" for e in cluster.engines)

    wait_logged("all three members READY", all_ready, STARTUP_TIMEOUT_S)

    steps.begin("registration carries the KV events endpoints from vLLM's command line")
    view = registry.members()
    for engine in cluster.engines:
        pub, replay = cluster.kv_ports[engine.name]
        kv = view[engine.member_id]["kv_events"]
        assert kv and kv["endpoint"] == f"tcp://127.0.0.1:{pub}", view[engine.member_id]
        assert kv["replay_endpoint"] == f"tcp://127.0.0.1:{replay}" and kv["topic"] == TOPIC
        assert kv["tokenizer"] == str(model_dir), kv
        say(f"ok: {engine.name} advertises {kv}")

    steps.begin("pdreg router --policy kv subscribes to both prefills")
    router = cluster.router
    # vLLM renders chats with --chat-template, which a router cannot read from it: the
    # same template goes to the routers in a tokenizer folder (decode_local_checks.py).
    tokenizer_dir = decode_local_checks.chat_tokenizer_dir(model_dir, cluster.tokenizer_dir)
    router.start(registry.address, 3, ["--policy", "kv", "--no-register",
                                       "--disagg-min-uncached-tokens", "0",
                                       "--tokenizer", f"{MODEL_NAME}={tokenizer_dir}"])
    wait_logged("router lists the model", lambda: router.lists(MODEL_NAME), STEP_TIMEOUT_S)
    wait_logged("both prefills indexed and live", lambda: [
        m["state"] for m in kv_status(router).values()] == ["live", "live"], STEP_TIMEOUT_S,
        lambda: json.dumps(kv_status(router)))


def check(steps: Steps, cluster: KvCluster, vllm_venv: Path, model_dir: Path) -> None:
    start_cluster(steps, cluster, vllm_venv, model_dir)
    router = cluster.router
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
    second_prompt = SHARED + "Second question: and the routers?"
    gained, cached, second = routed_hits(router, cluster.prefills, second_prompt)
    shared_blocks = len(block_keys(tokenizer.completion_ids(SHARED), CPU_BLOCK))
    assert gained[holder.name] >= shared_blocks * CPU_BLOCK and gained[other.name] == 0, (
        f"vLLM prefix-cache hits gained: {gained}; expected {shared_blocks * CPU_BLOCK}+ on "
        f"{holder.name}")
    assert cached == shared_blocks * CPU_BLOCK, f"router predicted {cached} cached tokens"
    say(f"ok: {holder.name} hit {gained[holder.name]:.0f} tokens (vLLM's counter); the "
        f"router predicted {cached:.0f}")

    steps.begin("a salted request: the same tokens hit nothing, its own salt hits exactly")
    blocks_before = indexed_blocks(router)
    gained, cached, _ = routed_hits(router, cluster.prefills,
                                    SHARED + "Third question: and the planner?",
                                    cache_salt="tenant-a")
    assert not any(gained.values()) and cached == 0, (gained, cached)
    say("ok: a salted request with the indexed prefix: vLLM hit nothing, the router "
        "predicted nothing")
    wait_logged("the salted blocks indexed", lambda: indexed_blocks(router) >= blocks_before
                + shared_blocks, STEP_TIMEOUT_S, lambda: json.dumps(kv_status(router)))
    gained, cached, _ = routed_hits(router, cluster.prefills,
                                    SHARED + "Fourth question: and the sidecar?",
                                    cache_salt="tenant-a")
    assert sum(gained.values()) >= shared_blocks * CPU_BLOCK, gained
    assert cached == sum(gained.values()), f"router predicted {cached}, vLLM hit {gained}"
    say(f"ok: the same salt again: vLLM hit {sum(gained.values()):.0f} tokens, the router "
        f"predicted {cached:.0f}")

    steps.begin("output token-identical to a single instance")
    single = completion(other.url, second_prompt)
    assert second["token_ids"] == single["token_ids"], (second, single)
    say(f"ok: {len(single['token_ids'])} tokens identical")

    # Both prefills now hold SHARED for the base model (the holder since the first
    # request, the other since the single-instance one).
    lora_checks.check_lora(steps, router, cluster.prefills, SHARED, shared_blocks)
    decode_local_checks.check_decode_local(steps, cluster.registry.address,
                                           cluster.prefills, cluster.decode,
                                           (router, cluster.chat_router),
                                           cluster.tokenizer_dir)


def main() -> int:
    return run_check(__doc__.splitlines()[0], "pdreg-vllm-kv-", KvCluster, check)


if __name__ == "__main__":
    sys.exit(main())
