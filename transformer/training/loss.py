"""The training loss: label-smoothed cross-entropy (section 5.4) summed over the non-pad target tokens,
and R-Drop's consistency term between two dropout passes.

These are the definitions. On a CPU, transformer/kernels/accelerate.py swaps in FusedLoss
(transformer/kernels/loss.py), which computes the same numbers with the generator and the loss fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


class Loss(nn.Module):
    """The loss of the decoder's states, through the model's generator, against the target tokens.

    A module, holding no weights, so that a faster twin can take its place (kernels/accelerate.py)."""

    def __init__(self, pad: int, smoothing: float, zero_pad: bool = False):
        super().__init__()
        self.pad, self.smoothing, self.zero_pad = pad, smoothing, zero_pad

    def forward(
        self, generator: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, smoothing: float | None = None
    ) -> torch.Tensor:
        """The smoothed cross-entropy of the generator's logits of `hidden` (B, T, d_model) against
        `tgt_out` (B, T), summed over its non-pad tokens; `smoothing` 0 gives the NLL (validation's)."""
        smoothing = self.smoothing if smoothing is None else smoothing
        logits = _at_least_float32(generator(hidden)).flatten(0, -2)
        return smoothed_cross_entropy(logits, tgt_out.flatten(), self.pad, smoothing, self.zero_pad)

    def rdrop(self, generator: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, alpha: float) -> torch.Tensor:
        """R-Drop (Liang et al. 2021), summed over the non-pad positions of `tgt_out` (B, T). `hidden`
        holds two passes of the batch stacked along the batch dimension, (2B, T, d_model), each drawn
        with its own dropout masks.

        Per position: the mean of the two passes' smoothed cross-entropies, plus alpha / 4 times the
        symmetric KL divergence between their next-token distributions P1 and P2,
        KL(P1||P2) + KL(P2||P1) = <P1 - P2, log P1 - log P2>. That is the paper's objective (both
        cross-entropies plus alpha / 2 times the symmetric KL) halved, so that the loss keeps the
        scale of one pass and alpha means what the paper's does."""
        logits = _at_least_float32(generator(hidden))  # (2B, T, V)
        both = tgt_out.repeat(2, 1).flatten()
        ce = smoothed_cross_entropy(logits.flatten(0, 1), both, self.pad, self.smoothing, self.zero_pad)
        log_p1, log_p2 = logits.log_softmax(-1).chunk(2)
        kl = ((log_p1.exp() - log_p2.exp()) * (log_p1 - log_p2)).sum(-1)  # (B, T)
        return ce / 2 + alpha / 4 * kl.masked_fill(tgt_out == self.pad, 0.0).sum()


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32, or in float64 where they are: bf16 logits (autocast's) would round the loss."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def batch_loss(forward, generator: nn.Module, batch, loss: Loss, *, rdrop=0.0, shared_encoder=False, share=1.0):
    """A micro-batch's training loss, summed over its target tokens: `forward` (the model, or its DDP
    wrapper) on the batch, then `loss` of the generator's logits. With rdrop > 0, R-Drop's, from two
    passes of the batch in one forward (each row draws its own dropout); with `shared_encoder`, the
    two passes decode one encoding of the source and differ in the decoder's dropout alone; with
    `share` < 1, only that share of the sentences, drawn afresh each time, takes a second pass."""
    if not rdrop:
        return loss(generator, forward(batch.src, batch.tgt_in), batch.tgt_out)
    if share < 1.0:
        return _partial_rdrop_loss(forward, generator, batch, loss, share=share, alpha=rdrop)
    if shared_encoder:
        hidden = forward(batch.src, batch.tgt_in, copies=2)
    else:
        hidden = forward(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1))
    return loss.rdrop(generator, hidden, batch.tgt_out, rdrop)


def _partial_rdrop_loss(forward, generator, batch, loss: Loss, *, share: float, alpha: float) -> torch.Tensor:
    """R-Drop on round(share * B) of the batch's B sentences, drawn from torch's generator (so a
    resumed run draws the same), and the plain loss on the others: each sentence keeps one pass's
    weight, and the work is 1 + share passes instead of 2."""
    n = batch.src.size(0)
    # Index lists drawn on the batch's device, not a boolean mask: a mask sizes its result by a count,
    # and a list drawn on the host is a copy, that a GPU's host would wait for.
    order, k = torch.randperm(n, device=batch.src.device), max(1, round(share * n))
    twice, once = (part.sort().values for part in (order[:k], order[k:]))
    hidden = forward(
        torch.cat([batch.src, batch.src[twice]]), torch.cat([batch.tgt_in, batch.tgt_in[twice]])
    )  # (B + k, T, d)
    pairs = torch.cat([hidden[twice], hidden[n:]])  # the drawn sentences' first passes, then their second
    return loss.rdrop(generator, pairs, batch.tgt_out[twice], alpha) + loss(
        generator, hidden[:n][once], batch.tgt_out[once]
    )
