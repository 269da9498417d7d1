"""Training (section 5): token batches, Adam with warmup, label smoothing, DDP, resumable.

train() prepares each run (an ensemble's member) and hands it to a Trainer, which runs the epochs and
updates. The Trainer calls three parts, each of which keeps its own state: validation.Validation
measures the validations and decides early stopping; checkpointing.Checkpointer saves and prunes the
checkpoints; record.RunRecord keeps the clock, the losses, the reports and the MLflow run. Where only
rank 0 acts, the part or the Trainer asks env.main."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from transformer import checkpoints
from transformer.config import Params, TrainConfig, training_params
from transformer.data.batching import (
    Batch,
    ParallelCorpus,
    Prefetch,
    TrainingSplit,
    Update,
    batch_shapes,
    epoch_steps,
    token_batches,
)
from transformer.data.vocab import PAD, load_vocabs, vocab_from_state
from transformer.errors import DataError, TrainingError
from transformer.evaluation import system
from transformer.io import read_lines, sha256_file
from transformer.kernels.accelerate import accelerate
from transformer.kernels.memory import keep_freed_memory, peak_rss_mb, release_freed_memory
from transformer.model.model import make_model
from transformer.training.checkpointing import Checkpointer
from transformer.training.distributed import Dist, gathered, process_group, rank_seed, wrap_ddp
from transformer.training.loss import Loss, batch_loss
from transformer.training.precision import Precision
from transformer.training.record import RunRecord, Stepped, bleus, progress_bar, say, tracked_run, upload
from transformer.training.resume import Progress, patience_spent, resume
from transformer.training.schedule import rate
from transformer.training.validation import Validation, ValidationData
from transformer.training.writer import writer_for

LOG_EVERY = 20  # updates between host syncs (loss check, progress, metrics)
RELEASE_EVERY = 200  # updates between hand-backs of freed CPU memory (release_freed_memory)


@dataclass(frozen=True)
class Outputs:
    """Where training writes; dvc.yaml's command line names every path."""

    checkpoints: Path  # directory
    steps: Path  # per-update report (TSV)
    epochs: Path  # per-epoch report (TSV)
    summary: Path  # the run's metrics (JSON)

    def member(self, k: int, seed: int) -> Outputs:
        """Where member k of an ensemble writes: the first here, each further one in its
        checkpoints.member_dir, with its reports beside its checkpoints."""
        if k == 0:
            return self
        where = checkpoints.member_dir(self.checkpoints, k, seed)
        return Outputs(where, where / self.steps.name, where / self.epochs.name, where / self.summary.name)


@dataclass(frozen=True)
class Inputs:
    """What training reads besides its params: see train()."""

    vocab_dir: Path
    tokenized: Path | None
    references: Path | None


def data_fingerprint(vocab_dir: Path, train_split: str) -> str:
    return sha256_file(vocab_dir / "vocab.pt")[:16] + sha256_file(vocab_dir / f"{train_split}.pt")[:16]


def train(
    params: Params,
    vocab_dir: Path,
    out: Outputs,
    tracker_factory=None,
    tokenized: Path | None = None,
    references: Path | None = None,
) -> list[dict[str, Any]]:
    """Trains (or resumes) the train.members models in turn, member k exactly as a single run with
    seed train.seed + k, where Outputs.member says; rank 0 writes checkpoints, reports and tracking
    (`tracker_factory`: tracking.open_run, or None). `tokenized`: the tokenize stage's directory, read
    when train.bpe_dropout > 0. With the raw reference translations of the validation split, each
    validation also measures greedy BLEU. Their summaries, in member order."""
    seeds, p = params.train.member_seeds(), params.train
    inputs = Inputs(vocab_dir, tokenized, references)
    summaries, uploads = [], []
    with process_group(p.nproc, p.nnodes) as env:  # one group for every member
        for k, seed in enumerate(seeds):
            member = dataclasses.replace(params, train=dataclasses.replace(p, seed=seed, members=1))
            outputs = out.member(k, seed)
            if len(seeds) > 1:
                say(env, f"member {k + 1} of {len(seeds)}: seed {seed}, in {outputs.checkpoints}")
            summary, upload = _train(member, env, inputs, outputs, tracker_factory)
            summaries.append(summary)
            uploads.append(upload)
    for upload in uploads:  # once every rank has left the group: an upload may outlast a collective's timeout
        upload()
    return summaries


