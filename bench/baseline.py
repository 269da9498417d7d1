"""The seed-style baseline for bench.py: the paper's model computed the plain way.

This is the architecture as the seed code (the Annotated Transformer) computes it, written
from the paper for benchmarking only; it is not part of the package and nothing trains with it:

- attention materializes the (B, h, T, S) score matrix, masks it with masked_fill, applies
  softmax and dropout on the probabilities; Q, K and V are three separate Linear layers;
- LayerNorm by hand, a_2 * (x - mean) / (std + eps) + b_2 (unbiased std, eps outside the root);
- pre-norm sub-layers x + Dropout(Sublayer(LayerNorm(x))) and a final LayerNorm per stack;
- dropout inside the feed-forward network too;
- separate source, target and generator weights (the seed's word vocabularies are not joint);
- generator = Linear + log_softmax over every position, padding included; label smoothing
  builds the full (n, V) target distribution for nn.KLDivLoss(reduction="sum");
- greedy decoding one sentence at a time, re-running the decoder over the whole prefix.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LayerNorm(nn.Module):
    """Layer normalization written out, as the seed has it."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(d_model))
        self.b_2 = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout: nn.Dropout
) -> torch.Tensor:
    """Section 3.2.1 with the scores in memory: softmax(QKᵀ/√d_k)V."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, h, T, S)
    scores = scores.masked_fill(mask == 0, -1e9)
    return dropout(scores.softmax(-1)) @ v  # (B, h, T, d_k)


class MultiHeadedAttention(nn.Module):
    """Section 3.2.2 with one Linear per projection."""

    def __init__(self, d_model: int, h: int, dropout: float):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B = query.size(0)
        q, k, v = (
            w(x).view(B, -1, self.h, self.d_k).transpose(1, 2)  # (B, h, L, d_k)
            for w, x in ((self.w_q, query), (self.w_k, key), (self.w_v, value))
        )
        y = attention(q, k, v, mask.unsqueeze(1), self.dropout)  # mask broadcast over heads
        return self.w_o(y.transpose(1, 2).contiguous().view(B, -1, self.h * self.d_k))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.dropout(self.w_1(x).relu()))


class Sublayer(nn.Module):
    """x + Dropout(Sublayer(LayerNorm(x))): the Annotated Transformer's pre-norm."""

    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.norm = LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, d_ff: int, h: int, dropout: float):
        super().__init__()
        self.self_attn = MultiHeadedAttention(d_model, h, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.sublayers = nn.ModuleList(Sublayer(d_model, dropout) for _ in range(2))

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.sublayers[0](x, lambda y: self.self_attn(y, y, y, src_mask))
        return self.sublayers[1](x, self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, d_ff: int, h: int, dropout: float):
        super().__init__()
        self.self_attn = MultiHeadedAttention(d_model, h, dropout)
        self.src_attn = MultiHeadedAttention(d_model, h, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.sublayers = nn.ModuleList(Sublayer(d_model, dropout) for _ in range(3))

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, tgt_mask: torch.Tensor
    ) -> torch.Tensor:
        x = self.sublayers[0](x, lambda y: self.self_attn(y, y, y, tgt_mask))
        x = self.sublayers[1](x, lambda y: self.src_attn(y, memory, memory, src_mask))
        return self.sublayers[2](x, self.ff)


class Embed(nn.Module):
    """Token embedding × √d_model plus the sinusoidal positional encoding, then dropout."""

    def __init__(self, vocab: int, d_model: int, dropout: float, max_len: int = 5000):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(d_model)
        position = torch.arange(max_len, dtype=torch.float32)[:, None]
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
        self.register_buffer("pe", pe[None], persistent=False)  # (1, max_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.lut(tokens) * self.scale + self.pe[:, : tokens.size(1)])


class Baseline(nn.Module):
    """Figure 1, pre-norm, with a generator that returns log-probabilities."""

    def __init__(self, src_vocab: int, tgt_vocab: int, N: int, d_model: int, d_ff: int, h: int, dropout: float):
        super().__init__()
        self.src_embed, self.tgt_embed = Embed(src_vocab, d_model, dropout), Embed(tgt_vocab, d_model, dropout)
        self.encoder = nn.ModuleList(EncoderLayer(d_model, d_ff, h, dropout) for _ in range(N))
        self.decoder = nn.ModuleList(DecoderLayer(d_model, d_ff, h, dropout) for _ in range(N))
        self.encoder_norm, self.decoder_norm = LayerNorm(d_model), LayerNorm(d_model)
        self.proj = nn.Linear(d_model, tgt_vocab)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.src_embed(src)  # (B, S, d_model)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decode(
        self, memory: torch.Tensor, src_mask: torch.Tensor, tgt: torch.Tensor, tgt_mask: torch.Tensor
    ) -> torch.Tensor:
        x = self.tgt_embed(tgt)  # (B, T, d_model)
        for layer in self.decoder:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.decoder_norm(x)

    def generator(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.proj(x), dim=-1)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, pad: int) -> torch.Tensor:
        """Log-probabilities (B, T, V) at every target position, padding included."""
        src_mask = (src != pad).unsqueeze(-2)  # (B, 1, S)
        return self.generator(self.decode(self.encode(src, src_mask), src_mask, tgt_in, target_mask(tgt_in, pad)))


