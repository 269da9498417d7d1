"""Label-smoothed cross-entropy (section 5.4), summed over non-pad target tokens; R-Drop's consistency term."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer.kernels import packing

_BLOCK = 1 << 18  # values (rows x V) in a block of R-Drop's loss on a CPU: its steps' intermediates then stay in cache
# Logits (rows x V) above which the generator and the loss run fused, a chunk of rows at a time (_Fused):
# any. Whole, the loss holds about three float32 tensors of every logit at its peak (logits, log-probs,
# their gradient): at the paper's 25k tokens x 37k about 11 GB, and at the default recipe's 3,000 x 8,000
# more than the loss fused, which was also no slower there, in fp32 or bf16 (docs/speed.md). The whole
# path stays for a generator that is not a Linear, and as what the tests hold the fused one to.
FUSE_ABOVE = 0
# Logits (rows x V) in a chunk of the fused loss: 64 MB in float32, so a chunk's few (rows, V) tensors
# stay far below the whole path's, while its matmuls (over 400 rows at a 37k vocabulary) still run at speed.
_CHUNK = 1 << 24


def token_loss(
    model: nn.Module, hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int, smoothing: float, zero_pad: bool = False
) -> torch.Tensor:
    """The loss summed over the non-pad positions of `tgt_out`; with smoothing 0, the NLL."""
    rows, target = _kept(hidden, tgt_out, pad)
    if _fuses(model, rows):
        return _fused(model.generator, rows, target, pad, smoothing, None, zero_pad)
    return smoothed_cross_entropy(model.generator(rows).float(), target, pad, smoothing, zero_pad)


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
    rows, target = _kept(hidden, tgt_out.repeat(2, 1), pad)  # the first pass's rows, then the second's
    if _fuses(model, rows):
        return _fused(model.generator, rows, target, pad, smoothing, alpha, zero_pad)
    return _rdrop_of_logits(model.generator(rows), target, pad, smoothing, alpha, zero_pad)  # one projection of both


@torch.compiler.disable  # dynamo fails on _RDrop's sizes derived from a symbolic batch: compiled, it runs eager
def _rdrop_of_logits(
    logits: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float, alpha: float, zero_pad: bool
) -> torch.Tensor:
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
        ce, kl, g = _rdrop_rows(logits, target, pad, smoothing, alpha, zero_pad)
        ctx.save_for_backward(g)
        ctx.dtype = logits.dtype
        return _rdrop_sum(ce, kl, target != pad, alpha)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (g,) = ctx.saved_tensors
        out, rows = torch.empty_like(g, dtype=ctx.dtype), _block_rows(g)
        for start in range(0, g.size(0), rows):  # block by block: each is read from memory once
            out[start : start + rows] = (
                g[start : start + rows] * grad
            )  # g itself is kept: a graph may be run backward twice
        return out, None, None, None, None, None


def _rdrop_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    pad: int,
    smoothing: float,
    alpha: float,
    zero_pad: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R-Drop's terms of the logits (2m, V) of m pairs of rows (the first pass's rows, then the second's),
    a block of pairs at a time: each row's smoothed cross-entropy (2m,), each pair's symmetric KL (m,),
    and d loss / d logits (2m, V) before the incoming gradient, computed in float32 at least and
    handed back in out_dtype (default: that dtype; see _block_buffer)."""
    n, vocab = logits.size(0) // 2, logits.size(1)
    keep = target != pad  # (2n,), the same for both halves
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits (autocast) are worked on in float32
    ce, kl = logits.new_empty(2 * n, dtype=dtype), logits.new_empty(n, dtype=dtype)
    g = logits.new_empty(2 * n, vocab, dtype=out_dtype or dtype)
    pairs = _block_rows(logits[:n])
    buffer = _block_buffer(g, dtype, pairs)
    with torch.autocast(logits.device.type, enabled=False):  # autocast would take vecdot to bf16
        for start in range(0, n, pairs):
            stop = min(start + pairs, n)
            rows = (slice(start, stop), slice(n + start, n + stop))  # the pairs in the first pass, then the second
            (lp1, p1), (lp2, p2) = (_distributions(logits[r], dtype) for r in rows)
            dl, dp = lp1 - lp2, p1 - p2
            kl[rows[0]] = torch.linalg.vecdot(dp, dl)  # KL(P1||P2) + KL(P2||P1)
            for r, lp, p, sign in ((rows[0], lp1, p1, 1.0), (rows[1], lp2, p2, -1.0)):
                ce[r] = _smoothed_nll(lp, target[r], pad, smoothing, zero_pad)
                block = g[r] if buffer is None else buffer[: p.size(0)]
                _rdrop_gradient(block, p, dl, dp, sign, target[r], keep[r], pad, smoothing, alpha, zero_pad)
                if buffer is not None:
                    g[r] = block
    return ce, kl, g


