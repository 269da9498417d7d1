"""Label-smoothed cross-entropy (section 5.4), summed over non-pad target tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def token_loss(model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int,
               smoothing: float, zero_pad: bool = False) -> torch.Tensor:
    """The loss summed over the non-pad positions of `tgt_out`; with smoothing 0, the NLL.

    On a CPU only those positions go through the generator: padding costs no vocabulary
    projection. Elsewhere every position does and the pad ones are ignored: selecting them
    (a boolean mask sizes its result by a count only the device knows) would make the
    host wait for the device on every micro-batch."""
    if hidden.device.type != "cpu":
        return smoothed_cross_entropy(model.generator(hidden).float().flatten(0, -2), tgt_out.flatten(), pad,
                                      smoothing, zero_pad)
    keep = tgt_out != pad
    return smoothed_cross_entropy(model.generator(hidden[keep]).float(), tgt_out[keep], pad, smoothing, zero_pad)


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float,
                           zero_pad: bool = False) -> torch.Tensor:
    """Summed over the rows of logits (n, V) whose target is not `pad`.

    The smoothed target puts 1 - smoothing on the gold token and spreads smoothing over
    the vocabulary (torch's label_smoothing: every column, <blank> too), or with `zero_pad`
    (the Annotated Transformer's LabelSmoothing) over the V - 2 columns that are neither
    the gold token nor <blank>."""
    if not zero_pad or smoothing == 0:
        return F.cross_entropy(logits, target, ignore_index=pad, reduction="sum", label_smoothing=smoothing)
    log_probs = logits.log_softmax(-1)  # (n, V)
    gold = log_probs.gather(-1, target[:, None]).squeeze(-1)  # (n,)
    rest = log_probs.sum(-1) - gold - log_probs[:, pad]
    loss = -(1 - smoothing) * gold - smoothing / (logits.size(-1) - 2) * rest
    return loss.masked_fill(target == pad, 0.0).sum()
