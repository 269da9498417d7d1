"""Multi-head scaled dot-product attention (section 3.2)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer.kernels.dropout
from transformer.kernels.packing import Linear, Packing


def attention_kernels(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """How training computes attention.

    On a CPU under bf16 autocast, from its formula (_written_out). torch's flash kernel is slower
    there at Multi30k's lengths (bench/bench.py times it: torch-attention-bf16 against plain-bf16), and its math kernel,
    besides copying bf16 queries, keys and values to float32 unless told not to, scales queries and
    keys apiece, turns a boolean mask into an additive one on every call and makes its softmax safe
    for rows that attend to nothing (no batch has one: every sentence ends with </s>), each a pass
    of its own; written out, the scores are scaled and masked in place, and their softmax taken in
    float32 (_Softmax; docs/experiments.md).
    In float32, torch's choice (flash), as before.

    On CUDA, torch prefers cuDNN's kernel for a masked attention (flash takes no mask), and cuDNN
    builds an execution plan for every new shape: with token batches nearly every batch of the
    first epoch is one, and planning outweighs the update (docs/speed.md). So CUDA training takes
    flash or memory-efficient kernels."""
    if device.type == "cpu" and bf16:
        return _written_out()
    if device.type == "cuda":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


_WRITTEN_OUT = False  # set by _written_out, as torch's sdpa_kernel sets its backends: read where attention runs


@contextlib.contextmanager
def _written_out() -> Iterator[None]:
    """Attention from its formula (MultiHeadAttention._attend) instead of scaled_dot_product_attention."""
    global _WRITTEN_OUT
    before, _WRITTEN_OUT = _WRITTEN_OUT, True
    try:
        yield
    finally:
        _WRITTEN_OUT = before


class MultiHeadAttention(nn.Module):
    """Implements section 3.2.2 through torch's scaled_dot_product_attention (flash/efficient kernels),
    or from its formula where attention_kernels says so (CPU bf16 training) or the weights are kept.

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
        p = self.dropout if self.training else 0.0
        if not (self.keep_weights or _WRITTEN_OUT):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        scores = q @ k.transpose(-2, -1)  # (B, h, T, S), a tensor of its own: scaled and masked in place
        if causal:
            T, S = scores.shape[-2:]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores.mul_(1 / math.sqrt(self.d_k))
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        if scores.dtype == torch.bfloat16 and scores.device.type == "cpu":
            weights = _Softmax.apply(scores)
        else:
            weights = scores.softmax(-1)
        if self.keep_weights:
            self.weights = weights
        return transformer.kernels.dropout.dropout(weights, p) @ v


_ROW = 16  # values in a row of _Softmax's float32 softmax, at least: an AVX-512 register of float32


class _Softmax(torch.autograd.Function):
    """softmax over the last dim of bf16 scores (B, h, T, S), computed in float32, forward and back.

    torch's CPU softmax runs bf16 rows several times slower than float32 ones unless their length
    is a multiple of a bf16 vector's (32 values with AVX-512), its backward more so, and float32
    rows shorter than a vector register slower too (docs/experiments.md);
    attention's rows are a sentence long.
    So the scores are copied to float32, rows shorter than _ROW padded with -inf (their weights
    and gradients are 0), the weights kept in float32 for the backward, and the weights and the
    scores' gradient handed back in bf16."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        weights = _widened(scores, _ROW, float("-inf")).softmax(-1)
        ctx.save_for_backward(weights)
        return weights[..., : scores.size(-1)].to(scores.dtype)

    @staticmethod
    @once_differentiable  # the saved weights are no input: a second derivative would miss their terms
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (weights,) = ctx.saved_tensors
        g = _widened(grad, weights.size(-1), 0.0)
        return torch._softmax_backward_data(g, weights, -1, torch.float32)[..., : grad.size(-1)].to(grad.dtype)


def _widened(x: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """x (..., S) in float32, each row padded with `fill` up to `width` values where S is less."""
    if x.size(-1) >= width:
        return x.float()
    out = x.new_full((*x.shape[:-1], width), fill, dtype=torch.float32)
    out[..., : x.size(-1)] = x
    return out
