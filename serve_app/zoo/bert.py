"""BERT-style encoder classifier: token + position embeddings, pre-LN encoder
blocks, masked mean pooling, linear head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.presets import BertConfig

# Additive mask value; -inf would turn an all-padding row into NaN.
MASK_VALUE = -1e9


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "d_model must divide into heads"
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, hs).transpose(1, 2)
        v = v.view(B, T, self.n_heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (hs**-0.5) + key_bias  # (B, nh, T, T)
        y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), key_bias)
        return x + self.mlp(self.ln2(x))


class BertClassifier(nn.Module):
    """input_ids (B, T) int64, attention_mask (B, T) int64 -> logits (B, n_classes)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        _B, T = input_ids.shape
        pos = torch.arange(T, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)[None]  # (B, T, C)
        mask = attention_mask.to(x.dtype)
        key_bias = ((1.0 - mask) * MASK_VALUE)[:, None, None, :]  # (B, 1, 1, T)
        for block in self.blocks:
            x = block(x, key_bias)
        x = self.ln_f(x)
        # Masked mean pooling: padding must not change a sequence's answer, so
        # that per-batch padding gives the same logits as running it alone.
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)  # (B, C)
        return self.head(pooled)
