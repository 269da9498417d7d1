"""The one place the CPU fast paths are switched on.

The model (transformer/model) and the loss (transformer/training/loss.py) read as the paper does; the
few operations of theirs that have a faster twin take it from here, and here alone is decided where
the twin runs. Each twin sits in a module of its own beside the plain definition it must equal, with
a test that holds it to it:

    packing.py  a padded batch side's token-wise layers on its real tokens alone (Packing), and a
                Linear's rows padded to a few sizes where oneDNN builds a kernel for every shape
    dropout.py  dropout masks drawn 16 bits a value
    softmax.py  attention's softmax of bf16 scores, in float32
    loss.py     the generator and the loss fused, their gradient written out, a block of rows at a time
    memory.py   the process's allocator and oneDNN's kernel cache, which the train stage sets up first
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.kernels import dropout as masks
from transformer.kernels import loss as kernel_loss
from transformer.kernels import packing
from transformer.kernels.packing import Packing
from transformer.kernels.softmax import float32_softmax

# Pack a batch side whose real tokens fill less than this share of its positions: below it packing
# gains, above it gathering the tokens costs more than the padding it skips.
PACK_BELOW = 0.8


def packing_of(tokens: torch.Tensor, pad: int) -> Packing | None:
    """The packing of `tokens` (B, T), or None where it does not pay: a side that is mostly real
    tokens, or where counting them does not come free (packing.counts_on_host)."""
    if not packing.counts_on_host(tokens):
        return None
    real = (tokens != pad).flatten()
    if int(real.sum()) >= PACK_BELOW * real.numel():
        return None
    return Packing(real.nonzero().squeeze(1), *tokens.shape)


class Linear(nn.Linear):
    """nn.Linear, its rows padded to a few sizes where oneDNN builds a kernel for each shape
    (packing.padded_linear): on a CPU in a half dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if packing.builds_kernels(x):
            return packing.padded_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training); on a CPU its masks are kernels/dropout.py's, the same on every CPU. On a GPU,
    and under torch.compile (which traces torch's and draws its own masks), torch's fused dropout."""
    if not training or p == 0 or x.numel() == 0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():  # random_ would break a compiled graph
        return F.dropout(x, p, True)
    return masks.dropout(x, p)


class Dropout(nn.Module):
    """nn.Dropout's place in the model, drawing its masks with `dropout` above."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """scores.softmax(-1); bf16 scores on a CPU in float32 (float32_softmax), forward and back."""
    if scores.dtype == torch.bfloat16 and scores.device.type == "cpu":
        return float32_softmax(scores)
    return scores.softmax(-1)


def attention_kernels(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """How training computes attention.

    On a CPU under bf16 autocast, from its formula (writes_attention_out). torch's flash kernel is
    slower there at Multi30k's lengths (bench/bench.py times it: torch-attention-bf16 against plain-bf16), and its math
    kernel, besides copying bf16 queries, keys and values to float32 unless told not to, scales queries
    and keys apiece, turns a boolean mask into an additive one on every call and makes its softmax safe
    for rows that attend to nothing (no batch has one: every sentence ends with </s>), each a pass
    of its own; written out, the scores are scaled and masked in place, and their softmax taken in
    float32 (softmax above).
    In float32, torch's choice (flash), as before.

    On CUDA, torch prefers cuDNN's kernel for a masked attention (flash takes no mask), and cuDNN
    builds an execution plan for every new shape: with token batches nearly every batch of the
    first epoch is one, and planning outweighs the update (docs/speed.md). So CUDA training takes
    flash or memory-efficient kernels."""
    if device.type == "cpu" and bf16:
        return _written_out()
    if device.type == "cuda":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


_WRITTEN_OUT = False  # set by _written_out, as torch's sdpa_kernel sets its backends: read where attention runs


def writes_attention_out() -> bool:
    """Whether attention runs from its formula rather than torch's scaled_dot_product_attention."""
    return _WRITTEN_OUT


@contextlib.contextmanager
def _written_out() -> Iterator[None]:
    global _WRITTEN_OUT
    before, _WRITTEN_OUT = _WRITTEN_OUT, True
    try:
        yield
    finally:
        _WRITTEN_OUT = before


def loss_rows(hidden: torch.Tensor, tgt_out: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of hidden (m, d_model) that the generator projects for the loss, and their targets (m,).

    On a CPU only the non-pad positions: padding costs no vocabulary projection. Elsewhere every
    position, and the loss ignores the pad ones: selecting them (a boolean mask sizes its result
    by a count only the device knows) would make the host wait for the device on every micro-batch."""
    if not packing.counts_on_host(tgt_out):
        return hidden.flatten(0, -2), tgt_out.flatten()
    keep = tgt_out != pad
    return hidden[keep], tgt_out[keep]


def fuses_loss(generator: nn.Module, rows: torch.Tensor) -> bool:
    """Whether the loss of rows (m, d_model) runs fused with the generator (loss.py's fused_loss): for
    every row there is, where the generator is a Linear, whose math the fused loss repeats. Whole, the
    loss holds about three float32 tensors of every logit at its peak (logits, log-probs, their
    gradient): at the paper's 25k tokens x 37k about 11 GB. Never under torch.compile: its loop over
    chunks would be unrolled, one trace for every number of rows."""
    if torch.compiler.is_compiling() or not isinstance(generator, nn.Linear):
        return False
    return rows.size(0) > 0


def fused_loss(
    generator: nn.Linear,
    rows: torch.Tensor,
    target: torch.Tensor,
    *,
    pad: int,
    smoothing: float,
    zero_pad: bool,
    alpha: float | None = None,
) -> torch.Tensor:
    """The loss of the generator's logits of rows (m, d_model), fused with the generator (where fuses_loss
    says so): the smoothed cross-entropy, or with alpha R-Drop's (rows: the first pass's, then the second's)."""
    return kernel_loss.fused_loss(generator, rows, target, kernel_loss.LossSpec(pad, smoothing, zero_pad, alpha))


def rdrop_of_logits(
    logits: torch.Tensor, target: torch.Tensor, *, pad: int, smoothing: float, zero_pad: bool, alpha: float
) -> torch.Tensor:
    """R-Drop's loss of the logits (2m, V), its gradient written out: rows in blocks on a CPU."""
    return kernel_loss.blocked_rdrop(logits, target, kernel_loss.LossSpec(pad, smoothing, zero_pad, alpha))
