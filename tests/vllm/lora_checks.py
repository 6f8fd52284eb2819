"""LoRA adapters' block keys on real vLLM.

Run by check_vllm_kv.py on its running cluster, whose engines serve a LoRA adapter made
for the tiny model (make_tiny_lora.py; vLLM's `--enable-lora --lora-modules NAME=PATH`),
after both prefills cached SHARED for the base model. vLLM hashes an adapter's blocks
with ("lora", name, path) in every block's extra keys (v1/core/kv_cache_utils.py
`_gen_lora_extra_hash_keys`) and publishes `lora_name` = the name, `lora_id` = its int
id and `extra_keys` = [name] per block (the untagged form, `to_event_extra_keys`);
router/kv/keys.py salts a request naming the adapter with exactly that. Asserts:
1. the engines register the adapter (`adapters`, from vLLM's /v1/models): the router
   lists it;
2. a request naming the adapter, whose prompt's prefix both prefills hold for the base
   model, hits nothing in vLLM and is predicted to hit nothing;
3. once its blocks are indexed, the same adapter with the same prefix hits, in vLLM,
   exactly the tokens the router predicts (the shared full blocks);
4. the routed (P/D) answer is token-identical to one instance serving the adapter, and
   differs from the base model's: vLLM applied the adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster import Engine, Router, Steps, say, wait_logged
from kv_probes import CPU_BLOCK, completion, indexed_blocks, kv_status, routed_hits

LORA_NAME = "tiny-lora"
STEP_TIMEOUT_S = 60.0


def lora_flags(adapter_dir: Path) -> tuple[str, ...]:
    """vLLM's flags serving the adapter (rank 8: make_tiny_lora.RANK)."""
    return ("--enable-lora", "--max-lora-rank", "8",
            "--lora-modules", f"{LORA_NAME}={adapter_dir}")


def check_lora(steps: Steps, router: Router, prefills: list[Engine], shared: str,
               shared_blocks: int) -> None:
    steps.begin("the engines register the LoRA adapter; the router lists it")
    wait_logged(f"router lists {LORA_NAME}", lambda: router.lists(LORA_NAME), STEP_TIMEOUT_S)

    steps.begin("the adapter over a prefix cached for the base model: nothing hits")
    blocks_before = indexed_blocks(router)
    gained, predicted, _ = routed_hits(router, prefills, shared + "Fifth question: and LoRA?",
                                       model=LORA_NAME)
    assert not any(gained.values()) and predicted == 0, (gained, predicted)
    say("ok: the adapter with the base model's cached prefix: vLLM hit nothing, the router "
        "predicted nothing")
    wait_logged("the adapter's blocks indexed", lambda: indexed_blocks(router)
                >= blocks_before + shared_blocks, STEP_TIMEOUT_S,
                lambda: json.dumps(kv_status(router)))

    steps.begin("the same adapter again hits exactly what the router predicts")
    prompt = shared + "Sixth question: and adapters?"
    gained, predicted, routed = routed_hits(router, prefills, prompt, model=LORA_NAME)
    assert sum(gained.values()) >= shared_blocks * CPU_BLOCK, gained
    assert predicted == sum(gained.values()), f"router predicted {predicted}, vLLM hit {gained}"
    say(f"ok: the adapter again: vLLM hit {sum(gained.values()):.0f} tokens, the router "
        f"predicted {predicted:.0f}")

    steps.begin("the adapter's routed answer equals one instance's, and not the base's")
    holder = next(e for e in prefills if gained[e.name])
    single = completion(holder.url, prompt, model=LORA_NAME)
    base = completion(holder.url, prompt)
    assert routed["token_ids"] == single["token_ids"], (routed, single)
    assert single["token_ids"] != base["token_ids"], "the adapter changed no token"
    say(f"ok: {len(single['token_ids'])} tokens identical; the base model answers otherwise")
