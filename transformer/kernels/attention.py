"""Attention on a CPU (CpuAttention, the twin of MultiHeadAttention): packed inputs (PackedAttention), and
under bf16 equation 1 written out, its softmax in float32 (tests/test_fast_paths.py holds it to torch's)."""

from __future__ import annotations

import math

import torch

from transformer.kernels import dropout as masks
from transformer.kernels.packing import PackedAttention
from transformer.kernels.softmax import float32_softmax
from transformer.model.attention import Mask


class CpuAttention(PackedAttention):
    """PackedAttention that computes bf16 attention from its formula.

    torch's flash kernel is slower on a CPU at Multi30k's lengths (bench/bench.py times it:
    torch-attention-bf16 against plain-bf16), and its math kernel, besides copying bf16 queries,
    keys and values to float32, scales queries and keys apiece, turns a boolean mask into an
    additive one on every call and makes its softmax safe for rows that attend to nothing (no batch
    has one: every sentence ends with </s>), each a pass of its own. Written out, the scores are
    scaled and masked in place, their softmax taken in float32 (float32_softmax), and the weights
    dropped with kernels/dropout.py's masks."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        if q.dtype != torch.bfloat16 or self.keep_weights:
            return super().attend(q, k, v, mask)
        return written_out(q, k, v, mask, self.dropout if self.training else 0.0)


def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, dropout: float) -> torch.Tensor:
    """Equation 1 of q, k, v (B, h, T, d_k), as CpuAttention computes it, (B, h, T, d_k)."""
    scores = q @ k.transpose(-2, -1)  # (B, h, T, S), a tensor of its own: scaled and masked in place
    scores.mul_(1 / math.sqrt(q.size(-1)))
    allowed = mask.dense(scores.size(-2), scores.size(-1), scores.device)
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    weights = float32_softmax(scores)
    return (masks.dropout(weights, dropout) if dropout else weights) @ v
