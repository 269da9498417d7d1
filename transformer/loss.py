"""Label-smoothed cross-entropy (section 5.4), summed over non-pad target tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def token_loss(model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int,
               smoothing: float) -> torch.Tensor:
    """The loss summed over the non-pad positions of `tgt_out`; with smoothing 0, the NLL.

    Only those positions go through the generator: padding costs no vocabulary projection."""
    keep = tgt_out != pad
    logits = model.generator(hidden[keep]).float()  # (n, V)
    return F.cross_entropy(logits, tgt_out[keep], reduction="sum", label_smoothing=smoothing)
