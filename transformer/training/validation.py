"""Validation during training: the loss and perplexity on the validation split, greedy BLEU against
its references, and early stopping's patience on that BLEU."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from transformer.config import Params
from transformer.data.batching import ParallelCorpus, token_batches
from transformer.data.vocab import EOS, Vocab
from transformer.decoding.translate import Search, search_batches, to_text
from transformer.evaluation.score import score_lines
from transformer.training.distributed import Dist
from transformer.training.loss import Loss
from transformer.training.record import say
from transformer.training.resume import patience_spent


@dataclass(frozen=True)
class ValidationData:
    """What validation reads: the split's token ids, its raw references (rank 0's; None: BLEU is
    not measured) and the target vocabulary that detokenizes the translations."""

    split: ParallelCorpus
    references: list[str] | None
    tgt_vocab: Vocab


@dataclass(frozen=True)
class Validation:
    """The validations of one run. Rank 0 alone measures them, since it alone holds the references
    and the history; every rank then takes its verdict on early stopping."""

    model: nn.Module
    criterion: Loss  # the training's loss, which gives the NLL with no smoothing
    data: ValidationData
    params: Params
    env: Dist
    autocast: Callable[[], contextlib.AbstractContextManager]  # the training's precision and kernels

    def measure(self) -> dict[str, float]:
        """The val_ columns of a validation: loss and perplexity, and BLEU where references are at hand."""
        val_loss, val_ppl = self.loss()
        row = {"val_loss": val_loss, "val_ppl": val_ppl}
        if self.data.references is not None:
            row["val_bleu"] = self.bleu()
        return row

    @torch.no_grad()
    def loss(self) -> tuple[float, float]:
        """Mean NLL per target token on the validation split, and its perplexity."""
        self.model.eval()
        nll, tokens = 0.0, 0
        v = self.data.split
        for index in validation_batches(v.src_lens, v.tgt_lens, self.params.train.max_tokens):
            batch = v.batch(index).to(self.env.device)
            with self.autocast():
                batch_nll = self.criterion(
                    self.model.generator, self.model(batch.src, batch.tgt_in), batch.tgt_out, 0.0
                )
            nll, tokens = nll + float(batch_nll), tokens + batch.ntokens
        return nll / tokens, math.exp(min(nll / tokens, 50))

    @torch.no_grad()
    def bleu(self) -> float:
        """sacreBLEU of greedy translations of the validation split, searched, batched and detokenized
        as the decode stage does with beam 1, against the raw references."""
        self.model.eval()
        v, d = self.data.split, self.params.decode
        encoded = [v.src[v.src_off[i] : v.src_off[i + 1]].tolist() for i in range(len(v))]
        encoded = [ids + [EOS] if ids else [] for ids in encoded]
        hyps = [""] * len(v)
        greedy = Search.of(d, beam=1, alpha=0.0)
        for batch, outputs in search_batches(self.model, encoded, greedy, self.env.device):
            for i, ids in zip(batch, outputs):
                hyps[i] = to_text(self.data.tgt_vocab, ids)
        return score_lines(hyps, self.data.references, self.params.data.tgt_lang, ("bleu",))["bleu"]

    def stops(self, bleus: list[float]) -> bool:
        """Whether train.patience stops the run after this validation. Rank 0 decides from its history
        (`bleus`) and tells the others, so that every rank stops at the same update."""
        patience = self.params.train.patience
        stopped = patience_spent(bleus, patience)
        if self.env.world > 1:
            flag = torch.tensor([int(stopped)], device=self.env.device)
            dist.broadcast(flag, 0)
            stopped = bool(flag.item())
        if stopped and self.env.main:  # the other ranks hold no history to name the best from
            say(self.env, f"val BLEU has not risen for {patience} validations (best {max(bleus):.2f}): stopping early")
        return stopped


def validation_batches(src_lens: torch.Tensor, tgt_lens: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Token batches of the validation pairs. Validation is never length-filtered: a pair longer
    than max_tokens gets a batch of its own rather than failing the end of an epoch."""
    longest = torch.maximum(src_lens, tgt_lens)
    fits, too_long = (longest <= max_tokens).nonzero().flatten(), (longest > max_tokens).nonzero().flatten()
    batches = token_batches(src_lens[fits], tgt_lens[fits], max_tokens, 0)
    return [fits[b].tolist() for b in batches] + [[i] for i in too_long.tolist()]
