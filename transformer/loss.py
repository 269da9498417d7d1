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
    return _RDrop.apply(logits, target, pad, smoothing, alpha, zero_pad)


def batch_loss(forward, model: nn.Module, batch, pad: int, smoothing: float, rdrop: float = 0.0,
               zero_pad: bool = False, shared_encoder: bool = False) -> torch.Tensor:
    """A micro-batch's training loss, summed over its target tokens: `forward` (the model, or its
    DDP wrapper) on the batch, then `model`'s generator. With rdrop > 0, R-Drop's, from two passes
    of the batch in one forward (each row draws its own dropout); with `shared_encoder`, the two
    passes decode one encoding of the source and differ in the decoder's dropout alone."""
    if not rdrop:
        return token_loss(model, forward(batch.src, batch.tgt_in), batch.tgt_out, pad, smoothing, zero_pad)
    if shared_encoder:
        hidden = forward(batch.src, batch.tgt_in, copies=2)
    else:
        hidden = forward(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1))
    return rdrop_loss(model, hidden, batch.tgt_out, pad, smoothing, rdrop, zero_pad)


class _RDrop(torch.autograd.Function):
    """R-Drop's loss from the logits (2n, V) with its gradient written out, in place where it can be.

    Left to autograd, the same formula keeps about a dozen (n, V) intermediates and runs the
    log-softmax twice; over a 6k vocabulary they cost as much as the generator's matmuls.
    With lp the log-probabilities, P = exp(lp), dl = lp1 - lp2 and dP = P1 - P2 per pair of rows:

        loss = sum over kept rows of ce / 2, plus alpha / 4 times sum over kept pairs of <dP, dl>
        d loss / d lp1 = alpha / 4 (P1 dl + dP) - (the smoothed target) / 2,  likewise for lp2 with dl, dP negated
        d loss / d logits = g - P * sum(g)  (the log-softmax's backward, per row)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float, alpha: float,
                zero_pad: bool) -> torch.Tensor:
        lp = logits.log_softmax(-1)  # (2n, V)
        prob = lp.exp()
        (lp1, lp2), (p1, p2) = lp.chunk(2), prob.chunk(2)
        dl, dp = lp1 - lp2, p1 - p2
        kl = torch.linalg.vecdot(dp, dl)  # KL(P1||P2) + KL(P2||P1), (n,)
        keep = target != pad  # (2n,), the same for both halves
        ce = _smoothed_nll(lp, target, pad, smoothing, zero_pad)
        ctx.save_for_backward(prob, dl, dp, target, keep)
        ctx.pad, ctx.smoothing, ctx.alpha, ctx.zero_pad = pad, smoothing, alpha, zero_pad
        return ce.masked_fill(~keep, 0.0).sum() / 2 + alpha / 4 * kl.masked_fill(~keep.chunk(2)[0], 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        prob, dl, dp, target, keep = ctx.saved_tensors
        pad, smoothing, alpha = ctx.pad, ctx.smoothing, ctx.alpha
        g = torch.empty_like(prob)  # d loss / d lp, then d loss / d logits
        (g1, g2), (p1, p2) = g.chunk(2), prob.chunk(2)
        torch.addcmul(dp, p1, dl, out=g1)
        torch.addcmul(dp, p2, dl, out=g2)
        g2.neg_()
        g.mul_(alpha / 4)
        # minus half the smoothed target (_smoothed_nll's): `spread` on every column but <blank> with zero_pad, 1 - smoothing more on gold
        spread = smoothing / (g.size(-1) - 2 if ctx.zero_pad else g.size(-1))
        g.sub_(spread / 2)
        if ctx.zero_pad:
            g[:, pad] += spread / 2
        gold = (spread if ctx.zero_pad else 0.0) - (1 - smoothing)  # with zero_pad the gold column has no spread
        g.scatter_add_(-1, target[:, None], torch.full_like(g[:, :1], gold / 2))
        g.addcmul_(prob, g.sum(-1, keepdim=True), value=-1)
        g.masked_fill_(~keep[:, None], 0.0)
        return g.mul_(grad), None, None, None, None, None


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
    loss = _smoothed_nll(logits.log_softmax(-1), target, pad, smoothing, zero_pad=True)
    return loss.masked_fill(target == pad, 0.0).sum()


def _smoothed_nll(log_probs: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float,
                  zero_pad: bool) -> torch.Tensor:
    """Per row of log_probs (n, V): the cross-entropy against the smoothed target, which puts
    1 - smoothing on the gold token and spreads smoothing over every column (torch's), or with
    `zero_pad` over the V - 2 columns that are neither gold nor <blank>."""
    gold = log_probs.gather(-1, target[:, None]).squeeze(-1)  # (n,)
    if zero_pad:
        rest = log_probs.sum(-1) - gold - log_probs[:, pad]
        return -(1 - smoothing) * gold - smoothing / (log_probs.size(-1) - 2) * rest
    return -(1 - smoothing) * gold - smoothing / log_probs.size(-1) * log_probs.sum(-1)
