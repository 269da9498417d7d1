"""The training loss against its definition (section 5.4), written out by hand."""

from __future__ import annotations

import pytest
import torch

from transformer.loss import token_loss
from transformer.model import make_model

PAD = 2


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_token_loss_is_smoothed_cross_entropy_over_real_tokens(smoothing):
    torch.manual_seed(0)
    vocab = 20
    model = make_model(vocab, vocab, N=1, d_model=16, d_ff=32, h=2, dropout=0.0, norm="pre", tie_embeddings=True,
                       pad=PAD).eval()
    tgt_out = torch.tensor([[5, 6, 1, PAD], [7, 1, PAD, PAD]])
    hidden = torch.randn(2, 4, 16)

    log_probs = torch.log_softmax(model.generator(hidden), dim=-1).detach()
    expected = 0.0
    for row, col in (tgt_out != PAD).nonzero().tolist():
        target = torch.full((vocab,), smoothing / vocab)
        target[tgt_out[row, col]] += 1 - smoothing
        expected -= float((target * log_probs[row, col]).sum())

    assert float(token_loss(model, hidden, tgt_out, PAD, smoothing).detach()) == pytest.approx(expected, rel=1e-5)