def _train(params: Params, env: Dist, inputs: Inputs, out: Outputs, tracker_factory):
    """One run inside the process group: its summary, and rank 0's uploads to call later."""
    started = time.perf_counter()
    if env.device.type == "cpu":
        keep_freed_memory()
    setup, progress, meta = _prepare(params, env, inputs, out)
    writer = writer_for(env.device)
    checkpointer = Checkpointer(
        directory=out.checkpoints,
        params=params,
        env=env,
        progress=progress,
        meta=meta,
        model=setup.model,
        optimizer=setup.optimizer,
        scaler=setup.precision.scaler,
        writer=writer,
    )
    # The writer's block ends once the last checkpoint is whole on disk: before the run's MLflow run
    # ends, and before the upload that reads the checkpoint.
    with tracked_run(params, env, progress, meta["identity"], out.checkpoints, tracker_factory) as tracker, writer:
        record = RunRecord(params, env, out, progress, started, tracker)
        try:
            summary = Trainer(setup, progress, record, checkpointer).run()
        except torch.cuda.OutOfMemoryError:
            raise TrainingError(
                f"out of GPU memory at step {progress.step + 1}: lower train.max_tokens "
                f"(now {params.train.max_tokens}) and raise train.accum to keep the tokens per update"
            ) from None
    return summary, functools.partial(upload, tracker, inputs.vocab_dir, out.checkpoints)


@dataclass(frozen=True)
class Setup:
    """What _prepare builds for a Trainer: the run's params, processes, model and data."""

    params: Params
    env: Dist
    model: nn.Module
    optimizer: torch.optim.Optimizer
    split: TrainingSplit  # the training pairs, re-segmented each epoch under BPE-dropout
    valid: ValidationData
    precision: Precision  # its autocast, and under fp16 the gradient scaler


def _prepare(params: Params, env: Dist, inputs: Inputs, out: Outputs) -> tuple[Setup, Progress, dict[str, Any]]:
    """The run's data, model and optimizer, resumed from its newest checkpoint where it continues; and
    what every checkpoint carries besides the run's state."""
    p = params.train
    torch.manual_seed(p.seed)  # the same initial weights on every rank
    src_vocab, tgt_vocab = load_vocabs(inputs.vocab_dir)
    split = _training_split(params, inputs, src_vocab)
    valid = ParallelCorpus(inputs.vocab_dir / f"{params.data.valid}.pt")
    refs = _references(inputs.references, len(valid), p.patience, env.main)
    model = make_model(**_model_config(params, src_vocab, tgt_vocab))
    model.to(env.device)
    optimizer = make_optimizer(model, p.weight_decay, env.device)
    precision = Precision(p.precision, env.device)
    if env.rank:
        torch.manual_seed(rank_seed(p.seed, env.rank))  # dropout's masks: a stream of its own
    # Not train.members: a run trained alone resumes, or stays finished, as the first member of an ensemble.
    identity = {"params": training_params(params.to_dict()), "data": data_fingerprint(inputs.vocab_dir, "train")}
    progress = resume(
        out.checkpoints,
        identity,
        model,
        optimizer,
        env,
        lambda epoch: len(epoch_groups(split.fixed, p, epoch)),
        scaler=precision.scaler,
    )
    progress.host_class = system.after(progress.host_class, system.host_class())
    meta = {
        "model_config": _model_config(params, src_vocab, tgt_vocab),
        "vocab": {"src": src_vocab.state(), "tgt": tgt_vocab.state()},
        "identity": identity,
    }
    valid = ValidationData(valid, refs, vocab_from_state(meta["vocab"]["tgt"]))
    return Setup(params, env, model, optimizer, split=split, valid=valid, precision=precision), progress, meta


