"""Build a tiny random Llama and a byte-level BPE tokenizer offline, for vLLM on CPU.

Run with the vLLM virtualenv's python (it has transformers and tokenizers):
    .venv-vllm/bin/python tests/vllm/make_tiny_model.py OUT_DIR

head_dim is 64 because vLLM's CPU attention backend rejects small head sizes such as 16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on different workers in a disaggregated deployment.",
    "A registry keeps the live membership of every engine in the fleet.",
    "Heartbeats carry the load: running requests, waiting requests and cache usage.",
    "Hello world, this is a tiny model that speaks random tokens.",
]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_model(vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
        initializer_range=0.2, max_position_embeddings=512, torch_dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).to(torch.float32)


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), tokenizer)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    print(f"[setup] tiny model: vocab={len(tokenizer)} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
