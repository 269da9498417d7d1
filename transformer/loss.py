"""Label-smoothed cross-entropy (section 5.4), summed over non-pad target tokens; R-Drop's consistency term."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def token_loss(model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int,
               smoothing: float, zero_pad: bool = False) -> torch.Tensor:
    """The loss summed over the non-pad positions of `tgt_out`; with smoothing 0, the NLL."""
    return smoothed_cross_entropy(*_projected(model, hidden, tgt_out, pad), pad, smoothing, zero_pad)


def rdrop_loss(model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int, smoothing: float,
               alpha: float, zero_pad: bool = False) -> torch.Tensor:
    """R-Drop (Liang et al. 2021), summed over the non-pad positions of `tgt_out`. `hidden` holds two
    forward passes of the batch stacked along the batch dimension, each with its own dropout masks.

    Per position: the mean of the two passes' smoothed cross-entropies, plus alpha / 4 times the
    symmetric KL divergence between their next-token distributions. That is the paper's objective
    (both cross-entropies plus alpha / 2 times the symmetric KL) halved, so that the loss keeps the
    scale of one pass and alpha means what the paper's does."""
    logits, target = _projected(model, hidden, tgt_out.repeat(2, 1), pad)  # one projection: the first pass's rows, then the second's
    ce = smoothed_cross_entropy(logits, target, pad, smoothing, zero_pad)
    p, q = logits.log_softmax(-1).chunk(2)  # (n, V) each
    kl = (p.exp() * (p - q) + q.exp() * (q - p)).sum(-1)  # KL(P||Q) + KL(Q||P), (n,)
    return ce / 2 + alpha / 4 * kl.masked_fill(target.chunk(2)[0] == pad, 0.0).sum()


def _projected(model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The generator's logits (n, V), in float32, and their targets (n,).

    On a CPU only the non-pad positions go through the generator: padding costs no vocabulary
    projection. Elsewhere every position does and the pad ones are ignored: selecting them
    (a boolean mask sizes its result by a count only the device knows) would make the
    host wait for the device on every micro-batch."""
    if hidden.device.type != "cpu":
        return model.generator(hidden).float().flatten(0, -2), tgt_out.flatten()
    keep = tgt_out != pad
    return model.generator(hidden[keep]).float(), tgt_out[keep]


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
