"""Embeddings and positional encoding (sections 3.4 and 3.5)."""

from __future__ import annotations

import math

import torch
from torch import nn


class Embeddings(nn.Module):
    """Token embeddings scaled by sqrt(d_model)."""

    def __init__(self, vocab: int, d_model: int):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lut(tokens) * self.scale


class PositionalEncoding(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same); grown on demand."""

    def __init__(self, d_model: int, max_len: int = 1024):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("pe", self._table(max_len), persistent=False)

    def _table(self, max_len: int) -> torch.Tensor:
        position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / self.d_model)
        )
        pe = torch.zeros(max_len, self.d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return pe

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        end = start + x.size(1)
        if end > self.pe.size(0):
            self.pe = self._table(2 * end).to(self.pe.device)
        return x + self.pe[start:end]
