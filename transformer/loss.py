"""Label-smoothed cross-entropy (section 5.4), summed over non-pad target tokens; R-Drop's consistency term."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer import packing

_BLOCK = 1 << 18  # values (rows x V) in a block of R-Drop's loss on a CPU: its steps' intermediates then stay in cache


def token_loss(
    model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int, smoothing: float, zero_pad: bool = False
) -> torch.Tensor:
    """The loss summed over the non-pad positions of `tgt_out`; with smoothing 0, the NLL."""
    return smoothed_cross_entropy(*_projected(model, hidden, tgt_out, pad), pad, smoothing, zero_pad)


def rdrop_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    tgt_out: torch.Tensor,
    pad: int,
    smoothing: float,
    alpha: float,
    zero_pad: bool = False,
) -> torch.Tensor:
    """R-Drop (Liang et al. 2021), summed over the non-pad positions of `tgt_out`. `hidden` holds two
    forward passes of the batch stacked along the batch dimension, each with its own dropout masks.

    Per position: the mean of the two passes' smoothed cross-entropies, plus alpha / 4 times the
    symmetric KL divergence between their next-token distributions. That is the paper's objective
    (both cross-entropies plus alpha / 2 times the symmetric KL) halved, so that the loss keeps the
    scale of one pass and alpha means what the paper's does."""
    logits, target = _projected(
        model, hidden, tgt_out.repeat(2, 1), pad, cast=False
    )  # one projection: the first pass's rows, then the second's
    return _RDrop.apply(logits, target, pad, smoothing, alpha, zero_pad)


def batch_loss(
    forward,
    model: nn.Module,
    batch,
    pad: int,
    smoothing: float,
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
    if not rdrop:
        return token_loss(model, forward(batch.src, batch.tgt_in), batch.tgt_out, pad, smoothing, zero_pad)
    if share < 1.0:
        return _partial_rdrop_loss(forward, model, batch, pad, smoothing, rdrop, zero_pad, share)
    if shared_encoder:
        hidden = forward(batch.src, batch.tgt_in, copies=2)
    else:
        hidden = forward(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1))
    return rdrop_loss(model, hidden, batch.tgt_out, pad, smoothing, rdrop, zero_pad)


def _partial_rdrop_loss(
    forward, model: nn.Module, batch, pad: int, smoothing: float, alpha: float, zero_pad: bool, share: float
) -> torch.Tensor:
    """R-Drop on round(share * B) of the batch's B sentences, drawn from torch's generator (so a
    resumed run draws the same), and the plain loss on the others: each sentence keeps one pass's
    weight, and the work is 1 + share passes instead of 2."""
    n = batch.src.size(0)
    # Index lists, not a boolean mask: a mask sizes its result by a count the host would wait for.
    order, k = torch.randperm(n), max(1, round(share * n))
    twice, once = (part.sort().values.to(batch.src.device) for part in (order[:k], order[k:]))
    hidden = forward(
        torch.cat([batch.src, batch.src[twice]]), torch.cat([batch.tgt_in, batch.tgt_in[twice]])
    )  # (B + k, T, d)
    pairs = torch.cat([hidden[twice], hidden[n:]])  # the drawn sentences' first passes, then their second
    loss = rdrop_loss(model, pairs, batch.tgt_out[twice], pad, smoothing, alpha, zero_pad)
    return loss + token_loss(model, hidden[:n][once], batch.tgt_out[once], pad, smoothing, zero_pad)


