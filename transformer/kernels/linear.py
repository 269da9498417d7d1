"""A Linear whose rows are padded to a few sizes (PaddedLinear, the twin of nn.Linear): on a CPU in a half
dtype, oneDNN builds a kernel for every shape it meets (tests/test_fast_paths.py holds it to F.linear)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PaddedLinear(nn.Linear):
    """nn.Linear, its rows padded to a few sizes (padded_linear) where a matmul of its input runs on oneDNN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if builds_kernels(x):
            return padded_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x runs in: autocast's where it is on (it casts float32 and
    float16/bf16, never float64), else x's own."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device)
    return x.dtype


def row_bucket(rows: int) -> int:
    """rows rounded up to one of eight sizes an octave (a multiple of 8, at most 1/8 more)."""
    multiple = max(8, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // multiple) * multiple


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), its rows (all dims but the last) padded up to row_bucket's sizes. Where a
    CPU runs it in a half dtype, oneDNN builds a kernel for each shape it meets, which takes longer than
    running it at this model's sizes, and token batches give every update new row counts (its tokens,
    B x T or packed): padded, they repeat from update to update, and the kernels are reused from
    oneDNN's cache (docs/speed.md). fp32 runs on MKL, which builds nothing; CUDA pads nothing."""
    rows = x.shape[:-1].numel()
    size = row_bucket(rows)
    if size == rows:
        return F.linear(x, weight, bias)
    y = _PaddedLinear.apply(x.reshape(rows, x.size(-1)), weight, bias, size, matmul_dtype(x))
    return y.view(*x.shape[:-1], y.size(-1))


class _PaddedLinear(torch.autograd.Function):
    """F.linear of x (rows, in) in `dtype` (autocast's), on x's rows padded with zeros to `size`, and
    its backward on the output's gradient padded alike. Each is one copy into the padded buffer, cast
    on the way; autograd's cast, pad and slice would copy twice each way, and zero whole buffers."""

    @staticmethod
    def forward(ctx, x, weight, bias, size: int, dtype: torch.dtype) -> torch.Tensor:
        padded, w = _padded(x, size, dtype), weight.to(dtype)  # the weight cast once, as autocast's cache does
        with torch.autocast(x.device.type, enabled=False):  # the dtype is chosen above, as autocast would
            y = F.linear(padded, w, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(padded, w)
        ctx.dtypes = x.dtype, weight.dtype, None if bias is None else bias.dtype
        return y[: x.size(0)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        padded, w = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        g = _padded(grad, padded.size(0), w.dtype)
        d_x = (g @ w)[: grad.size(0)].to(x_dtype) if ctx.needs_input_grad[0] else None
        d_weight = (g.t() @ padded).to(weight_dtype) if ctx.needs_input_grad[1] else None
        d_bias = g.sum(0).to(bias_dtype) if bias_dtype is not None and ctx.needs_input_grad[2] else None
        return d_x, d_weight, d_bias, None, None


def _padded(x: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """x (rows, n) in dtype, followed by rows of zeros up to `size` rows."""
    out = x.new_empty(size, x.size(1), dtype=dtype)
    out[: x.size(0)] = x
    out[x.size(0) :].zero_()
    return out


def builds_kernels(x: torch.Tensor) -> bool:
    """Whether a matmul of x runs on oneDNN, which builds a kernel for each shape: on a CPU in bf16
    or float16 (not when torch.compile traces it: its shapes are symbolic there)."""
    return (
        x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and matmul_dtype(x) in (torch.bfloat16, torch.float16)
    )
