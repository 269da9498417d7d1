"""Training (section 5): token batches, Adam with warmup, label smoothing, DDP, resumable."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from transformer import checkpoints
from transformer.config import TRAIN_SECTIONS, Params, TrainConfig, flatten, training_params
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
from transformer.data.vocab import EOS, PAD, load_vocabs, vocab_from_state
from transformer.decoding.translate import search_batches, to_text
from transformer.errors import DataError, TrainingError
from transformer.evaluation.score import score_lines
from transformer.io import read_lines, sha256_file, write_json, write_text
from transformer.kernels.memory import allocator, keep_freed_memory, kernel_cache, peak_rss_mb, release_freed_memory
from transformer.model.attention import attention_kernels
from transformer.model.model import make_model
from transformer.training.distributed import Dist, process_group, rank_seed, restarts, set_precision, wrap_ddp
from transformer.training.loss import batch_loss, token_loss
from transformer.training.resume import Progress, noting_opened_run, opened_run, patience_spent, resume
from transformer.training.schedule import rate

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


def data_fingerprint(vocab_dir: Path, train_split: str) -> str:
    return sha256_file(vocab_dir / "vocab.pt")[:16] + sha256_file(vocab_dir / f"{train_split}.pt")[:16]


def train(
    params: Params,
    vocab_dir: Path,
    out: Outputs,
    tracker_factory=None,
    tokenized: Path | None = None,
    references: Path | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) to the end; rank 0 writes checkpoints, reports and tracking.
    `tokenized`: the tokenize stage's directory, read when train.bpe_dropout > 0. With the raw
    reference translations of the validation split, each validation also measures greedy BLEU."""
    started = time.perf_counter()
    with process_group(params.train.nproc, params.train.nnodes) as env:
        summary, upload = _train(params, env, vocab_dir, out, tracker_factory, tokenized, references, started)
    upload()
    return summary


def _train(
    params: Params,
    env: Dist,
    vocab_dir: Path,
    out: Outputs,
    tracker_factory,
    tokenized: Path | None,
    references: Path | None,
    started: float,
) -> tuple[dict[str, Any], Callable[[], None]]:
    """train() inside a process group: the run's summary, and rank 0's uploads to call once every
    rank has left the group (an upload may outlast a collective's timeout)."""
    if env.device.type == "cpu":
        keep_freed_memory()
    p = params.train
    torch.manual_seed(p.seed)  # the same initial weights on every rank
    src_vocab, tgt_vocab = load_vocabs(vocab_dir)
    corpus = _training_split(params, vocab_dir, tokenized, src_vocab)
    valid = ParallelCorpus(vocab_dir / f"{params.data.valid}.pt")
    refs = _references(references, len(valid), p.patience, env.main)
    model = make_model(**_model_config(params, src_vocab, tgt_vocab))
    model.to(env.device)
    optimizer = make_optimizer(model, p.weight_decay, env.device)
    if env.rank:
        torch.manual_seed(rank_seed(p.seed, env.rank))  # dropout's masks: a stream of its own
    # Not train.members: a run trained alone resumes, or stays finished, as the first member of an ensemble.
    identity = {"params": training_params(params.to_dict()), "data": data_fingerprint(vocab_dir, "train")}
    progress = resume(
        out.checkpoints, identity, model, optimizer, env, lambda epoch: len(epoch_groups(corpus.fixed, p, epoch))
    )
    if env.main and tracker_factory and not progress.step:  # a run killed before its first checkpoint: its MLflow run
        progress.mlflow_run_id = opened_run(out.checkpoints, identity)
        tracker_factory = noting_opened_run(tracker_factory, out.checkpoints, identity)
    tracker = _start_tracking(params, progress, tracker_factory) if env.main else None
    setup = Setup(
        params=params,
        env=env,
        model=model,
        optimizer=optimizer,
        split=corpus,
        valid=valid,
        references=refs,
        out=out,
        meta={
            "model_config": _model_config(params, src_vocab, tgt_vocab),
            "vocab": {"src": src_vocab.state(), "tgt": tgt_vocab.state()},
            "identity": identity,
        },
    )
    loop = _Loop(setup, progress, tracker, started)
    try:
        summary = loop.run()
    except torch.cuda.OutOfMemoryError:
        if tracker:
            tracker.end("FAILED")
        raise TrainingError(
            f"out of GPU memory at step {progress.step + 1}: lower train.max_tokens "
            f"(now {p.max_tokens}) and raise train.accum to keep the tokens per update"
        ) from None
    except BaseException:
        if tracker:
            tracker.end("FAILED")
        raise
    if tracker:  # flushes the queued metrics and stops watching the system before the next member trains
        tracker.end()
    return summary, functools.partial(_upload, tracker, vocab_dir, out.checkpoints)


