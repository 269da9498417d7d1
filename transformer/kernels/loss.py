"""The loss on a CPU (FusedLoss, the twin of training/loss.py's Loss; tests/test_loss.py holds it to
the definitions): the generator and the loss fused, a chunk of rows at a time, on the non-pad positions
alone, its gradient written out by hand a block of rows at a time, so that a block's intermediates
stay in the CPU's cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from transformer.kernels import linear, packing
from transformer.training.loss import Loss

_BLOCK = 1 << 18  # values (rows x V) in a block of the loss on a CPU: its steps' intermediates then stay in cache
# Logits (rows x V) in a chunk of the fused loss: 64 MB in float32, so a chunk's few (rows, V) tensors
# stay far below the whole loss's, while its matmuls (over 400 rows at a 37k vocabulary) still run at speed.
_CHUNK = 1 << 24


@dataclass(frozen=True)
class LossSpec:
    """What the loss compares the logits with: the target smoothed over the vocabulary (with zero_pad,
    over the V - 2 columns that are neither gold nor <blank>), pad targets ignored; with alpha (not
    None), R-Drop's, whose rows are the first pass's, then the second's."""

    pad: int
    smoothing: float
    zero_pad: bool = False
    alpha: float | None = None


class FusedLoss(Loss):
    """Loss computed by fused_loss on the non-pad positions alone: padding costs no vocabulary
    projection. Whole, the loss holds about three float32 tensors of every logit at its peak (the
    logits, the log-probabilities, their gradient): at the paper's 25k tokens x 37k, about 11 GB.
    Only on a CPU, whose host knows the count of the non-pad positions without waiting for a device."""

    def forward(self, generator, hidden, tgt_out, smoothing=None) -> torch.Tensor:
        keep = tgt_out != self.pad
        if not self._fuses(generator, keep):
            return super().forward(generator, hidden, tgt_out, smoothing)
        spec = LossSpec(self.pad, self.smoothing if smoothing is None else smoothing, self.zero_pad)
        return fused_loss(generator, hidden[keep], tgt_out[keep], spec)

    def rdrop(self, generator, hidden, tgt_out, alpha) -> torch.Tensor:
        both = tgt_out.repeat(2, 1)  # the rows: the first pass's, then the second's
        keep = both != self.pad
        if not self._fuses(generator, keep):
            return super().rdrop(generator, hidden, tgt_out, alpha)
        return fused_loss(generator, hidden[keep], both[keep], LossSpec(self.pad, self.smoothing, self.zero_pad, alpha))

    @staticmethod
    def _fuses(generator, keep: torch.Tensor) -> bool:
        """Whether there are rows to fuse (`keep`: the non-pad positions), with a generator whose math
        fused_loss repeats."""
        return isinstance(generator, nn.Linear) and bool(keep.any())


