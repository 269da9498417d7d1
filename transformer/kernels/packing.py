"""Packed batches, the twin of the model's forward for a mostly padded batch side: the token-wise layers
run on its real tokens alone, with the padded batch's result (tests/test_packing.py holds the packed
model to the plain one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transformer.model.attention import Mask, MultiHeadAttention
from transformer.model.model import Transformer


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

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (n, ...)"""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) -> (B, T, ...), zeros at the padding."""
        rest = x.shape[1:]
        return (
            x.new_zeros(self.rows * self.length, *rest).index_copy(0, self.index, x).view(self.rows, self.length, *rest)
        )


def packing_of(tokens: torch.Tensor, pad: int, below: float) -> Packing | None:
    """The packing of `tokens` (B, T), or None where it does not pay: a side whose real tokens fill
    at least `below` of its positions, or where counting them does not come free (counts_on_host)."""
    if not counts_on_host(tokens):
        return None
    real = (tokens != pad).flatten()
    if int(real.sum()) >= below * real.numel():
        return None
    return Packing(real.nonzero().squeeze(1), *tokens.shape)


def pack(packing: Packing | None, x: torch.Tensor) -> torch.Tensor:
    return x if packing is None else packing.pack(x)


def unpack(packing: Packing | None, x: torch.Tensor) -> torch.Tensor:
    return x if packing is None else packing.unpack(x)


@dataclass(frozen=True)
class PackedMask(Mask):
    """A Mask that also says how the two sides an attention joins are laid out: the queries' side
    (`queries`) and the memory's (`memory`), each packed or, with None, padded (B, T, d_model)."""

    queries: Packing | None = None
    memory: Packing | None = None


class PackedTransformer(Transformer):
    """Transformer whose forward runs each mostly padded batch side packed (packing_of). Only forward:
    decoding one token at a time has no padding on its target side to skip."""

    # Pack a batch side whose real tokens fill less than this share of its positions: below it packing
    # gains, above it gathering the tokens costs more than the padding it skips.
    pack_below = 0.8

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, copies: int = 1) -> torch.Tensor:
        keys, src_packing = self.src_mask(src).keys, packing_of(src, self.pad, self.pack_below)
        memory = self.dropout(pack(src_packing, self.source_embeddings(src)))
        memory = self.encoder(memory, PackedMask(keys, queries=src_packing, memory=src_packing))
        if copies > 1:
            # Repeating the packed memory packs the repeated batch: its real tokens come copy after copy.
            memory = memory.repeat(copies, *[1] * (memory.dim() - 1))
            src, tgt_in, keys = src.repeat(copies, 1), tgt_in.repeat(copies, 1), keys.repeat(copies, 1, 1, 1)
            src_packing = packing_of(src, self.pad, self.pack_below)
        tgt_packing = packing_of(tgt_in, self.pad, self.pack_below)
        x = self.dropout(pack(tgt_packing, self.target_embeddings(tgt_in)))
        src_mask = PackedMask(keys, queries=tgt_packing, memory=src_packing)
        x = self.decoder(x, memory, src_mask, PackedMask(causal=True, queries=tgt_packing))
        return unpack(tgt_packing, x)


class PackedAttention(MultiHeadAttention):
    """MultiHeadAttention whose inputs may come packed, as a PackedMask says: their projections run on
    the real tokens and are laid out per sentence to attend; the output is packed like x."""

    def forward(self, x, memory, mask: Mask, cache=None) -> torch.Tensor:
        if not isinstance(mask, PackedMask):
            return super().forward(x, memory, mask, cache)
        if self.self_attention:
            q, k, v = self.heads(unpack(mask.queries, self.qkv(x)), 3)
        else:
            (q,) = self.heads(unpack(mask.queries, self.q(x)), 1)
            k, v = self.heads(unpack(mask.memory, self.kv(memory)), 2)
        y = self.attend(q, k, v, mask).transpose(1, 2).flatten(2)
        return self.out(pack(mask.queries, y))
