"""Packed batches: the token-wise layers skip the padding of a padded batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Pack a batch side whose real tokens fill less than this share of its positions: below it packing
# gains, above it gathering the tokens costs more than the padding it skips (bench/packing.py).
PACK_BELOW = 0.8


def counts_on_host(t: torch.Tensor) -> bool:
    """Whether the host may read a count of t's values (how many are real tokens) for free: on a CPU
    the values are the host's; on an accelerator the host would wait for the device to get there,
    and under torch.compile a shape sized by a count would break the graph."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


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


class Linear(nn.Linear):
    """nn.Linear whose rows (all dims but the last) are padded up to row_bucket's sizes where a CPU
    runs it in a half dtype. There oneDNN builds a kernel for each shape it meets, which takes longer
    than running it at this model's sizes, and token batches give every update new row counts (its
    tokens, B x T or packed): padded, they repeat from update to update, and the kernels are reused
    from oneDNN's cache (docs/speed.md). fp32 runs on MKL, which builds nothing; CUDA pads nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        size = row_bucket(rows) if builds_kernels(x) else rows
        if size == rows:
            return F.linear(x, self.weight, self.bias)
        # cast first, as autocast would: the padded copy is then half the size
        padded = F.pad(x.reshape(rows, x.size(-1)).to(matmul_dtype(x)), (0, 0, 0, size - rows))
        y = F.linear(padded, self.weight, self.bias)
        return y[:rows].view(*x.shape[:-1], y.size(-1))


def builds_kernels(x: torch.Tensor) -> bool:
    """Whether a matmul of x runs on oneDNN, which builds a kernel for each shape: on a CPU in bf16
    or float16 (not when torch.compile traces it: its shapes are symbolic there)."""
    return (
        x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and matmul_dtype(x) in (torch.bfloat16, torch.float16)
    )


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a right-padded (B, T) batch side are.

    Every layer but attention works token by token (embedding, projections, feed-forward,
    norms, dropout, residuals), so it can run on the real tokens alone, (n, d_model).
    Attention lays them out as (B, T, ·) again, with zeros for the padding, which its masks
    never let a real query read."""

    index: torch.Tensor  # (n,) positions in the flattened (B * T) batch
    rows: int
    length: int

    @staticmethod
    def of(tokens: torch.Tensor, pad: int) -> Packing | None:
        """The packing of `tokens` (B, T), or None where it does not pay: a side that is mostly
        real tokens, or where counting them does not come free (counts_on_host)."""
        if not counts_on_host(tokens):
            return None
        real = (tokens != pad).flatten()
        if int(real.sum()) >= PACK_BELOW * real.numel():
            return None
        return Packing(real.nonzero().squeeze(1), *tokens.shape)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (n, ...)"""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) -> (B, T, ...), zeros at the padding."""
        rest = x.shape[1:]
        return (
            x.new_zeros(self.rows * self.length, *rest).index_copy(0, self.index, x).view(self.rows, self.length, *rest)
        )