def make_optimizer(model: nn.Module, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    """The paper's Adam (section 5.3); with weight_decay > 0, AdamW's decoupled decay of the weight
    matrices and embeddings (norm gains and biases are not decayed). Its rate is set per update."""
    fused = device.type in ("cuda", "cpu")  # one kernel updates every tensor
    kwargs = {"lr": 0.0, "betas": (0.9, 0.98), "eps": 1e-9, "fused": fused}
    if not weight_decay:
        return torch.optim.Adam(model.parameters(), **kwargs)
    params = list(model.parameters())
    groups = [
        {"params": [w for w in params if w.dim() > 1], "weight_decay": weight_decay},
        {"params": [w for w in params if w.dim() <= 1], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, **kwargs)


def _training_split(params: Params, inputs: Inputs, vocab) -> TrainingSplit:
    vocab_dir, tokenized = inputs.vocab_dir, inputs.tokenized
    fixed, dropout = ParallelCorpus(vocab_dir / "train.pt"), params.train.bpe_dropout
    if not dropout:
        return TrainingSplit(fixed)
    if tokenized is None:
        raise TrainingError(
            "train.bpe_dropout > 0 segments the tokenized training text afresh each epoch: "
            "pass its directory (stages/train.py --tokenized data/tokenized)"
        )
    d = params.data
    lines = tuple(read_lines(tokenized / f"train.{lang}") for lang in (d.src_lang, d.tgt_lang))
    for lang, side in zip((d.src_lang, d.tgt_lang), lines):
        if len(side) != len(fixed):
            raise DataError(
                f"{tokenized / f'train.{lang}'}: {len(side)} lines, but {vocab_dir / 'train.pt'} holds "
                f"{len(fixed)} pairs: the tokenized text and the vocabulary come from different runs"
            )
    # Each rank segments the whole split (the same ids everywhere), on its share of the node's cores.
    workers = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return TrainingSplit(fixed, vocab, lines, dropout=dropout, seed=params.train.seed, workers=workers)


def _references(path: Path | None, lines: int, patience: int, main: bool) -> list[str] | None:
    """The validation references, one per validation pair, read by rank 0 alone (it validates);
    without them BLEU is not measured."""
    if path is None and patience:
        raise TrainingError("train.patience stops on val BLEU, which needs the validation references (--references)")
    if path is None or not main:
        return None
    refs = read_lines(path)
    if len(refs) != lines:
        raise DataError(f"{path}: {len(refs)} reference lines, but the validation split has {lines} pairs")
    return refs


def epoch_groups(corpus: ParallelCorpus, p: TrainConfig, epoch: int) -> list[list[list[int]]]:
    """An epoch's updates, each the micro-batches (index lists) that its ranks and accumulation sum."""
    batches = token_batches(corpus.src_lens, corpus.tgt_lens, p.max_tokens, p.seed * 100_003 + epoch, p.pad_multiple)
    return epoch_steps(batches, 1, p.nproc * p.nnodes * p.accum, 0)


def epoch_corpus(split: TrainingSplit, epoch: int, env: Dist) -> ParallelCorpus:
    """The training pairs of an epoch: the fixed ids, or under BPE-dropout a segmentation of the epoch's
    own. Rank 0 reports how long that segmentation took and how much it grew the tokens, since it
    delays the epoch's first update."""
    if not split.dropout:
        return split.fixed
    start = time.perf_counter()
    corpus, fixed = split.epoch(epoch), split.fixed
    grown = (len(corpus.src) + len(corpus.tgt)) / max(len(fixed.src) + len(fixed.tgt), 1)
    say(
        env,
        f"epoch {epoch + 1}: BPE-dropout {split.dropout} segmented {len(corpus):,} pairs in "
        f"{time.perf_counter() - start:.1f} s, {grown:.2f}x the tokens",
    )
    return corpus


def rdrop_alpha(step: int, alpha: float, start: float, planned_updates: int) -> float:
    """R-Drop's alpha for the update after `step`: `alpha` (train.rdrop) from the `start` fraction
    (train.rdrop_from) of the planned updates on, 0 before. It is a function of the step, so that a
    resumed run switches where the uninterrupted one does."""
    return alpha if step >= start * planned_updates else 0.0


def _model_config(params: Params, src_vocab, tgt_vocab) -> dict[str, Any]:
    # The model section's keys are Transformer's keyword arguments.
    return {"src_vocab": len(src_vocab), "tgt_vocab": len(tgt_vocab), "pad": PAD} | dataclasses.asdict(params.model)


class StepLoss(nn.Module):
    """A micro-batch's training loss (loss.batch_loss) as one module around the model and the loss, so
    that DDP wraps, torch.compile traces and accelerate swaps them together."""

    def __init__(self, model: nn.Module, loss: Loss, shared_encoder: bool = False, share: float = 1.0):
        super().__init__()
        self.model, self.loss = model, loss
        self.shared_encoder, self.share = shared_encoder, share

    def forward(self, batch: Batch, rdrop: float = 0.0) -> torch.Tensor:
        """The loss summed over the batch's target tokens; R-Drop's with rdrop > 0."""
        m = self.model
        return batch_loss(
            m, m.generator, batch, self.loss, rdrop=rdrop, shared_encoder=self.shared_encoder, share=self.share
        )


def compiled(step: nn.Module, backend: str = "inductor") -> nn.Module:
    """`step` under torch.compile, every size of the batch symbolic from the first trace on: token
    batches change B, S and T all the time, and a trace for each would soon hit dynamo's recompile limit."""
    return torch.compile(step, dynamic=True, backend=backend)


class Trainer:
    """The epochs and updates of one run, each update the paper's Adam step at the schedule's rate on
    the summed micro-batch losses of every rank. It decides when to validate (at each epoch's end, and
    every train.eval_every updates) and when to checkpoint (after each validation, and every
    train.save_every updates); the Validation, the Checkpointer and the RunRecord do the rest."""

    def __init__(self, setup: Setup, progress: Progress, record: RunRecord, checkpointer: Checkpointer):
        self.params, self.p, self.env = setup.params, setup.params.train, setup.env
        self.model, self.optimizer, self.split = setup.model, setup.optimizer, setup.split
        self.progress, self.record, self.checkpointer = progress, record, checkpointer
        p = self.p
        loss = Loss(PAD, p.label_smoothing, p.smoothing_zeroes_pad)
        step = StepLoss(self.model, loss, p.rdrop_shared_encoder, p.rdrop_share)
        if not p.compile:  # compiled, the plain step is traced and fused by torch instead
            accelerate(step, self.env.device)
        ddp = wrap_ddp(step, p.ddp_bf16_grads) if self.env.world > 1 else step
        self.step_model = compiled(ddp) if p.compile else ddp
        self.corpus = setup.split.fixed  # the current epoch's pairs
        self.precision = setup.precision
        self.validation = Validation(self.model, loss, setup.valid, self.params, self.env, self.precision.autocast)
        self.planned_updates = 0  # set once the first epoch's batches are known
        self.stopped, self.validated_at = False, -1

    def run(self) -> dict[str, Any]:
        """Trains to the end of the last epoch, of train.max_steps or of early stopping's patience,
        and returns the run's summary."""
        pr, p = self.progress, self.p
        # Every rank resumed the same history; later, rank 0 alone records validations.
        self.stopped = patience_spent(bleus(pr.epochs), p.patience)
        self.validated_at = pr.epochs[-1]["step"] if pr.epochs else -1
        while pr.epoch < p.epochs and not self._done():
            self._epoch(self._plan())
            if self._done():
                break
            pr.epoch, pr.step_in_epoch = pr.epoch + 1, 0
            self._validate_and_save(pr.epoch)
        finished_here = self.validated_at == pr.step  # a rerun of a finished run adds nothing
        if pr.step_in_epoch and not finished_here:  # stopped by max_steps inside an epoch
            self._validate_and_save(pr.epoch + 1)
        return self.record.report(self.stopped, gathered(peak_rss_mb(), self.env))

    def _plan(self) -> list[list[list[int]]]:
        """The epoch's updates, every rank's (_update takes this rank's share), and the run's length."""
        pr, p = self.progress, self.p
        self.corpus = epoch_corpus(self.split, pr.epoch, self.env)
        groups = epoch_groups(self.corpus, p, pr.epoch)
        if not groups:
            raise TrainingError(
                f"epoch {pr.epoch + 1} has fewer than train.nproc * nnodes * accum batches; "
                "lower them or train.max_tokens"
            )
        # With fixed ids every epoch has as many updates; sampled segmentations change the count a
        # little. Planning the epochs left at this epoch's length is exact for the last epoch, so a
        # cooldown still ends at the last update, and a resumed run plans as the uninterrupted one.
        planned = pr.step - pr.step_in_epoch + len(groups) * (p.epochs - pr.epoch)
        self.planned_updates = min(planned, p.max_steps) if p.max_steps else planned
        self.record.count_shapes(batch_shapes(self.corpus, groups, p.pad_multiple))
        return groups

    def _done(self) -> bool:
        return 0 < self.p.max_steps <= self.progress.step or self.stopped

    def _epoch(self, groups: list[list[list[int]]]) -> None:
        """Runs the epoch's updates from where the run stands in it: a run resumed mid-epoch skips those done."""
        pr, env = self.progress, self.env
        bar = progress_bar(env, len(groups), pr.step_in_epoch, f"epoch {pr.epoch + 1}/{self.p.epochs}")
        self.record.restart_timing()
        left = groups[pr.step_in_epoch :]
        with Prefetch(self.corpus, left, env.rank, env.world, env.device, self.p.pad_multiple) as updates:
            for update in updates:
                self._update(update)
                bar.update(1)
                self._after_update(len(groups), bar)
                if self._done():
                    break
        bar.close()

    def _after_update(self, updates: int, bar) -> None:
        """The host sync every LOG_EVERY updates, and the validations and checkpoints the params ask for."""
        pr, p = self.progress, self.p
        if self.record.unread() >= LOG_EVERY:
            bar.set_postfix(self.record.sync())
        if self.env.device.type == "cpu" and pr.step % RELEASE_EVERY == 0:
            release_freed_memory()
        if p.eval_every and pr.step % p.eval_every == 0 and pr.step_in_epoch < updates:
            self._validate_and_save(pr.epoch + pr.step_in_epoch / updates)  # the epoch's end validates anyway
            self.record.restart_timing()  # training time leaves validation out, as at epoch ends
        elif p.save_every and pr.step % p.save_every == 0:
            self._save()

    def _update(self, update: Update) -> None:
        """One update of the weights. It reads nothing back to the host, so that the device never waits:
        its loss stays on the device until the record's next sync."""
        pr, env, p = self.progress, self.env, self.p
        lr = rate(pr.step + 1, self.params.model.d_model, p.factor, p.warmup, self.planned_updates, p.cooldown)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        rdrop = rdrop_alpha(pr.step, p.rdrop, p.rdrop_from, self.planned_updates)
        self.model.train()
        loss_sum = torch.zeros((), device=env.device)
        for i, batch in enumerate(update.batches):
            batch = batch.to(env.device)
            last = i == len(update.batches) - 1
            sync = self.step_model.no_sync() if env.world > 1 and not last else contextlib.nullcontext()
            with sync, self.precision.autocast():
                loss = self.step_model(batch, rdrop)
                self.precision.backward(loss * (env.world / update.total))
            loss_sum += loss.detach()
        skipped = self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        stepped = Stepped(pr.step + 1, pr.step_in_epoch, loss_sum, update.mine, lr, skipped=skipped)
        self.record.updated(stepped, update.wait_s)
        pr.step += 1
        pr.step_in_epoch += 1

    def _validate_and_save(self, epoch: float) -> None:
        """A validation, which rank 0 alone measures (the loss, and BLEU with references), then a
        checkpoint, then early stopping's verdict, which every rank takes."""
        self.record.sync()
        if self.env.main:
            self.record.validated(epoch, self.validation.measure())
        self.validated_at = self.progress.step
        self._save()
        if self.p.patience:
            self.stopped = self.validation.stops(bleus(self.progress.epochs))

    def _save(self) -> None:
        self.record.sync()  # never checkpoint weights whose losses were not checked
        peaks = self.checkpointer.save(self.record.wall_s())
        self.record.saved(peaks, self.stopped)
