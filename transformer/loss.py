"""Label-smoothed cross-entropy (section 5.4), summed over non-pad target tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def token_loss(model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int,
               smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(smoothed loss, plain NLL), each summed over the non-pad positions of `tgt_out`.

    Only those positions go through the generator: padding costs no vocabulary projection."""
    keep = tgt_out != pad
    logits = model.generator(hidden[keep]).float()  # (n, V)
    target = tgt_out[keep]
    loss = F.cross_entropy(logits, target, reduction="sum", label_smoothing=smoothing)
    with torch.no_grad():
        nll = loss if smoothing == 0 else F.cross_entropy(logits, target, reduction="sum")
    return loss, nll
