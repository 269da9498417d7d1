"""torch.compile as a way to apply speed: the plain training step traces whole, with few recompiles."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from transformer.data.batching import ParallelCorpus, batch_shapes, epoch_steps, token_batches
from transformer.data.vocab import PAD
from transformer.training.loss import Loss
from transformer.training.train import StepLoss

# Graphs dynamo may trace over an epoch of token batches with every size symbolic: the first batch's,
# and one more where the first had two sizes equal by chance (dynamo assumed them equal) or a size
# it specializes on (a batch of one sentence, a side of one token).
RECOMPILES = 3


def _epoch(pairs: int = 300, seed: int = 0) -> tuple[ParallelCorpus, list[list[int]]]:
    """A corpus of sentences 1 to 14 tokens long, and an epoch of its token batches (sizes and lengths vary)."""
    g = torch.Generator().manual_seed(seed)
    lens = {side: torch.randint(1, 15, (pairs,), generator=g) for side in ("src", "tgt")}
    data = {side: torch.randint(4, 40, (int(n.sum()),), generator=g, dtype=torch.int32) for side, n in lens.items()}
    offsets = {f"{s}_offsets": torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]) for s, n in lens.items()}
    corpus = ParallelCorpus(data=data | offsets)
    return corpus, token_batches(corpus.src_lens, corpus.tgt_lens, 200, seed)


@pytest.mark.parametrize(
    "rdrop, share, shared_encoder", [(0.0, 1.0, False), (5.0, 1.0, False), (5.0, 0.5, False), (5.0, 1.0, True)]
)
def test_a_training_step_compiles_whole_with_few_recompiles(rdrop, share, shared_encoder):
    """fullgraph=True: a graph break anywhere in the model, R-Drop or the loss raises. The backend is
    dynamo's own (no code generated): breaks and recompiles are dynamo's, whichever backend follows."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = tiny_model(src_vocab=40, tgt_vocab=40, dropout=0.1, tie_embeddings=True).train()
    step = StepLoss(model, Loss(PAD, 0.1), shared_encoder=shared_encoder, share=share)
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="eager")
    corpus, batches = _epoch()
    assert batch_shapes(corpus, epoch_steps(batches, 1, 1, 0), 1) >= 20  # each a graph of its own if sizes were static
    for index in batches:
        compiled(corpus.batch(index), rdrop).backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= RECOMPILES