def fused_loss(generator: nn.Linear, rows: torch.Tensor, target: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """The loss of the generator's logits of rows (m, d_model), computed by _Fused a chunk of rows at a time."""
    return _Fused.apply(rows, generator.weight, generator.bias, target, spec, torch.is_grad_enabled())


def _rdrop_rows(
    logits: torch.Tensor, target: torch.Tensor, spec: LossSpec, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R-Drop's terms of the logits (2m, V) of m pairs of rows (the first pass's rows, then the second's),
    a block of pairs at a time: each row's smoothed cross-entropy (2m,), each pair's symmetric KL (m,),
    and d loss / d logits (2m, V) before the incoming gradient, computed in float32 at least and
    handed back in out_dtype (default: that dtype; see _block_buffer)."""
    n, vocab = logits.size(0) // 2, logits.size(1)
    keep = target != spec.pad  # (2n,), the same for both halves
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
                ce[r] = _smoothed_nll(lp, target[r], spec)
                block = g[r] if buffer is None else buffer[: p.size(0)]
                # d loss / d lp of the KL term, then the cross-entropy's half added and the log-softmax undone
                torch.addcmul(dp, p, dl, out=block).mul_(sign * spec.alpha / 4)
                _add_smoothed_nll_gradient(block, p, target[r], keep[r], spec, 0.5)
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
    """Rows of x (m, V) per block of the loss: all of them off the CPU, where a loop of small
    kernels would only add launches."""
    return max(1, _BLOCK // x.size(1)) if x.device.type == "cpu" else max(1, x.size(0))


def _add_smoothed_nll_gradient(
    g: torch.Tensor, prob: torch.Tensor, target: torch.Tensor, keep: torch.Tensor, spec: LossSpec, share: float
) -> None:
    """Takes g (m, V), d loss / d log-probs of the loss's other terms, to d loss / d logits of the loss
    plus `share` times _smoothed_nll: adds that term's gradient, minus `share` times the smoothed
    target, then goes back through the log-softmax (g - prob * sum(g), per row); pad rows get 0."""
    _subtract_smoothed_target(g, target, spec, share)
    g.addcmul_(prob, g.sum(-1, keepdim=True), value=-1)
    _zero_pad_rows(g, keep)


def _zero_pad_rows(g: torch.Tensor, keep: torch.Tensor) -> None:
    """Zeroes the rows of g (m, V) whose `keep` is False. Where the host knows which rows those are (a
    CPU, whose loss takes only the non-pad positions, and pads a bucket at most) it writes only
    them; elsewhere a pass over every value, which the device runs without the host waiting on it."""
    if packing.counts_on_host(keep):  # (not g[~keep] = 0: torch runs that as the masked_fill_ below)
        g.index_fill_(0, (~keep).nonzero().squeeze(1), 0.0)
    else:
        g.masked_fill_(~keep[:, None], 0.0)


def _subtract_smoothed_target(g: torch.Tensor, target: torch.Tensor, spec: LossSpec, share: float) -> None:
    """Subtracts from g (m, V) `share` times the smoothed target of each row."""
    # the smoothed target: `spread` on every column but <blank> with zero_pad, 1 - smoothing more on gold
    spread = spec.smoothing / (g.size(-1) - 2 if spec.zero_pad else g.size(-1))
    g.sub_(spread * share)
    if spec.zero_pad:
        g[:, spec.pad] += spread * share
    gold = (spread if spec.zero_pad else 0.0) - (1 - spec.smoothing)  # with zero_pad the gold column has no spread
    g.scatter_add_(-1, target[:, None], torch.full_like(g[:, :1], gold * share))


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
    def forward(ctx, hidden, weight, bias, target, spec: LossSpec, grads: bool) -> torch.Tensor:
        chunks = _Chunks(hidden, weight, bias, target, spec)
        loss = chunks.run(grads)  # with no graph to build (grads False), no gradient to compute
        ctx.save_for_backward(chunks.d_hidden[: target.size(0)], chunks.d_weight, chunks.d_bias)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        d_hidden, d_weight, d_bias = ctx.saved_tensors  # kept, not scaled in place: a graph may be run backward twice
        return d_hidden * grad, d_weight * grad, None if d_bias is None else d_bias * grad, None, None, None


class _Chunks:
    """_Fused's pass over the rows of hidden (m, d_model), a chunk at a time (R-Drop's: a chunk of pairs,
    row i of the first pass and row n + i of the second): the loss, and d loss / d hidden, weight, bias."""

    def __init__(self, hidden, weight, bias, target: torch.Tensor, spec: LossSpec):
        self.dtype = linear.matmul_dtype(hidden)
        self.w = weight.to(self.dtype)  # cast once, as autocast's cache does
        self.b = None if bias is None else bias.to(self.dtype)
        self.hidden, self.spec, self.pairs, self.m = hidden, spec, 2 if spec.alpha is not None else 1, target.size(0)
        # Where oneDNN builds a kernel per shape, the last chunk is padded to row_bucket's sizes (as
        # PaddedLinear pads its rows) with rows of a spare index m: they read row m - 1, target pad
        # (so their gradient is 0), and write their terms to a spare last entry, dropped after.
        self.buckets = linear.builds_kernels(hidden)
        spare = int(self.buckets)
        self.target = F.pad(target, (0, spare), value=spec.pad)
        self.ce = hidden.new_empty(self.m + spare, dtype=torch.promote_types(self.dtype, torch.float32))
        self.kl = self.ce.new_zeros(self.m + spare)
        self.d_hidden, self.d_weight = hidden.new_empty(self.m + spare, hidden.size(1)), torch.zeros_like(weight)
        self.d_bias = None if bias is None else torch.zeros_like(bias)

    def run(self, grads: bool) -> torch.Tensor:
        n = self.m // self.pairs
        step = max(1, _CHUNK // (self.pairs * self.w.size(0)))
        with torch.autocast(self.hidden.device.type, enabled=False):  # the dtypes are chosen above, as autocast would
            for start in range(0, n, step):
                self._chunk(self._index(start, min(step, n - start), step), grads)
        ce, kl, keep, alpha = self.ce[: self.m], self.kl[:n], self.target[: self.m] != self.spec.pad, self.spec.alpha
        return ce.masked_fill(~keep, 0.0).sum() if alpha is None else _rdrop_sum(ce, kl, keep, alpha)

    def _index(self, start: int, rows: int, step: int) -> torch.Tensor:
        """The rows of a chunk of `rows` rows (pairs) from `start`, padded to a bucket with the spare index m."""
        size = min(linear.row_bucket(rows), step) if self.buckets else rows
        index = torch.full((size,), self.m, device=self.hidden.device)
        index[:rows] = torch.arange(start, start + rows, device=self.hidden.device)
        n = self.m // self.pairs
        return torch.cat([index + k * n * (index < self.m) for k in range(self.pairs)])  # (pairs * size,)

    def _chunk(self, index: torch.Tensor, grads: bool) -> None:
        x = self.hidden.index_select(0, index.clamp(max=self.m - 1)).to(self.dtype)  # (pairs * size, d_model)
        logits = F.linear(x, self.w, self.b)
        out_dtype = logits.dtype if grads else None  # the gradient in the matmuls' dtype; without them, as computed
        if self.spec.alpha is None:
            ce, g = _ce_rows(logits, self.target[index], self.spec, out_dtype)
        else:
            ce, kl, g = _rdrop_rows(logits, self.target[index], self.spec, out_dtype)
            self.kl[index[: kl.size(0)]] = kl
        self.ce[index] = ce
        if grads:
            self.d_hidden.index_copy_(0, index, (g @ self.w).to(self.hidden.dtype))
            self.d_weight += g.t() @ x
            if self.d_bias is not None:
                self.d_bias += g.sum(0)


def _ce_rows(
    logits: torch.Tensor, target: torch.Tensor, spec: LossSpec, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's smoothed cross-entropy (m,) of the logits (m, V), and d loss / d logits (m, V) of their
    sum (0 on pad rows), computed in float32 at least, a block of rows at a time as R-Drop's loss is,
    and handed back in out_dtype (default: that dtype; see _block_buffer)."""
    m, vocab = logits.shape
    keep = target != spec.pad
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
        ce[r] = _smoothed_nll(x, target[r], spec, lse)
        # the softmax less the smoothed target, which sums to 1: the log-softmax's backward written out
        _subtract_smoothed_target(prob, target[r], spec, 1.0)
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


def _smoothed_nll(
    x: torch.Tensor, target: torch.Tensor, spec: LossSpec, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """training.loss.smoothed_cross_entropy per row of x (n, V): of log-probabilities x, or of logits x
    whose rows' log-sum-exp is `lse` (n,), so that the log-probabilities take no pass of their own."""
    gold, total, at_pad = x.gather(-1, target[:, None]).squeeze(-1), x.sum(-1), x[:, spec.pad]  # (n,) each
    if lse is not None:  # of the log-probabilities x - lse
        gold, total, at_pad = gold - lse, total - x.size(-1) * lse, at_pad - lse
    if spec.zero_pad:
        return -(1 - spec.smoothing) * gold - spec.smoothing / (x.size(-1) - 2) * (total - gold - at_pad)
    return -(1 - spec.smoothing) * gold - spec.smoothing / x.size(-1) * total
