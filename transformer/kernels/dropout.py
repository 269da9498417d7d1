"""Dropout masks on a CPU that are the same on every CPU, and cheap to draw: dropout, the twin of
F.dropout(x, p), and MaskDropout, of nn.Dropout (tests/test_dropout.py holds it to its rate, scale
and gradient).

On a CPU, torch's dropout draws its mask with MKL's generator where the CPU is Intel's and
else with its Mersenne Twister, one 64-bit draw a value, single-threaded: about an eighth of
a training update here (bench/update_profile.py). These masks take 16 bits a value from the
Twister's 64-bit draws (`random_` over the whole int64 range), so one draw serves four values,
the same draws on every CPU; a value is dropped with p rounded to a multiple of 2^-16 and the
kept ones scaled by the inverse of the rounded keep rate.
"""

from __future__ import annotations

import torch
from torch import nn

_LEVELS = 1 << 16  # a mask value is 16 random bits


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """x (on a CPU) with each value zeroed with chance p (to 2^-16) and the rest scaled to keep the mean."""
    dropped = min(round(p * _LEVELS), _LEVELS - 1)
    bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None)  # every 64-bit value
    # the mask made in x's dtype: a bool one times x is first copied to x's dtype, forward and back,
    # and torch.where, which would take a bool one as it is, runs slower than a product does
    keep = torch.ge(bits.view(torch.int16)[: x.numel()].view(x.shape), dropped - _LEVELS // 2, out=torch.empty_like(x))
    return x * keep * (_LEVELS / (_LEVELS - dropped))


class MaskDropout(nn.Dropout):
    """nn.Dropout drawing its masks with `dropout` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.numel() == 0:
            return x
        return dropout(x, self.p)