def _upload(tracker, vocab_dir: Path, ckpt_dir: Path) -> None:
    """Rank 0's files of a trained run in MLflow: the vocabulary and the final checkpoint."""
    if tracker is None:
        return
    tracker.log_artifact(vocab_dir / "vocab.json", "vocab")
    final = checkpoints.listed(ckpt_dir)
    if final:
        tracker.log_artifact(final[-1], "checkpoints")


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


def train_members(
    params: Params,
    vocab_dir: Path,
    out: Outputs,
    tracker_factory=None,
    tokenized: Path | None = None,
    references: Path | None = None,
) -> list[dict[str, Any]]:
    """Trains (or resumes) the train.members models in turn, member k exactly as a single run with
    seed train.seed + k, where Outputs.member says. Their summaries, in member order."""
    seeds, p = params.train.member_seeds(), params.train
    summaries, uploads = [], []
    with process_group(p.nproc, p.nnodes) as env:  # one group for every member
        for k, seed in enumerate(seeds):
            member = dataclasses.replace(params, train=dataclasses.replace(p, seed=seed, members=1))
            outputs = out.member(k, seed)
            if len(seeds) > 1 and env.main:
                where = f"seed {seed}, in {outputs.checkpoints}"
                print(f"member {k + 1} of {len(seeds)}: {where}", file=sys.stderr, flush=True)
            started = time.perf_counter()
            summary, upload = _train(member, env, vocab_dir, outputs, tracker_factory, tokenized, references, started)
            summaries.append(summary)
            uploads.append(upload)
    for upload in uploads:
        upload()
    return summaries


def _training_split(params: Params, vocab_dir: Path, tokenized: Path | None, vocab) -> TrainingSplit:
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
    return TrainingSplit(fixed, vocab, lines, dropout, params.train.seed, workers)


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


def _model_config(params: Params, src_vocab, tgt_vocab) -> dict[str, Any]:
    # The model section's keys are Transformer's keyword arguments.
    return {"src_vocab": len(src_vocab), "tgt_vocab": len(tgt_vocab), "pad": PAD} | dataclasses.asdict(params.model)


def _start_tracking(params: Params, progress: Progress, tracker_factory):
    from transformer import tracking

    if tracker_factory is None:
        return None
    d = params.data
    tracker = tracker_factory(
        tracking.experiment_name(d.corpus, d.src_lang, d.tgt_lang), progress.mlflow_run_id, tracking.run_name("train")
    )
    resumed = progress.mlflow_run_id == tracker.run_id
    progress.mlflow_run_id = tracker.run_id
    tracker.watch_system(resumed)
    trained_by = {
        k: v for k, v in flatten(params).items() if k.split(".")[0] in TRAIN_SECTIONS
    }  # evaluations log the rest
    tracker.log_params(trained_by | tracking.installed_versions())
    tracker.set_tags(
        {
            "git_commit": tracking.git_commit(),
            "dvc_exp_name": tracking.dvc_exp_name(),
            "allocator": allocator(),
            "kernel_cache": kernel_cache(),
            "corpus": d.corpus,
            "direction": f"{d.src_lang}-{d.tgt_lang}",
        }
    )
    if restarts():  # torchrun restarted the job: a metric at the step it resumed from, one a restart
        tracker.log_metrics({"restarts": restarts()}, progress.step)
    return tracker


