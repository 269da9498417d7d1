"""Attention's softmax of bf16 scores on a CPU, computed in float32: the twin of scores.softmax(-1)
(tests/test_fast_paths.py holds it to float32's)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

_ROW = 16  # values in a row of the float32 softmax, at least: an AVX-512 register of float32


def float32_softmax(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of bf16 scores (B, h, T, S), computed in float32, forward and back."""
    return _Softmax.apply(scores)


class _Softmax(torch.autograd.Function):
    """float32_softmax.

    torch's CPU softmax runs bf16 rows several times slower than float32 ones unless their length
    is a multiple of a bf16 vector's (32 values with AVX-512), its backward more so, and float32
    rows shorter than a vector register slower too; attention's rows are a sentence long.
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
