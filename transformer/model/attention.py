"""Multi-head scaled dot-product attention (section 3.2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Mask:
    """Which keys each query may attend to: the keys where `keys` is True ((B, 1, 1, S); None lets a
    query see every key) and, with `causal`, none after the query's own position, so that a
    decoder's prediction of a token never sees that token (section 3.2.3)."""

    keys: torch.Tensor | None = None
    causal: bool = False

    def dense(self, queries: int, keys: int, device: torch.device) -> torch.Tensor | None:
        """The mask as one boolean tensor that broadcasts over (B, h, queries, keys), or None for no mask."""
        allowed = self.keys
        if self.causal:  # a query at position i of the last `queries` sees the keys up to its own
            causal = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
            allowed = causal if allowed is None else allowed & causal
        return allowed


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: h heads attend side by side, each over its own d_k = d_model / h wide projection
    of the queries, keys and values; their outputs are concatenated and projected back to d_model.

    Self-attention takes queries, keys and values from x, projected in one matmul; source
    attention takes its queries from x and its keys and values from the encoder's `memory`.
    Decoding one token at a time passes a `cache`: self-attention appends each step's keys and
    values to it, and source attention reads the memory's from it (memory_heads, projected once a
    sentence). `dropout` drops attention weights in training, as the Annotated Transformer does;
    the paper has none there."""

    def __init__(self, d_model: int, h: int, self_attention: bool, dropout: float = 0.0):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.dropout = dropout
        self.self_attention = self_attention
        if self_attention:
            self.qkv = nn.Linear(d_model, 3 * d_model)
        else:
            self.q = nn.Linear(d_model, d_model)
            self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.keep_weights = False  # set to record attention maps (figures) in .weights
        self.weights: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None, mask: Mask, cache: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        if self.self_attention:
            q, k, v = self.heads(self.qkv(x), 3)  # (B, h, T, d_k) each
            if cache is not None:  # decoding one token at a time: this step's keys and values join the prefix's
                if "k" in cache:
                    k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
                cache["k"], cache["v"] = k, v
        else:
            (q,) = self.heads(self.q(x), 1)
            k, v = (cache["k"], cache["v"]) if cache is not None else self.memory_heads(memory)
        return self.out(self.attend(q, k, v, mask).transpose(1, 2).flatten(2))  # (B, T, d_model)

    def memory_heads(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Source attention's keys and values of `memory` (B, S, d_model), (B, h, S, d_k) each."""
        return self.heads(self.kv(memory), 2)

    def heads(self, projected: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """n projections side by side, (B, T, n * d_model), split into n tensors of heads, (B, h, T, d_k)."""
        B, T, _ = projected.shape
        return projected.view(B, T, n, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (equation 1), each head's, (B, h, T, d_k).

        torch's scaled_dot_product_attention computes it in fused kernels that never hold the
        weights; where the weights are kept (attention maps), the equation is written out."""
        p = self.dropout if self.training else 0.0
        if not self.keep_weights:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.keys, dropout_p=p, is_causal=mask.causal)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, h, T, S)
        allowed = mask.dense(scores.size(-2), scores.size(-1), scores.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        self.weights = scores.softmax(-1)
        return F.dropout(self.weights, p, self.training) @ v