@dataclass(frozen=True)
class Setup:
    """What train() prepares for the loop: the run's params, processes, model and data."""

    params: Params
    env: Dist
    model: nn.Module
    optimizer: torch.optim.Optimizer
    split: TrainingSplit  # the training pairs, re-segmented each epoch under BPE-dropout
    valid: ParallelCorpus
    references: list[str] | None  # the validation split's raw references (rank 0's), for val BLEU
    out: Outputs
    meta: dict[str, Any]  # what every checkpoint carries besides the run's state


class StepLoss(nn.Module):
    """A micro-batch's training loss (loss.batch_loss) as one module around the model, so that DDP
    wraps, and torch.compile traces, the model, its generator and the loss together."""

    def __init__(self, model: nn.Module, smoothing: float, zero_pad=False, shared_encoder=False, share=1.0):
        super().__init__()
        self.model, self.smoothing, self.zero_pad = model, smoothing, zero_pad
        self.shared_encoder, self.share = shared_encoder, share

    def forward(self, batch: Batch, rdrop: float = 0.0) -> torch.Tensor:
        """The loss summed over the batch's target tokens; R-Drop's with rdrop > 0."""
        m = self.model
        return batch_loss(m, m, batch, PAD, self.smoothing, rdrop, self.zero_pad, self.shared_encoder, self.share)


def compiled(step: nn.Module, backend: str = "inductor") -> nn.Module:
    """`step` under torch.compile, every size of the batch symbolic from the first trace on: token
    batches change B, S and T all the time, and a trace for each would soon hit dynamo's recompile limit."""
    return torch.compile(step, dynamic=True, backend=backend)


