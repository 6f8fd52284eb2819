"""A tiny decoder-only transformer in plain torch, with weights derived from the model name.

Every engine that serves the same model name builds bit-identical weights (the seed is a
stable hash of the name), so a prefill engine's KV is valid on any decode engine. The KV
layout is one tensor per sequence, `(layers, 2, heads, positions, head_dim)`, contiguous,
which is also its wire layout.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_agent.reference.tokens import VOCAB_SIZE


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 768
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return self.n_layers * 2 * self.d_model * 4  # float32


def seed_for(model_name: str) -> int:
    """Stable across processes and Python versions (unlike hash())."""
    return int.from_bytes(hashlib.sha256(model_name.encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True, slots=True)
class _Layer:
    ln1: torch.Tensor
    w_qkv: torch.Tensor  # (d, 3d)
    w_out: torch.Tensor  # (d, d)
    ln2: torch.Tensor
    w_up: torch.Tensor  # (d, d_ff)
    w_down: torch.Tensor  # (d_ff, d)


class TinyTransformer:
    """Pre-norm transformer, learned positions; float32, inference only."""

    def __init__(self, model_name: str, config: ModelConfig | None = None) -> None:
        self.config = cfg = config or ModelConfig()
        gen = torch.Generator().manual_seed(seed_for(model_name))

        def rand(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * scale

        d = cfg.d_model
        self.tok_emb = rand(cfg.vocab_size, d, scale=1.0)
        self.pos_emb = rand(cfg.max_positions, d, scale=0.5)
        self.layers = [
            _Layer(
                ln1=torch.ones(d),
                w_qkv=rand(d, 3 * d, scale=1 / math.sqrt(d)),
                w_out=rand(d, d, scale=1 / math.sqrt(d)),
                ln2=torch.ones(d),
                w_up=rand(d, cfg.d_ff, scale=1 / math.sqrt(d)),
                w_down=rand(cfg.d_ff, d, scale=1 / math.sqrt(cfg.d_ff)),
            )
            for _ in range(cfg.n_layers)
        ]
        self.ln_f = torch.ones(d)
        # Untied and sharper than the embeddings: tied random weights make the model
        # repeat its last token forever, which hides bugs in tests.
        self.w_head = rand(d, cfg.vocab_size, scale=3 / math.sqrt(d))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) -> (heads, n, head_dim)"""
        n = x.shape[0]
        return x.view(n, self.config.n_heads, self.config.head_dim).transpose(0, 1)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (self.config.d_model,), layer.ln2)
        return F.gelu(h @ layer.w_up) @ layer.w_down

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x_last, (self.config.d_model,), self.ln_f)
        return h @ self.w_head

    @torch.inference_mode()
    def prefill(self, prompt: list[int],
                past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompt. Returns (kv (L, 2, H, n, Dh) contiguous, last logits (V,)).

        `past`: the KV of the prompt's first m positions (a prefix-cache hit, m < n):
        only positions m..n-1 are computed, attending to `past` and to each other."""
        cfg = self.config
        n = len(prompt)
        m = 0 if past is None else past.shape[3]
        x = self.tok_emb[torch.tensor(prompt[m:])] + self.pos_emb[m:n]
        mask = None
        if m:  # query i (position m+i) sees every cached position and new ones up to itself
            mask = torch.ones(n - m, n, dtype=torch.bool).tril(diagonal=m)
        kvs = []
        for i, layer in enumerate(self.layers):
            h = F.layer_norm(x, (cfg.d_model,), layer.ln1)
            q, k, v = (h @ layer.w_qkv).split(cfg.d_model, dim=-1)
            q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
            if past is not None:
                k = torch.cat((past[i, 0], k), dim=1)
                v = torch.cat((past[i, 1], v), dim=1)
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + attn.transpose(0, 1).reshape(n - m, cfg.d_model) @ layer.w_out
            x = x + self._mlp(layer, x)
            kvs.append(torch.stack((k, v)))
        return torch.stack(kvs).contiguous(), self._logits(x[-1])

    def new_cache(self, kv: torch.Tensor, capacity: int) -> torch.Tensor:
        """A cache with room for `capacity` positions, holding `kv`'s positions first.

        Both a mixed engine and a decode engine build their cache this way from the same
        prefill KV, so every later step runs on identical memory layouts and values.
        """
        cfg = self.config
        cache = torch.zeros(cfg.n_layers, 2, cfg.n_heads, capacity, cfg.head_dim)
        cache[:, :, :, : kv.shape[3]] = kv
        return cache

    @torch.inference_mode()
    def step(self, cache: torch.Tensor, position: int, token: int) -> torch.Tensor:
        """Append `token` at `position` (writing its KV into `cache`); next-token logits."""
        cfg = self.config
        x = self.tok_emb[token : token + 1] + self.pos_emb[position : position + 1]
        for i, layer in enumerate(self.layers):
            h = F.layer_norm(x, (cfg.d_model,), layer.ln1)
            q, k, v = (h @ layer.w_qkv).split(cfg.d_model, dim=-1)
            cache[i, 0, :, position] = k.view(cfg.n_heads, cfg.head_dim)
            cache[i, 1, :, position] = v.view(cfg.n_heads, cfg.head_dim)
            keys = cache[i, 0, :, : position + 1]
            values = cache[i, 1, :, : position + 1]
            attn = F.scaled_dot_product_attention(self._split_heads(q), keys, values)
            x = x + attn.transpose(0, 1).reshape(1, cfg.d_model) @ layer.w_out
            x = x + self._mlp(layer, x)
        return self._logits(x[0])