def subsequent_mask(size: int) -> torch.Tensor:
    return torch.ones(1, size, size, dtype=torch.bool).tril()  # (1, T, T): True where a key may be attended


def target_mask(tgt: torch.Tensor, pad: int) -> torch.Tensor:
    return (tgt != pad).unsqueeze(-2) & subsequent_mask(tgt.size(-1))  # (B, T, T)


def make_baseline(
    src_vocab: int, tgt_vocab: int, N: int, d_model: int, d_ff: int, h: int, dropout: float = 0.1
) -> Baseline:
    """Builds the baseline, Xavier-uniform on every matrix as the seed does."""
    model = Baseline(src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


class LabelSmoothing(nn.Module):
    """Section 5.4 the seed's way: KL divergence to an explicit smoothed target distribution.

    ε is spread over the V - 2 classes that are neither the target nor padding; padding
    rows get an all-zero distribution, so they add nothing but still cost the full (n, V)."""

    def __init__(self, vocab: int, pad: int, smoothing: float):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.vocab, self.pad = vocab, pad
        self.smoothing, self.confidence = smoothing, 1.0 - smoothing

    def forward(self, log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        true_dist = torch.full_like(log_probs, self.smoothing / (self.vocab - 2))  # (n, V)
        true_dist.scatter_(1, target[:, None], self.confidence)
        true_dist[:, self.pad] = 0
        true_dist[target == self.pad] = 0
        return self.criterion(log_probs, true_dist)


def train_step(
    model: Baseline,
    criterion: LabelSmoothing,
    optimizer: torch.optim.Optimizer,
    src: torch.Tensor,
    tgt_in: torch.Tensor,
    tgt_out: torch.Tensor,
    pad: int,
) -> torch.Tensor:
    """One update on one batch; the loss is normalized by the number of real target tokens."""
    log_probs = model(src, tgt_in, pad)  # (B, T, V)
    ntokens = (tgt_out != pad).sum()
    loss = criterion(log_probs.view(-1, log_probs.size(-1)), tgt_out.reshape(-1)) / ntokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@torch.no_grad()
def greedy_decode(model: Baseline, src: torch.Tensor, max_len: int, bos: int, pad: int) -> list[int]:
    """One sentence (1, S): the argmax token, max_len times, each step re-decoding the whole
    prefix with no cache. Like the seed, it does not stop at </s>."""
    src_mask = (src != pad).unsqueeze(-2)
    memory = model.encode(src, src_mask)
    ys = torch.full((1, 1), bos, dtype=torch.long)
    for _ in range(max_len):
        out = model.decode(memory, src_mask, ys, subsequent_mask(ys.size(1)))
        next_word = model.generator(out[:, -1]).argmax(-1)  # (1,)
        ys = torch.cat([ys, next_word[:, None]], dim=1)
    return ys[0, 1:].tolist()