def _block_buffer(g: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor | None:
    """Where a block of d loss / d logits is computed before it is stored in g (m, V): in g's own rows
    (None) where g has `dtype`, the dtype computed in, else in this buffer of `rows` rows in dtype,
    whose block is then cast into g's rows (the matmuls' dtype, bf16 under autocast) while still in
    cache."""
    return None if g.dtype == dtype else g.new_empty(min(rows, g.size(0)), g.size(1), dtype=dtype)


def _rdrop_sum(ce: torch.Tensor, kl: torch.Tensor, keep: torch.Tensor, alpha: float) -> torch.Tensor:
    """R-Drop's loss from its per-row cross-entropies (2n,) and per-pair KLs (n,), over the kept rows (2n,)."""
    n = kl.size(0)
    return ce.masked_fill(~keep, 0.0).sum() / 2 + alpha / 4 * kl.masked_fill(~keep[:n], 0.0).sum()


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
    torch.addcmul(dp, prob, dl, out=g).mul_(sign * alpha / 4)
    _add_smoothed_nll_gradient(g, prob, target, keep, pad, smoothing, zero_pad, 0.5)


def _add_smoothed_nll_gradient(
    g: torch.Tensor,
    prob: torch.Tensor,
    target: torch.Tensor,
    keep: torch.Tensor,
    pad: int,
    smoothing: float,
    zero_pad: bool,
    share: float,
) -> None:
    """Takes g (m, V), d loss / d log-probs of the loss's other terms, to d loss / d logits of the loss
    plus `share` times _smoothed_nll: adds that term's gradient, minus `share` times the smoothed
    target, then goes back through the log-softmax (g - prob * sum(g), per row); pad rows get 0."""
    _subtract_smoothed_target(g, target, pad, smoothing, zero_pad, share)
    g.addcmul_(prob, g.sum(-1, keepdim=True), value=-1)
    _zero_pad_rows(g, keep)


def _zero_pad_rows(g: torch.Tensor, keep: torch.Tensor) -> None:
    """Zeroes the rows of g (m, V) whose `keep` is False. Where the host knows which rows those are (a
    CPU, whose loss takes only the non-pad positions, _kept, and pads a bucket at most) it writes only
    them; elsewhere a pass over every value, which the device runs without the host waiting on it."""
    if packing.counts_on_host(keep):  # (not g[~keep] = 0: torch runs that as the masked_fill_ below)
        g.index_fill_(0, (~keep).nonzero().squeeze(1), 0.0)
    else:
        g.masked_fill_(~keep[:, None], 0.0)


def _subtract_smoothed_target(
    g: torch.Tensor, target: torch.Tensor, pad: int, smoothing: float, zero_pad: bool, share: float
) -> None:
    """Subtracts from g (m, V) `share` times the smoothed target of each row."""
    # the smoothed target: `spread` on every column but <blank> with zero_pad, 1 - smoothing more on gold
    spread = smoothing / (g.size(-1) - 2 if zero_pad else g.size(-1))
    g.sub_(spread * share)
    if zero_pad:
        g[:, pad] += spread * share
    gold = (spread if zero_pad else 0.0) - (1 - smoothing)  # with zero_pad the gold column has no spread
    g.scatter_add_(-1, target[:, None], torch.full_like(g[:, :1], gold * share))


def _fuses(model: nn.Module, rows: torch.Tensor) -> bool:
    """Whether the loss of rows (m, d_model) runs fused (_Fused): where it has more than FUSE_ABOVE
    logits and the generator is a Linear, whose math _Fused repeats. Never under torch.compile: its
    loop over chunks would be unrolled, one trace for every number of rows."""
    generator = model.generator
    if torch.compiler.is_compiling() or not isinstance(generator, nn.Linear):
        return False
    return rows.size(0) * generator.out_features > FUSE_ABOVE


def _fused(
    generator: nn.Linear,
    rows: torch.Tensor,
    target: torch.Tensor,
    pad: int,
    smoothing: float,
    alpha: float | None,
    zero_pad: bool,
) -> torch.Tensor:
    """The loss of token_loss (alpha None) or of rdrop_loss (rows: the first pass's, then the second's)
    on the generator's logits of rows (m, d_model), computed by _Fused a chunk of rows at a time."""
    args = (rows, generator.weight, generator.bias, target, pad, smoothing, alpha, zero_pad)
    return _Fused.apply(*args, torch.is_grad_enabled())  # with no graph to build, no gradient to compute


class _Fused(torch.autograd.Function):
    """The generator (a Linear) and the loss together, a chunk of rows at a time, so that no more than
    a chunk's logits (rows, V) and their gradient are ever alive.

    Per chunk: its logits in the generator's dtype (bf16 under autocast, as the generator gives them),
    each row's terms of the loss and d loss / d logits as the whole loss computes them (_ce_rows,
    _rdrop_rows, in float32, cast to the logits' dtype a block at a time as the generator's backward
    gets it: _block_buffer), then from that gradient the chunk's rows of d loss / d hidden and its
    share of d loss / d weight (and bias), summed in the weight's dtype. The backward scales these by
    the incoming gradient. A tied weight (the embeddings') is an input like any other: autograd adds
    its gradient to the embedding's."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, pad, smoothing, alpha, zero_pad, grads: bool) -> torch.Tensor:
        dtype = packing.matmul_dtype(hidden)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)  # cast once, as autocast's cache does
        pairs = 2 if alpha is not None else 1  # R-Drop: row i of the first pass and row n + i of the second
        m = target.size(0)
        n = m // pairs
        # Where oneDNN builds a kernel per shape, the last chunk is padded to row_bucket's sizes (as
        # packing.Linear pads its rows) with rows of a spare index m: they read row m - 1, target pad
        # (so their gradient is 0), and write their terms to a spare last entry, dropped after.
        buckets = packing.builds_kernels(hidden)
        spare = int(buckets)
        target = F.pad(target, (0, spare), value=pad)
        ce = hidden.new_empty(m + spare, dtype=torch.promote_types(dtype, torch.float32))
        kl = ce.new_zeros(m + spare)
        d_hidden, d_weight = hidden.new_empty(m + spare, hidden.size(1)), torch.zeros_like(weight)
        d_bias = None if bias is None else torch.zeros_like(bias)
        step = max(1, _CHUNK // (pairs * weight.size(0)))
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen above, as autocast would
            for start in range(0, n, step):
                rows = min(step, n - start)
                size = min(packing.row_bucket(rows), step) if buckets else rows
                index = torch.full((size,), m, device=hidden.device)
                index[:rows] = torch.arange(start, start + rows, device=hidden.device)
                index = torch.cat([index + k * n * (index < m) for k in range(pairs)])  # (pairs * size,)
                x = hidden.index_select(0, index.clamp(max=m - 1)).to(dtype)  # (pairs * size, d_model)
                logits = F.linear(x, w, b)
                # the gradient in the logits' dtype for the matmuls below; without them, as computed
                out_dtype = logits.dtype if grads else None
                g = _chunk_loss(logits, target[index], pad, smoothing, alpha, zero_pad, ce, kl, index, out_dtype)
                if grads:
                    d_hidden.index_copy_(0, index, (g @ w).to(hidden.dtype))
                    d_weight += g.t() @ x
                    if d_bias is not None:
                        d_bias += g.sum(0)
        d_hidden, ce, kl, target = d_hidden[:m], ce[:m], kl[:n], target[:m]
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        keep = target != pad
        return ce.masked_fill(~keep, 0.0).sum() if alpha is None else _rdrop_sum(ce, kl, keep, alpha)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        d_hidden, d_weight, d_bias = ctx.saved_tensors  # kept, not scaled in place: a graph may be run backward twice
        return d_hidden * grad, d_weight * grad, None if d_bias is None else d_bias * grad, *[None] * 6


def _chunk_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    pad: int,
    smoothing: float,
    alpha: float | None,
    zero_pad: bool,
    ce: torch.Tensor,
    kl: torch.Tensor,
    index: torch.Tensor,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """A chunk's d loss / d logits, in out_dtype (see _block_buffer); writes its rows' cross-entropies
    into ce at `index`, and with alpha (R-Drop) its pairs' KLs into kl."""
    if alpha is None:
        rows, g = _ce_rows(logits, target, pad, smoothing, zero_pad, out_dtype)
    else:
        rows, pair_kl, g = _rdrop_rows(logits, target, pad, smoothing, alpha, zero_pad, out_dtype)
        kl[index[: pair_kl.size(0)]] = pair_kl
    ce[index] = rows
    return g


def _ce_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    pad: int,
    smoothing: float,
    zero_pad: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's smoothed cross-entropy (m,) of the logits (m, V), and d loss / d logits (m, V) of their
    sum (0 on pad rows), computed in float32 at least, a block of rows at a time as R-Drop's loss is,
    and handed back in out_dtype (default: that dtype; see _block_buffer)."""
    m, vocab = logits.shape
    keep = target != pad
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ce, g = logits.new_empty(m, dtype=dtype), logits.new_empty(m, vocab, dtype=out_dtype or dtype)
    rows = _block_rows(logits)
    buffer = _block_buffer(g, dtype, rows)
    for start in range(0, m, rows):
        r = slice(start, start + rows)
        x = logits[r].to(dtype)
        prob = torch.softmax(x, -1, out=g[r] if buffer is None else buffer[: x.size(0)])
        # Each row's log-sum-exp from its largest logit and probability, 1 / sum(exp(x - max)), which
        # is at least 1/V: the log-probabilities x - lse take no pass of their own.
        lse = x.amax(-1) - prob.amax(-1).log()
        ce[r] = _smoothed_nll(x, target[r], pad, smoothing, zero_pad, lse)
        # the softmax less the smoothed target, which sums to 1: the log-softmax's backward written out
        _subtract_smoothed_target(prob, target[r], pad, smoothing, zero_pad, 1.0)
        _zero_pad_rows(prob, keep[r])
        if buffer is not None:
            g[r] = prob
    return ce, g


def _distributions(logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probabilities and the probabilities of logits (m, V), in dtype. The probabilities from
    the logits, not exp(log-probs): softmax's kernel takes a faster exponential than torch.exp's,
    within a few float32 ulps."""
    x = logits.to(dtype)
    return x.log_softmax(-1), x.softmax(-1)


def _kept(hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of hidden (m, d_model) that the generator projects for the loss, and their targets (m,).

    On a CPU only the non-pad positions: padding costs no vocabulary projection. Elsewhere every
    position, and the loss ignores the pad ones: selecting them (a boolean mask sizes its result
    by a count only the device knows) would make the host wait for the device on every micro-batch."""
    if not packing.counts_on_host(tgt_out):
        return hidden.flatten(0, -2), tgt_out.flatten()
    keep = tgt_out != pad
    return hidden[keep], tgt_out[keep]


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
    x: torch.Tensor,
    target: torch.Tensor,
    pad: int,
    smoothing: float,
    zero_pad: bool,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row of x (n, V), log-probabilities, or logits whose rows' log-sum-exp is `lse` (n,): the
    cross-entropy against the smoothed target, which puts 1 - smoothing on the gold token and spreads
    smoothing over every column (torch's), or with `zero_pad` over the V - 2 columns that are neither
    gold nor <blank>."""
    gold, total, at_pad = x.gather(-1, target[:, None]).squeeze(-1), x.sum(-1), x[:, pad]  # (n,) each
    if lse is not None:  # of the log-probabilities x - lse
        gold, total, at_pad = gold - lse, total - x.size(-1) * lse, at_pad - lse
    if zero_pad:
        return -(1 - smoothing) * gold - smoothing / (x.size(-1) - 2) * (total - gold - at_pad)
    return -(1 - smoothing) * gold - smoothing / x.size(-1) * total