class _Loop:
    def __init__(self, setup: Setup, progress: Progress, tracker, started: float):
        self.params, self.p, self.env = setup.params, setup.params.train, setup.env
        self.model, self.optimizer = setup.model, setup.optimizer
        p = self.p
        step = StepLoss(self.model, p.label_smoothing, p.smoothing_zeroes_pad, p.rdrop_shared_encoder, p.rdrop_share)
        ddp = wrap_ddp(step, p.ddp_bf16_grads) if self.env.world > 1 else step
        self.step_model = compiled(ddp) if p.compile else ddp
        self.split, self.valid, self.progress, self.tracker = setup.split, setup.valid, progress, tracker
        self.corpus = setup.split.fixed  # the current epoch's pairs
        self.out, self.ckpt_dir, self.meta = setup.out, setup.out.checkpoints, setup.meta
        self.bf16 = set_precision(self.p.precision, self.env.device)
        self.pending: list[tuple[int, int, torch.Tensor, int, float]] = []  # step, batch, loss sum, tokens, lr
        self.planned_updates = 0  # set once the first epoch's batches are known
        self.tick, self.tick_tokens = time.perf_counter(), 0  # start and target tokens of the current timing window
        self.tick_wait_s = 0.0  # of the window, the time the loop waited for batches
        self.batch_wait_s = 0.0  # the same, over this invocation
        self.batch_shapes: dict[int, int] = {}  # epoch number: distinct batch shapes, of this invocation's epochs
        self.peaks: list[float] = []  # every rank's peak resident set (MiB), as of the last collective
        self.references, self.stopped = setup.references, False
        # The run's wall time: the earlier invocations' (as the checkpoint resumed from holds it) and this one's.
        self.resumed_s, self.started = progress.wall_s, started
        self.tgt_vocab = vocab_from_state(self.meta["vocab"]["tgt"])

    def run(self) -> dict[str, Any]:
        pr, p = self.progress, self.p
        # Every rank resumed the same history; later, rank 0 alone records validations.
        self.stopped = patience_spent(_bleus(pr.epochs), p.patience)
        self.validated_at = pr.epochs[-1]["step"] if pr.epochs else -1
        while pr.epoch < p.epochs and not self._done():
            self.corpus = self._epoch_corpus()
            groups = epoch_groups(self.corpus, p, pr.epoch)  # global; _update takes this rank's share
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
            self._count_shapes(groups)
            self._epoch(groups)
            if self._done():
                break
            pr.epoch, pr.step_in_epoch = pr.epoch + 1, 0
            self._end_of_epoch()
        finished_here = self.validated_at == pr.step  # a rerun of a finished run adds nothing
        if pr.step_in_epoch and not finished_here:  # stopped by max_steps inside an epoch
            self._end_of_epoch(partial=True)
        self.peaks = self._gathered(peak_rss_mb())
        return self._write_reports()

    def _gathered(self, mine: Any) -> list[Any]:
        """`mine` of every rank, in rank order; a collective: every rank calls it."""
        if self.env.world == 1:
            return [mine]
        ranks = [None] * self.env.world
        dist.all_gather_object(ranks, mine)
        return ranks

    def _count_shapes(self, groups: list[list[list[int]]]) -> None:
        """The distinct batch shapes of the epoch's micro-batches, every rank's: in train.json by epoch
        number, in MLflow at the epoch's first update."""
        epoch = self.progress.epoch + 1
        self.batch_shapes[epoch] = batch_shapes(self.corpus, groups, self.p.pad_multiple)
        if self.tracker:
            self.tracker.log_metrics({"batch_shapes": self.batch_shapes[epoch]}, self.progress.step + 1)

    def _epoch_corpus(self) -> ParallelCorpus:
        if not self.split.dropout:
            return self.split.fixed
        start = time.perf_counter()
        corpus = self.split.epoch(self.progress.epoch)
        if self.env.main:
            grown = (len(corpus.src) + len(corpus.tgt)) / max(len(self.split.fixed.src) + len(self.split.fixed.tgt), 1)
            print(
                f"epoch {self.progress.epoch + 1}: BPE-dropout {self.split.dropout} segmented {len(corpus):,} pairs in "
                f"{time.perf_counter() - start:.1f} s, {grown:.2f}x the tokens",
                file=sys.stderr,
            )
        return corpus

    def _done(self) -> bool:
        return 0 < self.p.max_steps <= self.progress.step or self.stopped

    def _epoch(self, groups: list[list[list[int]]]) -> None:
        from tqdm import tqdm

        pr = self.progress
        bar = tqdm(
            total=len(groups),
            initial=pr.step_in_epoch,
            desc=f"epoch {pr.epoch + 1}/{self.p.epochs}",
            disable=not self.env.main,
            file=sys.stderr,
            mininterval=2,
            dynamic_ncols=True,
        )
        self.tick, self.tick_tokens, self.tick_wait_s = time.perf_counter(), 0, 0.0
        env = self.env
        left = groups[pr.step_in_epoch :]
        with Prefetch(self.corpus, left, env.rank, env.world, env.device, self.p.pad_multiple) as updates:
            for update in updates:
                self._update(update)
                bar.update(1)
                if len(self.pending) >= LOG_EVERY:
                    bar.set_postfix(self._sync())
                if env.device.type == "cpu" and pr.step % RELEASE_EVERY == 0:
                    release_freed_memory()
                if self.p.eval_every and pr.step % self.p.eval_every == 0 and pr.step_in_epoch < len(groups):
                    self._validate_and_save(
                        pr.epoch + pr.step_in_epoch / len(groups)
                    )  # the epoch's end validates anyway
                    self.tick = time.perf_counter()  # training time leaves validation out, as at epoch ends
                elif self.p.save_every and pr.step % self.p.save_every == 0:
                    self._save()
                if self._done():
                    break
        bar.close()

    def _update(self, update: Update) -> None:
        pr, env = self.progress, self.env
        lr = rate(
            pr.step + 1, self.params.model.d_model, self.p.factor, self.p.warmup, self.planned_updates, self.p.cooldown
        )
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        loss_sum = torch.zeros((), device=env.device)
        for i, batch in enumerate(update.batches):
            batch = batch.to(env.device)
            last = i == len(update.batches) - 1
            sync = self.step_model.no_sync() if env.world > 1 and not last else contextlib.nullcontext()
            with sync, self.autocast():
                loss = self._loss(batch)
                (loss * (env.world / update.total)).backward()
            loss_sum += loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.append((pr.step + 1, pr.step_in_epoch, loss_sum, update.mine, lr))
        self.tick_tokens += update.mine
        self.tick_wait_s += update.wait_s
        self.batch_wait_s += update.wait_s
        pr.step += 1
        pr.step_in_epoch += 1

    def _loss(self, batch) -> torch.Tensor:
        """loss.batch_loss with this run's smoothing and R-Drop params."""
        return self.step_model(batch, self._rdrop())

    def _rdrop(self) -> float:
        """R-Drop's alpha for the current update: train.rdrop from the train.rdrop_from fraction of the
        planned updates on, 0 before. A function of the step, so a resumed run switches where the
        uninterrupted one does."""
        return self.p.rdrop if self.progress.step >= self.p.rdrop_from * self.planned_updates else 0.0

    def autocast(self) -> contextlib.ExitStack:
        """bf16 autocast where enabled, with the attention kernels that suit it."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.env.device.type, dtype=torch.bfloat16, enabled=self.bf16))
        stack.enter_context(attention_kernels(self.env.device, self.bf16))
        return stack

    def _sync(self) -> dict[str, str]:
        """The one host sync of the loop: checks losses, records and reports them."""
        if not self.pending:
            return {}
        losses = torch.stack([x[2] for x in self.pending]).tolist()
        now = time.perf_counter()
        elapsed = max(now - self.tick, 1e-9)
        self.progress.train_time_s += elapsed
        tokens_per_s = self.tick_tokens * self.env.world / elapsed
        rows = []
        for (step, batch, _, tokens, lr), loss in zip(self.pending, losses):
            if not math.isfinite(loss):
                raise TrainingError(
                    f"loss is {loss} at step {step} (epoch {self.progress.epoch + 1}, "
                    f"update {batch + 1} of the epoch); stopped; "
                    f"the last good checkpoint in {self.ckpt_dir} is kept. Lower train.factor or raise train.warmup."
                )
            rows.append({"step": step, "loss": loss / tokens, "lr": lr, "tokens_per_s": tokens_per_s})
        wait_ms = 1000 * self.tick_wait_s / len(rows)
        self.pending, self.tick, self.tick_tokens, self.tick_wait_s = [], now, 0, 0.0
        if self.env.main:
            self.progress.steps.extend(rows)
            if self.tracker:  # the wait is this invocation's, not the run's history: MLflow alone has it
                self.tracker.log_rows(rows[:-1] + [rows[-1] | {"batch_wait_ms": wait_ms}])
        last = rows[-1]
        return {"loss": f"{last['loss']:.3f}", "lr": f"{last['lr']:.2e}", "tok/s": f"{tokens_per_s:,.0f}"}

    @torch.no_grad()
    def validate(self) -> tuple[float, float]:
        """Mean NLL per target token on the validation split, and its perplexity."""
        self.model.eval()
        nll, tokens = 0.0, 0
        for index in validation_batches(self.valid.src_lens, self.valid.tgt_lens, self.p.max_tokens):
            batch = self.valid.batch(index).to(self.env.device)
            with self.autocast():
                batch_nll = token_loss(self.model, self.model(batch.src, batch.tgt_in), batch.tgt_out, PAD, 0.0)
            nll, tokens = nll + float(batch_nll), tokens + batch.ntokens
        return nll / tokens, math.exp(min(nll / tokens, 50))

    @torch.no_grad()
    def validate_bleu(self) -> float:
        """sacreBLEU of greedy translations of the validation split, searched, batched and detokenized
        as the decode stage does with beam 1, against the raw references."""
        self.model.eval()
        v, d = self.valid, self.params.decode
        encoded = [v.src[v.src_off[i] : v.src_off[i + 1]].tolist() for i in range(len(v))]
        encoded = [ids + [EOS] if ids else [] for ids in encoded]
        hyps = [""] * len(v)
        for batch, outputs in search_batches(
            self.model, encoded, 1, 0.0, d.max_len_extra, d.batch_tokens, self.env.device
        ):
            for i, ids in zip(batch, outputs):
                hyps[i] = to_text(self.tgt_vocab, ids)
        return score_lines(hyps, self.references, self.params.data.tgt_lang, ("bleu",))["bleu"]

    def _end_of_epoch(self, partial: bool = False) -> None:
        self._validate_and_save(self.progress.epoch + (1 if partial else 0))

    def _validate_and_save(self, epoch: float) -> None:
        """Validation on rank 0 (loss, and BLEU with references), a checkpoint, then the early-stopping verdict."""
        self._sync()
        pr = self.progress
        if self.env.main:
            val_loss, val_ppl = self.validate()
            recent = [r["loss"] for r in pr.steps[-200:]]
            row = {
                "epoch": epoch,
                "step": pr.step,
                "train_loss": sum(recent) / max(len(recent), 1),
                "val_loss": val_loss,
                "val_ppl": val_ppl,
            }
            if self.references is not None:
                row["val_bleu"] = self.validate_bleu()
            pr.epochs.append(row)
            bleu = f", val BLEU {row['val_bleu']:.2f}" if "val_bleu" in row else ""
            print(
                f"epoch {epoch:.4g}: step {pr.step}, train loss {row['train_loss']:.3f}, val loss {val_loss:.3f}, "
                f"val ppl {val_ppl:.2f}{bleu}, {pr.train_time_s / 60:.1f} min",
                file=sys.stderr,
            )
            if self.tracker:
                self.tracker.log_metrics({k: v for k, v in row.items() if k.startswith("val_")}, pr.step)
        self.validated_at = pr.step
        self._save()
        self._check_patience()

    def _check_patience(self) -> None:
        """Rank 0 decides from the history and tells the others, so every rank stops at the same update."""
        if not self.p.patience:
            return
        stopped = self.env.main and patience_spent(_bleus(self.progress.epochs), self.p.patience)
        if self.env.world > 1:
            flag = torch.tensor([int(stopped)], device=self.env.device)
            dist.broadcast(flag, 0)
            stopped = bool(flag.item())
        if stopped and self.env.main:
            print(
                f"val BLEU has not risen for {self.p.patience} validations "
                f"(best {max(_bleus(self.progress.epochs)):.2f}): stopping early",
                file=sys.stderr,
            )
        self.stopped = stopped

    def _save(self) -> None:
        self._sync()  # never checkpoint weights whose losses were not checked
        # Every rank's generators, so that each resumes its own dropout masks, and its memory peak.
        ranks = self._gathered({"rng": checkpoints.rng_state(self.env.device), "peak": peak_rss_mb()})
        rng, self.peaks = [r["rng"] for r in ranks], [r["peak"] for r in ranks]
        if not self.env.main:
            return
        pr = self.progress
        # A finite loss was computed before the last update, which can still overflow the weights.
        broken = next((name for name, t in self.model.named_parameters() if not torch.isfinite(t).all()), None)
        if broken:
            raise TrainingError(
                f"parameter '{broken}' became non-finite at step {pr.step} (epoch {pr.epoch + 1}); stopped; "
                f"the last good checkpoint in {self.ckpt_dir} is kept. Lower train.factor or raise train.warmup."
            )
        path = checkpoints.path_for(self.ckpt_dir, pr.step)
        self._clock()
        checkpoints.save(
            path,
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "params": self.params.to_dict(),
                "step": pr.step,
                "epoch": pr.epoch,
                "step_in_epoch": pr.step_in_epoch,
                "train_time_s": pr.train_time_s,
                "wall_s": pr.wall_s,
                "rng": {"cpu": [r["cpu"] for r in rng], "cuda": [r["cuda"] for r in rng]},
                "rank_seeds": [rank_seed(self.p.seed, r) for r in range(self.env.world)],
                "history": {"steps": pr.steps, "epochs": pr.epochs},
                "mlflow_run_id": pr.mlflow_run_id,
                **self.meta,
            },
        )
        a = self.params.average  # with select best, its candidates stay until better ones replace them
        best = checkpoints.best_steps(checkpoints.scores_of(pr.epochs), a.last_k) if a.select == "best" else []
        checkpoints.prune(self.ckpt_dir, self.p.keep, best)
        if self.tracker:
            self.tracker.log_metrics({f"peak_rss_mb_rank_{r}": mb for r, mb in enumerate(self.peaks)}, pr.step)
        self._write_reports()

    def _clock(self) -> None:
        self.progress.wall_s = self.resumed_s + time.perf_counter() - self.started

    def _write_reports(self) -> dict[str, Any]:
        self._clock()
        pr = self.progress
        last = pr.epochs[-1] if pr.epochs else {}
        recent = pr.steps[-50:]
        bleus = _bleus(pr.epochs)
        summary = {
            "steps": pr.step,
            "epochs": last.get("epoch", 0),
            "val_loss": last.get("val_loss"),
            "val_ppl": last.get("val_ppl"),
            "val_bleu": last.get("val_bleu"),
            "best_val_bleu": max(bleus, default=None),
            "stopped_early": self.stopped,
            "train_time_s": round(pr.train_time_s, 1),
            "wall_s": round(pr.wall_s, 1),
            "resumed_s": round(self.resumed_s, 1),
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in recent) / len(recent), 1) if recent else None,
            "batch_wait_s": round(self.batch_wait_s, 3),
            "batch_shapes": self.batch_shapes,
            "peak_rss_mb": {f"rank_{r}": round(mb) for r, mb in enumerate(self.peaks)},
            "restarts": restarts(),  # by torchrun, in this invocation
        }
        if self.env.main:
            _write_tsv(self.out.steps, pr.steps, ("step", "loss", "lr", "tokens_per_s"))
            columns = ("epoch", "step", "train_loss", "val_loss", "val_ppl") + (("val_bleu",) if bleus else ())
            _write_tsv(self.out.epochs, pr.epochs, columns)
            write_json(self.out.summary, summary)
        return summary


def validation_batches(src_lens: torch.Tensor, tgt_lens: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Token batches of the validation pairs. Validation is never length-filtered: a pair longer
    than max_tokens gets a batch of its own rather than failing the end of an epoch."""
    longest = torch.maximum(src_lens, tgt_lens)
    fits, too_long = (longest <= max_tokens).nonzero().flatten(), (longest > max_tokens).nonzero().flatten()
    batches = token_batches(src_lens[fits], tgt_lens[fits], max_tokens, 0)
    return [fits[b].tolist() for b in batches] + [[i] for i in too_long.tolist()]


def _bleus(rows: list[dict[str, float]]) -> list[float]:
    """The val BLEU of each validation that measured it, in order."""
    return [r["val_bleu"] for r in rows if "val_bleu" in r]


def _write_tsv(path: Path, rows: list[dict[str, float]], columns: tuple[str, ...]) -> None:
    lines = ["\t".join(columns)] + ["\t".join(f"{row[c]:.6g}" if c in row else "nan" for c in columns) for row in rows]
    write_text(path, "\n".join(lines) + "\n")
