"""Packed batches: the token-wise layers skip the padding of a padded batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Pack a batch side whose real tokens fill less than this share of its positions: below it packing
# gains, above it gathering the tokens costs more than the padding it skips (bench/packing.py).
PACK_BELOW = 0.8


def counts_on_host(t: torch.Tensor) -> bool:
    """Whether the host may read a count of t's values (how many are real tokens) for free: on a CPU
    the values are the host's; on an accelerator the host would wait for the device to get there,
    and under torch.compile a shape sized by a count would break the graph."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a right-padded (B, T) batch side are.

    Every layer but attention works token by token (embedding, projections, feed-forward,
    norms, dropout, residuals), so it can run on the real tokens alone, (n, d_model).
    Attention lays them out as (B, T, ·) again, with zeros for the padding, which its masks
    never let a real query read."""

    index: torch.Tensor  # (n,) positions in the flattened (B * T) batch
    rows: int
    length: int

    @staticmethod
    def of(tokens: torch.Tensor, pad: int) -> Packing | None:
        """The packing of `tokens` (B, T), or None where it does not pay: a side that is mostly
        real tokens, or where counting them does not come free (counts_on_host)."""
        if not counts_on_host(tokens):
            return None
        real = (tokens != pad).flatten()
        if int(real.sum()) >= PACK_BELOW * real.numel():
            return None
        return Packing(real.nonzero().squeeze(1), *tokens.shape)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (n, ...)"""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) -> (B, T, ...), zeros at the padding."""
        rest = x.shape[1:]
        return (
            x.new_zeros(self.rows * self.length, *rest).index_copy(0, self.index, x).view(self.rows, self.length, *rest)
        )
