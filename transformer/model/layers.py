"""Encoder and decoder stacks (section 3.1, Figure 1)."""

from __future__ import annotations

import torch
from torch import nn

from transformer.model.attention import Mask, MultiHeadAttention

Cache = dict[str, torch.Tensor]


class Residual(nn.Module):
    """A sub-layer with dropout and a residual connection, normalized after (post, the paper)
    or before (pre, the Annotated Transformer)."""

    def __init__(self, d_model: int, dropout: float, norm: str):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.pre = norm == "pre"

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2, with `dropout` on the inner
    activations (the Annotated Transformer's; the paper has none)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.dropout(torch.relu(self.w_1(x))))


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network, each a Residual sub-layer."""

    def __init__(self, d_model: int, d_ff: int, h: int, dropout: float, norm: str, attn_dropout=0.0, ff_dropout=0.0):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, h, self_attention=True, dropout=attn_dropout)
        self.ff = FeedForward(d_model, d_ff, ff_dropout)
        self.sublayers = nn.ModuleList(Residual(d_model, dropout, norm) for _ in range(2))

    def forward(self, x: torch.Tensor, src_mask: Mask) -> torch.Tensor:
        x = self.sublayers[0](x, lambda y: self.self_attn(y, None, src_mask))
        return self.sublayers[1](x, self.ff)


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder's output (`memory`), then the feed-forward
    network, each a Residual sub-layer. `cache`: its two attentions' caches when decoding one token
    at a time."""

    def __init__(self, d_model: int, d_ff: int, h: int, dropout: float, norm: str, attn_dropout=0.0, ff_dropout=0.0):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, h, self_attention=True, dropout=attn_dropout)
        self.src_attn = MultiHeadAttention(d_model, h, self_attention=False, dropout=attn_dropout)
        self.ff = FeedForward(d_model, d_ff, ff_dropout)
        self.sublayers = nn.ModuleList(Residual(d_model, dropout, norm) for _ in range(3))

    def forward(
        self, x, memory, src_mask: Mask, tgt_mask: Mask, cache: tuple[Cache, Cache] | None = None
    ) -> torch.Tensor:
        self_cache, src_cache = cache if cache is not None else (None, None)
        x = self.sublayers[0](x, lambda y: self.self_attn(y, None, tgt_mask, self_cache))
        x = self.sublayers[1](x, lambda y: self.src_attn(y, memory, src_mask, src_cache))
        return self.sublayers[2](x, self.ff)


class Stack(nn.Module):
    """N identical layers; pre-norm stacks end with a LayerNorm of their own."""

    def __init__(self, layers: list[nn.Module], d_model: int, norm: str):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d_model) if norm == "pre" else nn.Identity()


class Encoder(Stack):
    def forward(self, x: torch.Tensor, src_mask: Mask) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.norm(x)


class Decoder(Stack):
    def forward(
        self, x, memory, src_mask: Mask, tgt_mask: Mask, caches: list[tuple[Cache, Cache]] | None = None
    ) -> torch.Tensor:
        """`caches`: one (self-attention, source-attention) pair per layer when decoding one token at a time."""
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_mask, tgt_mask, None if caches is None else caches[i])
        return self.norm(x)
