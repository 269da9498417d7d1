"""Multi-head scaled dot-product attention (section 3.2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from transformer.kernels import select
from transformer.kernels.packing import Packing
from transformer.kernels.select import Linear


class MultiHeadAttention(nn.Module):
    """Implements section 3.2.2 through torch's scaled_dot_product_attention (flash/efficient kernels),
    or from its formula where the weights are kept or select.attention_kernels says so (CPU bf16 training).

    Self-attention projects Q, K, V in one matmul and, when decoding incrementally, appends
    each step's K, V to `cache`; source attention then reads the memory's K, V from its `cache`
    (memory_heads), projected once per sentence.
    With a `packing` (of x) or a `memory_packing`, that input comes packed, (n, d_model):
    its projections run on the real tokens and are laid out per sentence to attend.
    `dropout` drops attention weights in training (the Annotated Transformer's; the paper has none)."""

    def __init__(self, d_model: int, h: int, self_attention: bool, dropout: float = 0.0):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.dropout = dropout
        self.self_attention = self_attention
        if self_attention:
            self.qkv = Linear(d_model, 3 * d_model)
        else:
            self.q = Linear(d_model, d_model)
            self.kv = Linear(d_model, 2 * d_model)
        self.out = Linear(d_model, d_model)
        self.keep_weights = False  # set to record attention maps (figures) in .weights
        self.weights: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: dict[str, torch.Tensor] | None = None,
        packing: Packing | None = None,
        memory_packing: Packing | None = None,
    ) -> torch.Tensor:
        if self.self_attention:
            q, k, v = self._heads(self.qkv(x), 3, packing)  # (B, h, T, d_k) each
            if cache is not None:  # incremental decoding: append this step's keys and values
                if "k" in cache:
                    k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
                cache["k"], cache["v"] = k, v
        else:
            (q,) = self._heads(self.q(x), 1, packing)
            if cache is not None:  # incremental decoding: the memory's, from memory_heads
                k, v = cache["k"], cache["v"]
            else:
                k, v = self.memory_heads(memory, memory_packing)
        y = self._attend(q, k, v, mask, causal).transpose(1, 2).flatten(2)  # (B, T, d_model)
        return self.out(y if packing is None else packing.pack(y))  # like x

    def memory_heads(self, memory: torch.Tensor, packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Source attention's keys and values of `memory` (B, S, d_model), (B, h, S, d_k) each:
        incremental decoding projects them once, before its first step."""
        return self._heads(self.kv(memory), 2, packing)

    def _heads(self, projected: torch.Tensor, n: int, packing: Packing | None) -> tuple[torch.Tensor, ...]:
        if packing is not None:
            projected = packing.unpack(projected)  # (B, T, n * d_model)
        B, T, _ = projected.shape
        return projected.view(B, T, n, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)

    def _attend(self, q, k, v, mask, causal) -> torch.Tensor:
        """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (equation 1), (B, h, T, d_k)."""
        p = self.dropout if self.training else 0.0
        if not (self.keep_weights or select.writes_attention_out()):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        scores = q @ k.transpose(-2, -1)  # (B, h, T, S), a tensor of its own: scaled and masked in place
        if causal:
            T, S = scores.shape[-2:]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores.mul_(1 / math.sqrt(self.d_k))
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        weights = select.softmax(scores)
        if self.keep_weights:
            self.weights = weights
        return select.dropout(weights, p) @ v
