"""Write a LoRA adapter for the tiny model (tests/vllm/make_tiny_model.py), offline.

Run with the vLLM virtualenv's python (it has torch and safetensors):
    .venv-vllm/bin/python tests/vllm/make_tiny_lora.py MODEL_DIR OUT_DIR

No adapter weights exist for a model built here, so this writes what PEFT would save for
one: adapter_config.json and adapter_model.safetensors, rank 8 on every layer's q_proj
and v_proj, seeded random weights (lora_B too, so the adapter changes the output, which
lets the check see that vLLM applies it). The weights mean nothing; the block keys of
its requests are what make test-vllm checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
WEIGHT_STD = 0.5  # large enough that greedy tokens change under the adapter


def main(model_dir: str, out_dir: str) -> None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    outputs = {"q_proj": config["num_attention_heads"] * config["head_dim"],
               "v_proj": config["num_key_value_heads"] * config["head_dim"]}
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            weights[f"{prefix}.lora_A.weight"] = WEIGHT_STD * torch.randn(
                RANK, hidden, generator=generator)
            weights[f"{prefix}.lora_B.weight"] = WEIGHT_STD * torch.randn(
                outputs[target], RANK, generator=generator)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
        "base_model_name_or_path": str(Path(model_dir).resolve())}, indent=1))
    print(f"[test-vllm] tiny LoRA adapter: rank {RANK} on {', '.join(TARGETS)} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