class _RDrop(torch.autograd.Function):
    """R-Drop's loss from the logits (2n, V) with its gradient written out, a few pairs of rows at a time.

    Left to autograd, the same formula keeps about a dozen (n, V) intermediates and runs the
    log-softmax twice; over a 6k vocabulary they cost as much as the generator's matmuls.
    With lp the log-probabilities, P = exp(lp), dl = lp1 - lp2 and dP = P1 - P2 per pair of rows:

        loss = sum over kept rows of ce / 2, plus alpha / 4 times sum over kept pairs of <dP, dl>
        d loss / d lp1 = alpha / 4 (P1 dl + dP) - (the smoothed target) / 2,  likewise for lp2 with dl, dP negated
        d loss / d logits = g - P * sum(g)  (the log-softmax's backward, per row)

    Every step is per row, so the forward computes that gradient too, a block of rows at a
    time: their intermediates stay in the CPU's cache instead of crossing memory once per
    step, and only the gradient is kept for the backward. Rows are computed alike in a block
    or whole, so the gradient is bit for bit what the whole tensor's steps give."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float, alpha: float, zero_pad: bool
    ) -> torch.Tensor:
        n, vocab = logits.size(0) // 2, logits.size(1)
        keep = target != pad  # (2n,), the same for both halves
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits (autocast) are worked on in float32
        ce, kl = logits.new_empty(2 * n, dtype=dtype), logits.new_empty(n, dtype=dtype)
        g = logits.new_empty(2 * n, vocab, dtype=dtype)  # d loss / d logits, before the incoming gradient
        pairs = _block_rows(logits[:n])
        with torch.autocast(logits.device.type, enabled=False):  # autocast would take vecdot to bf16
            for start in range(0, n, pairs):
                stop = min(start + pairs, n)
                rows = (
                    slice(start, stop),
                    slice(n + start, n + stop),
                )  # the pairs' rows in the first pass, then the second
                lp1, lp2 = (logits[r].to(dtype).log_softmax(-1) for r in rows)
                p1, p2 = lp1.exp(), lp2.exp()
                dl, dp = lp1 - lp2, p1 - p2
                kl[rows[0]] = torch.linalg.vecdot(dp, dl)  # KL(P1||P2) + KL(P2||P1)
                for r, lp, p, sign in ((rows[0], lp1, p1, 1.0), (rows[1], lp2, p2, -1.0)):
                    ce[r] = _smoothed_nll(lp, target[r], pad, smoothing, zero_pad)
                    _rdrop_gradient(g[r], p, dl, dp, sign, target[r], keep[r], pad, smoothing, alpha, zero_pad)
        ctx.save_for_backward(g)
        ctx.dtype = logits.dtype
        return ce.masked_fill(~keep, 0.0).sum() / 2 + alpha / 4 * kl.masked_fill(~keep[:n], 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (g,) = ctx.saved_tensors
        out, rows = torch.empty_like(g, dtype=ctx.dtype), _block_rows(g)
        for start in range(0, g.size(0), rows):  # block by block: each is read from memory once
            out[start : start + rows] = (
                g[start : start + rows] * grad
            )  # g itself is kept: a graph may be run backward twice
        return out, None, None, None, None, None


def _block_rows(x: torch.Tensor) -> int:
    """Rows of x (m, V) per block of R-Drop's loss: all of them off the CPU, where a loop of small
    kernels would only add launches."""
    return max(1, _BLOCK // x.size(1)) if x.device.type == "cpu" else max(1, x.size(0))


def _rdrop_gradient(
    g: torch.Tensor,
    prob: torch.Tensor,
    dl: torch.Tensor,
    dp: torch.Tensor,
    sign: float,
    target: torch.Tensor,
    keep: torch.Tensor,
    pad: int,
    smoothing: float,
    alpha: float,
    zero_pad: bool,
) -> None:
    """Writes into g (m, V) d loss / d logits for m rows of one pass (sign 1: the first, -1: the second)."""
    torch.addcmul(dp, prob, dl, out=g)
    if sign < 0:
        g.neg_()
    g.mul_(alpha / 4)
    # minus half the smoothed target (_smoothed_nll's): `spread` on every column but <blank> with zero_pad,
    # 1 - smoothing more on gold
    spread = smoothing / (g.size(-1) - 2 if zero_pad else g.size(-1))
    g.sub_(spread / 2)
    if zero_pad:
        g[:, pad] += spread / 2
    gold = (spread if zero_pad else 0.0) - (1 - smoothing)  # with zero_pad the gold column has no spread
    g.scatter_add_(-1, target[:, None], torch.full_like(g[:, :1], gold / 2))
    g.addcmul_(prob, g.sum(-1, keepdim=True), value=-1)
    g.masked_fill_(~keep[:, None], 0.0)


def _projected(
    model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int, cast: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The generator's logits (n, V), in float32 (with `cast`; else in the generator's dtype), and their targets (n,).

    On a CPU only the non-pad positions go through the generator: padding costs no vocabulary
    projection. Elsewhere every position does and the pad ones are ignored: selecting them
    (a boolean mask sizes its result by a count only the device knows) would make the
    host wait for the device on every micro-batch."""
    if not packing.counts_on_host(tgt_out):
        logits, target = model.generator(hidden).flatten(0, -2), tgt_out.flatten()
    else:
        keep = tgt_out != pad
        logits, target = model.generator(hidden[keep]), tgt_out[keep]
    return (logits.float() if cast else logits), target


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
    loss = _smoothed_nll(logits.log_softmax(-1), target, pad, smoothing, zero_pad=True)
    return loss.masked_fill(target == pad, 0.0).sum()


def _smoothed_nll(
    log_probs: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float, zero_pad: bool
) -> torch.Tensor:
    """Per row of log_probs (n, V): the cross-entropy against the smoothed target, which puts
    1 - smoothing on the gold token and spreads smoothing over every column (torch's), or with
    `zero_pad` over the V - 2 columns that are neither gold nor <blank>."""
    gold = log_probs.gather(-1, target[:, None]).squeeze(-1)  # (n,)
    if zero_pad:
        rest = log_probs.sum(-1) - gold - log_probs[:, pad]
        return -(1 - smoothing) * gold - smoothing / (log_probs.size(-1) - 2) * rest
    return -(1 - smoothing) * gold - smoothing / log_probs.size(-1) * log_probs.sum(-1)
