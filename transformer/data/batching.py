"""Batches by token count (section 5.1): sentences of similar length together, little padding."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.data.vocab import BOS, EOS, PAD, BpeVocab, sample_corpus
from transformer.io import DataError


@dataclass(frozen=True)
class Batch:
    src: torch.Tensor  # (B, S) source ids + </s>, right-padded
    tgt_in: torch.Tensor  # (B, T) <s> + target ids
    tgt_out: torch.Tensor  # (B, T) target ids + </s>
    ntokens: int  # non-pad target tokens

    def to(self, device: torch.device) -> Batch:
        """On `device`; from pinned memory (Batch.pinned) a CUDA copy does not wait for the host."""
        nb = device.type == "cuda"
        return Batch(
            self.src.to(device, non_blocking=nb),
            self.tgt_in.to(device, non_blocking=nb),
            self.tgt_out.to(device, non_blocking=nb),
            self.ntokens,
        )

    def pinned(self) -> Batch:
        return Batch(self.src.pin_memory(), self.tgt_in.pin_memory(), self.tgt_out.pin_memory(), self.ntokens)


@dataclass(frozen=True)
class Update:
    """One update's share of this rank: its micro-batches, and the target tokens they and all ranks hold."""

    batches: list[Batch]
    total: int  # target tokens of the update, every rank's micro-batches together
    mine: int  # target tokens of this rank's micro-batches
    wait_s: float  # how long the step loop waited for it


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

    def batch(self, index: list[int], multiple: int = 1) -> Batch:
        """Pairs `index` as padded tensors, built as whole-batch gathers, not sentence by sentence;
        each side padded to its longest line, rounded up to a multiple of `multiple`."""
        rows = torch.tensor(index)
        _, S, T = self.shape(index, multiple)
        (src,) = _lines(self.src, self.src_off, rows, S, bos=(False,))
        tgt_in, tgt_out = _lines(self.tgt, self.tgt_off, rows, T, bos=(True, False))
        return Batch(src, tgt_in, tgt_out, self.tokens(index))

    def shape(self, index: list[int], multiple: int = 1) -> tuple[int, int, int]:
        """(B, S, T) of batch(index, multiple): src is (B, S), tgt_in and tgt_out are (B, T)."""
        S, T = (_round_up(int(lens[index].max()), multiple) for lens in (self.src_lens, self.tgt_lens))
        return len(index), S, T

    def tokens(self, index: list[int]) -> int:
        """Target tokens (non-pad) of pairs `index`."""
        return int(self.tgt_lens[index].sum())


def _round_up(n, multiple: int):
    """n (an int or a tensor of them) rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def batch_shapes(corpus: ParallelCorpus, groups: list[list[list[int]]], multiple: int) -> int:
    """How many distinct (src, tgt_in) shapes the micro-batches of `groups` (an epoch's updates) have:
    kernels specialized to a shape (torch.compile's static ones, cuDNN's plans) are made for each."""
    return len({corpus.shape(index, multiple) for group in groups for index in group})


def _lines(
    ids: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, width: int, bos: tuple[bool, ...]
) -> list[torch.Tensor]:
    """Lines `rows` of a corpus right-padded with PAD to `width`, gathered once and laid out once for
    each of `bos`: with <s> before each line (True) or </s> after it (False)."""
    starts = offsets[rows].long()
    lens = offsets[rows + 1].long() - starts
    line = torch.repeat_interleave(torch.arange(len(rows)), lens)
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    values = ids[torch.repeat_interleave(starts, lens) + within].long()
    outs = []
    for before in bos:
        out = torch.full((len(rows), width), PAD, dtype=torch.long)
        out[line, within + int(before)] = values
        if before:
            out[:, 0] = BOS
        else:
            out[torch.arange(len(rows)), lens] = EOS
        outs.append(out)
    return outs


class Prefetch:
    """This rank's batches of the coming updates, built by a thread of their own while the step runs
    (pinned for the copy where the device is CUDA), at most `depth` updates ahead. A context manager:
    leaving it stops the thread, also when the loop stops early; the thread's error is raised in the loop."""

    def __init__(
        self, corpus: ParallelCorpus, groups: list[list[list[int]]], rank: int, world: int, device, multiple=1, depth=2
    ):
        self.corpus, self.groups, self.rank, self.world, self.multiple = corpus, groups, rank, world, multiple
        self.pin = device.type == "cuda"
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._build, name="batches", daemon=True)

    def __enter__(self) -> Prefetch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        while self.thread.is_alive():  # unblock a put waiting for room
            try:
                self.queue.get_nowait()
            except queue.Empty:
                self.thread.join(timeout=0.01)

    def __iter__(self):
        for _ in self.groups:
            start = time.perf_counter()
            item = self.queue.get()
            if isinstance(item, BaseException):
                raise item
            batches, total, mine = item
            yield Update(batches, total, mine, time.perf_counter() - start)

    def _build(self) -> None:
        try:
            for group in self.groups:
                mine = group[self.rank :: self.world]
                batches = [self.corpus.batch(index, self.multiple) for index in mine]
                if self.pin:
                    batches = [b.pinned() for b in batches]
                if not self._put((batches, sum(self.corpus.tokens(b) for b in group), sum(b.ntokens for b in batches))):
                    return
        except BaseException as e:  # noqa: BLE001 - raised again in the loop
            self._put(e)

    def _put(self, item) -> bool:
        """Waits for room in the queue; False when the loop has gone."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False


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


def token_batches(
    src_lens: torch.Tensor, tgt_lens: torch.Tensor, max_tokens: int, seed: int, multiple: int = 1
) -> list[list[int]]:
    """Sentence indices grouped by length so that a batch side, padded to its longest line rounded up
    to a multiple of `multiple` (ParallelCorpus.batch), holds at most max_tokens.

    Same-length sentences are shuffled by `seed`, and so is the order of the batches."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(src_lens), generator=g)
    order = perm[torch.argsort(tgt_lens[perm] * 10_000 + src_lens[perm], stable=True)].tolist()
    # a list: indexing tensors one element at a time is slow
    longer_side = _round_up(torch.maximum(src_lens, tgt_lens), multiple).tolist()
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
