"""GPT-style causal decoder (nanoGPT shape) that takes and returns its KV cache.

The ONNX graph runs both prefill (T = prompt length, P = 0) and decode
(T = 1, P = tokens so far): one token per decode step, never the whole prefix.
Its inputs and outputs are those of Hugging Face decoders exported by optimum
(per layer `past_key_values.{i}.key/value` in, `present.{i}.key/value` out), so
the generator serves this model and ordinary exports through one code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.presets import GPTConfig

MASK_VALUE = -1e9


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "d_model must divide into heads"
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x (B, T, C); bias (B, 1, T, P+T); past_k, past_v (B, nh, P, hs)
        B, T, C = x.shape
        hs = C // self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = torch.cat([past_k, k.view(B, T, self.n_heads, hs).transpose(1, 2)], dim=2)  # (B, nh, P+T, hs)
        v = torch.cat([past_v, v.view(B, T, self.n_heads, hs).transpose(1, 2)], dim=2)
        att = (q @ k.transpose(-2, -1)) * (hs**-0.5) + bias  # (B, nh, T, P+T)
        y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        y = self.proj(y.transpose(1, 2).reshape(B, T, C))
        return y, k, v


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.attn(self.ln1(x), bias, past_k, past_v)
        x = x + a
        return x + self.mlp(self.ln2(x)), k, v


class GPT(nn.Module):
    """Causal LM with an explicit KV cache.

    input_ids (B, T) int64, position_ids (B, T) int64, attention_mask (B, P+T)
    int64 (0 marks padding), then per layer a key and a value (B, nh, P, hs) float32
    -> logits (B, T, V), then per layer the key and value with the T new positions.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as in GPT-2

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        c = self.cfg
        return [torch.zeros(batch, c.n_heads, 0, c.d_model // c.n_heads) for _ in range(2 * c.n_layers)]

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        _B, T = input_ids.shape
        S = attention_mask.shape[1]  # P + T
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)  # (B, T, C)
        # Query i sits at cache index S - T + i and may see keys at or before it.
        q_idx = torch.arange(T, device=x.device) + (S - T)
        k_idx = torch.arange(S, device=x.device)
        causal = (k_idx[None, :] <= q_idx[:, None]).to(x.dtype)  # (T, S)
        allowed = causal[None, None] * attention_mask.to(x.dtype)[:, None, None, :]  # (B, 1, T, S)
        bias = (1.0 - allowed) * MASK_VALUE
        presents: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, bias, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return (logits, *presents)
