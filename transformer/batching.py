"""Batches by token count (section 5.1): sentences of similar length together, little padding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.io import DataError
from transformer.vocab import BOS, EOS, PAD, BpeVocab, sample_corpus


@dataclass(frozen=True)
class Batch:
    src: torch.Tensor  # (B, S) source ids + </s>, right-padded
    tgt_in: torch.Tensor  # (B, T) <s> + target ids
    tgt_out: torch.Tensor  # (B, T) target ids + </s>
    ntokens: int  # non-pad target tokens

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(
            self.src.to(device, non_blocking=nb),
            self.tgt_in.to(device, non_blocking=nb),
            self.tgt_out.to(device, non_blocking=nb),
            self.ntokens,
        )


class ParallelCorpus:
    """Token-id arrays written by build_vocab: line i is ids[offsets[i]:offsets[i + 1]].

    The arrays are memory-mapped, not read: the processes of a node share one copy of
    them (the page cache's), and only the pages a batch touches are ever read."""

    def __init__(self, path: Path | str | None = None, data: dict[str, torch.Tensor] | None = None):
        """From build_vocab's file, or from the same arrays in memory (`data`)."""
        if data is None:
            path = Path(path)
            if not path.exists():
                raise DataError(f"{path}: token-id corpus not found (run the build_vocab stage)")
            data = torch.load(path, weights_only=True, mmap=True)
        self.src, self.src_off = data["src"], data["src_offsets"]
        self.tgt, self.tgt_off = data["tgt"], data["tgt_offsets"]
        self.src_lens = (self.src_off[1:] - self.src_off[:-1]) + 1  # + </s>
        self.tgt_lens = (self.tgt_off[1:] - self.tgt_off[:-1]) + 1  # + <s> or </s>

    def __len__(self) -> int:
        return len(self.src_lens)

    def batch(self, index: list[int]) -> Batch:
        src = [
            torch.cat([self.src[self.src_off[i] : self.src_off[i + 1]], torch.tensor([EOS], dtype=torch.int32)])
            for i in index
        ]
        tgt = [self.tgt[self.tgt_off[i] : self.tgt_off[i + 1]] for i in index]
        bos, eos = torch.tensor([BOS], dtype=torch.int32), torch.tensor([EOS], dtype=torch.int32)
        pad = torch.nn.utils.rnn.pad_sequence
        tgt_out = pad([torch.cat([t, eos]) for t in tgt], batch_first=True, padding_value=PAD).long()
        return Batch(
            pad(src, batch_first=True, padding_value=PAD).long(),
            pad([torch.cat([bos, t]) for t in tgt], batch_first=True, padding_value=PAD).long(),
            tgt_out,
            int(self.tgt_lens[index].sum()),
        )


class TrainingSplit:
    """The training pairs of each epoch: build_vocab's ids, or, with BPE-dropout, the tokenized text
    segmented afresh each epoch from a seed made of (seed, epoch), the same in every process."""

    def __init__(
        self,
        fixed: ParallelCorpus,
        vocab: BpeVocab | None = None,
        lines: tuple[list[str], list[str]] | None = None,
        dropout: float = 0.0,
        seed: int = 0,
        workers: int = 1,
    ):
        self.fixed, self.vocab, self.lines = fixed, vocab, lines or ([], [])
        self.dropout, self.seed, self.workers = dropout, seed, workers

    def epoch(self, epoch: int) -> ParallelCorpus:
        if not self.dropout:
            return self.fixed
        data = {}
        for side, lines in zip(("src", "tgt"), self.lines):
            key = f"seed {self.seed} epoch {epoch} {side}"
            data[side], data[f"{side}_offsets"] = sample_corpus(self.vocab, lines, self.dropout, key, self.workers)
        return ParallelCorpus(data=data)


def token_batches(src_lens: torch.Tensor, tgt_lens: torch.Tensor, max_tokens: int, seed: int) -> list[list[int]]:
    """Sentence indices grouped by length so that a padded batch side holds at most max_tokens.

    Same-length sentences are shuffled by `seed`, and so is the order of the batches."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(src_lens), generator=g)
    order = perm[torch.argsort(tgt_lens[perm] * 10_000 + src_lens[perm], stable=True)].tolist()
    longer_side = torch.maximum(src_lens, tgt_lens).tolist()  # a list: indexing tensors one element at a time is slow
    batches, current, longest = [], [], 0
    for i in order:
        n = longer_side[i]
        if n > max_tokens:
            raise DataError(f"sentence pair {i} has {n} tokens, more than train.max_tokens = {max_tokens}")
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def epoch_steps(batches: list[list[int]], world: int, accum: int, rank: int) -> list[list[list[int]]]:
    """The micro-batches of `rank` for each update. An update takes world * accum consecutive
    batches, rank r the r-th, (r + world)-th, ...: the global batches do not depend on how they
    are split between processes and accumulation. A last, incomplete group is dropped."""
    per_step = world * accum
    return [batches[s + rank : s + per_step : world] for s in range(0, len(batches) - per_step + 1, per_step)]
