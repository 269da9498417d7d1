"""Label-smoothed cross-entropy (section 5.4), summed over non-pad target tokens; R-Drop's consistency term.

Where the generator and the loss run fused, or R-Drop's gradient is written out, is decided in
transformer/kernels/select.py, and computed in transformer/kernels/loss.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer.kernels import select


def smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float, zero_pad: bool = False
) -> torch.Tensor:
    """Summed over the rows of logits (n, V) whose target is not `pad`.

    The smoothed target puts 1 - smoothing on the gold token and spreads smoothing over
    the vocabulary (torch's label_smoothing: every column, <blank> too), or with `zero_pad`
    (the Annotated Transformer's LabelSmoothing) over the V - 2 columns that are neither
    the gold token nor <blank>."""
    if not zero_pad or smoothing == 0:
        return F.cross_entropy(logits, target, ignore_index=pad, reduction="sum", label_smoothing=smoothing)
    log_probs = logits.log_softmax(-1)
    gold, total, at_pad = log_probs.gather(-1, target[:, None]).squeeze(-1), log_probs.sum(-1), log_probs[:, pad]
    loss = -(1 - smoothing) * gold - smoothing / (logits.size(-1) - 2) * (total - gold - at_pad)
    return loss.masked_fill(target == pad, 0.0).sum()


def token_loss(
    model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int, smoothing: float, zero_pad: bool = False
) -> torch.Tensor:
    """The loss of the decoder's states `hidden` (B, T, d_model) summed over the non-pad positions of
    `tgt_out`; with smoothing 0, the NLL."""
    rows, target = select.loss_rows(hidden, tgt_out, pad)
    if select.fuses_loss(model.generator, rows):
        return select.fused_loss(model.generator, rows, target, pad=pad, smoothing=smoothing, zero_pad=zero_pad)
    return smoothed_cross_entropy(model.generator(rows).float(), target, pad, smoothing, zero_pad)


def rdrop_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    tgt_out: torch.Tensor,
    pad: int,
    smoothing: float,
    *,
    alpha: float,
    zero_pad: bool = False,
) -> torch.Tensor:
    """R-Drop (Liang et al. 2021), summed over the non-pad positions of `tgt_out`. `hidden` holds two
    forward passes of the batch stacked along the batch dimension, each with its own dropout masks.

    Per position: the mean of the two passes' smoothed cross-entropies, plus alpha / 4 times the
    symmetric KL divergence between their next-token distributions P1 and P2,
    KL(P1||P2) + KL(P2||P1) = <P1 - P2, log P1 - log P2>. That is the paper's objective (both
    cross-entropies plus alpha / 2 times the symmetric KL) halved, so that the loss keeps the scale
    of one pass and alpha means what the paper's does."""
    rows, target = select.loss_rows(hidden, tgt_out.repeat(2, 1), pad)  # the first pass's rows, then the second's
    terms = dict(pad=pad, smoothing=smoothing, zero_pad=zero_pad, alpha=alpha)
    if select.fuses_loss(model.generator, rows):
        return select.fused_loss(model.generator, rows, target, **terms)
    return select.rdrop_of_logits(model.generator(rows), target, **terms)  # one projection of both passes


def batch_loss(
    forward,
    model: nn.Module,
    batch,
    pad: int,
    smoothing: float,
    *,
    rdrop: float = 0.0,
    zero_pad: bool = False,
    shared_encoder: bool = False,
    share: float = 1.0,
) -> torch.Tensor:
    """A micro-batch's training loss, summed over its target tokens: `forward` (the model, or its
    DDP wrapper) on the batch, then `model`'s generator. With rdrop > 0, R-Drop's, from two passes
    of the batch in one forward (each row draws its own dropout); with `shared_encoder`, the two
    passes decode one encoding of the source and differ in the decoder's dropout alone; with
    `share` < 1, only that share of the sentences, drawn afresh each time, takes a second pass."""
    terms = dict(pad=pad, smoothing=smoothing, zero_pad=zero_pad)
    if not rdrop:
        return token_loss(model, forward(batch.src, batch.tgt_in), batch.tgt_out, **terms)
    if share < 1.0:
        return _partial_rdrop_loss(forward, model, batch, share, alpha=rdrop, **terms)
    if shared_encoder:
        hidden = forward(batch.src, batch.tgt_in, copies=2)
    else:
        hidden = forward(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1))
    return rdrop_loss(model, hidden, batch.tgt_out, alpha=rdrop, **terms)


def _partial_rdrop_loss(forward, model: nn.Module, batch, share: float, alpha: float, **terms) -> torch.Tensor:
    """R-Drop on round(share * B) of the batch's B sentences, drawn from torch's generator (so a
    resumed run draws the same), and the plain loss on the others: each sentence keeps one pass's
    weight, and the work is 1 + share passes instead of 2. `terms`: token_loss's pad, smoothing, zero_pad."""
    n = batch.src.size(0)
    # Index lists, not a boolean mask: a mask sizes its result by a count the host would wait for.
    order, k = torch.randperm(n), max(1, round(share * n))
    twice, once = (part.sort().values.to(batch.src.device) for part in (order[:k], order[k:]))
    hidden = forward(
        torch.cat([batch.src, batch.src[twice]]), torch.cat([batch.tgt_in, batch.tgt_in[twice]])
    )  # (B + k, T, d)
    pairs = torch.cat([hidden[twice], hidden[n:]])  # the drawn sentences' first passes, then their second
    loss = rdrop_loss(model, pairs, batch.tgt_out[twice], alpha=alpha, **terms)
    return loss + token_loss(model, hidden[:n][once], batch.tgt_out[once], **terms)
