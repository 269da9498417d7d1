"""A training run's record: its clock, the losses of its updates (checked at each host sync), the
history of its updates and validations, the step and epoch reports and the summary written from that
history, and the MLflow run it logs to (tracked_run opens and ends that). Every rank keeps the clock
and checks its own losses; rank 0 alone keeps the history, writes and logs."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from transformer import checkpoints
from transformer.config import TRAIN_SECTIONS, Params, flatten
from transformer.errors import TrainingError
from transformer.io import write_json, write_text
from transformer.kernels.memory import allocator, kernel_cache
from transformer.training.distributed import Dist, restarts
from transformer.training.resume import Progress, noting_opened_run, opened_run


def say(env: Dist, message: str) -> None:
    """A line on stderr from rank 0 alone: the other ranks would repeat it."""
    if env.main:
        print(message, file=sys.stderr, flush=True)


def progress_bar(env: Dist, total: int, initial: int, desc: str):
    """An epoch's progress bar, rank 0's: the other ranks' would repeat it."""
    from tqdm import tqdm

    disable = not env.main
    return tqdm(
        total=total, initial=initial, desc=desc, disable=disable, file=sys.stderr, mininterval=2, dynamic_ncols=True
    )


@dataclass
class Clock:
    """The run's time: a timing window over the updates since the last host sync, and the wall time
    of every invocation (the earlier ones' as the checkpoint resumed from holds it, and this one's)."""

    started: float  # this invocation's start (time.perf_counter)
    resumed_s: float
    tick: float = field(default_factory=time.perf_counter)  # the window's start
    tokens: int = 0  # the window's target tokens
    wait_s: float = 0.0  # of the window, the time the loop waited for batches
    batch_wait_s: float = 0.0  # the same, over this invocation

    def waited(self, tokens: int, wait_s: float) -> None:
        self.tokens += tokens
        self.wait_s += wait_s
        self.batch_wait_s += wait_s

    def open_window(self) -> None:
        """Opens a window now, leaving out the time since the last update."""
        self.tick, self.tokens, self.wait_s = time.perf_counter(), 0, 0.0

    def lap(self) -> tuple[float, int, float]:
        """Closes the window: its seconds, target tokens and batch wait; the next one opens now."""
        now = time.perf_counter()
        window = (max(now - self.tick, 1e-9), self.tokens, self.wait_s)
        self.tick, self.tokens, self.wait_s = now, 0, 0.0
        return window

    def wall_s(self) -> float:
        return self.resumed_s + time.perf_counter() - self.started


@dataclass(frozen=True)
class Stepped:
    """An update whose loss is not read back yet."""

    step: int
    in_epoch: int  # its index in the epoch
    loss: torch.Tensor  # summed over this rank's target tokens, on the device
    tokens: int  # this rank's target tokens
    lr: float
    skipped: torch.Tensor | None = None  # under fp16: whether the scaler skipped it (gradients overflowed)


class RunRecord:
    """What a run leaves besides its checkpoints. Every rank keeps the clock and checks the losses of
    its own updates; rank 0 alone keeps the history, writes the reports and logs to MLflow. The methods
    ask env.main where only rank 0 acts, except validated(), which only rank 0 calls, as it alone
    measures the validations."""

    def __init__(self, params: Params, env: Dist, out, progress: Progress, started: float, tracker):
        self.params, self.env, self.out, self.progress = params, env, out, progress
        self._clock = Clock(started, progress.wall_s)
        self._tracker = tracker  # rank 0's MLflow run (tracked_run), or None
        self._pending: list[Stepped] = []  # the updates whose losses are still on the device
        self._batch_shapes: dict[int, int] = {}  # epoch number: distinct batch shapes, of this invocation's epochs

    def count_shapes(self, shapes: int) -> None:
        """Records the epoch's distinct batch shapes: in train.json by epoch number, in MLflow at its first update."""
        self._batch_shapes[self.progress.epoch + 1] = shapes
        if self._tracker:  # that step also when resumed inside the epoch: one value a step
            self._tracker.log_metrics({"batch_shapes": shapes}, self.progress.step - self.progress.step_in_epoch + 1)

    def updated(self, update: Stepped, wait_s: float) -> None:
        """Holds a finished update until the next sync; `wait_s` is the time the loop waited for its batches."""
        self._pending.append(update)
        self._clock.waited(update.tokens, wait_s)

    def unread(self) -> int:
        """The number of updates whose losses the next sync reads back."""
        return len(self._pending)

    def restart_timing(self) -> None:
        """Counts training time from now on: the time since the last update went to a validation, a
        checkpoint or the planning of an epoch, none of which is training's."""
        self._clock.open_window()

    def wall_s(self) -> float:
        """The run's wall time so far, over every invocation, which a checkpoint carries so that the
        next invocation's clock goes on from it."""
        return self._clock.wall_s()

    def sync(self) -> dict[str, str]:
        """The one host sync of the loop: checks the pending losses, records and reports them."""
        if not self._pending:
            return {}
        skips = [x.skipped.float() for x in self._pending if x.skipped is not None]  # fp16's, read with the losses
        read = torch.stack([x.loss for x in self._pending] + skips).tolist()
        losses = read[: len(self._pending)]
        self.progress.skipped_updates += round(sum(read[len(self._pending) :]))
        elapsed, tokens, wait_s = self._clock.lap()
        self.progress.train_time_s += elapsed
        tokens_per_s = tokens * self.env.world / elapsed
        rows = []
        for x, loss in zip(self._pending, losses):
            if not math.isfinite(loss):
                raise TrainingError(
                    f"loss is {loss} at step {x.step} (epoch {self.progress.epoch + 1}, "
                    f"update {x.in_epoch + 1} of the epoch); stopped; "
                    f"the last good checkpoint in {self.out.checkpoints} is kept. "
                    "Lower train.factor or raise train.warmup."
                )
            rows.append({"step": x.step, "loss": loss / x.tokens, "lr": x.lr, "tokens_per_s": tokens_per_s})
        self._pending = []
        if self.env.main:
            self._keep(rows, 1000 * wait_s / len(rows), counts_skips=bool(skips))
        last = rows[-1]
        return {"loss": f"{last['loss']:.3f}", "lr": f"{last['lr']:.2e}", "tok/s": f"{tokens_per_s:,.0f}"}

    def _keep(self, rows: list[dict[str, float]], wait_ms: float, counts_skips: bool) -> None:
        """Adds the updates' rows to the run's history and logs them to MLflow, with the mean batch wait
        and, under fp16 (`counts_skips`), the count of updates that the gradient scaler has skipped so far."""
        self.progress.steps.extend(rows)
        skipped = {"skipped_updates": self.progress.skipped_updates} if counts_skips else {}
        if self._tracker:  # the wait is this invocation's, not the run's history: MLflow alone has it
            self._tracker.log_rows(rows[:-1] + [rows[-1] | {"batch_wait_ms": wait_ms} | skipped])

    def validated(self, epoch: float, measured: dict[str, float]) -> None:
        """Records a validation that rank 0 has measured (`measured`: its val_ columns), says it and logs it."""
        pr = self.progress
        recent = [r["loss"] for r in pr.steps[-200:]]
        row = {"epoch": epoch, "step": pr.step, "train_loss": sum(recent) / max(len(recent), 1)} | measured
        pr.epochs.append(row)
        bleu = f", val BLEU {row['val_bleu']:.2f}" if "val_bleu" in row else ""
        say(
            self.env,
            f"epoch {epoch:.4g}: step {pr.step}, train loss {row['train_loss']:.3f}, val loss {row['val_loss']:.3f}, "
            f"val ppl {row['val_ppl']:.2f}{bleu}, {pr.train_time_s / 60:.1f} min",
        )
        if self._tracker:
            self._tracker.log_metrics({k: v for k, v in row.items() if k.startswith("val_")}, pr.step)

    def saved(self, peaks: list[float], stopped: bool) -> None:
        """Follows a checkpoint on rank 0: every rank's memory peak (`peaks`, MiB) goes to MLflow at the
        checkpoint's step, and the reports are rewritten, so that they never lag the newest checkpoint."""
        if not self.env.main:
            return
        if self._tracker:
            self._tracker.log_metrics({f"peak_rss_mb_rank_{r}": mb for r, mb in enumerate(peaks)}, self.progress.step)
        self.report(stopped, peaks)

    def report(self, stopped: bool, peaks: list[float]) -> dict[str, Any]:
        """The run's summary (`peaks`: every rank's memory peak, MiB), which rank 0 writes with the step
        and epoch reports."""
        self.progress.wall_s = self._clock.wall_s()
        summary = _summary(self.progress, self._clock, stopped) | {
            "batch_shapes": self._batch_shapes,
            "peak_rss_mb": {f"rank_{r}": round(mb) for r, mb in enumerate(peaks)},
        }
        if self.env.main:
            self._write(summary)
        return summary

    def _write(self, summary: dict[str, Any]) -> None:
        """Writes the step and epoch reports (TSV) and the summary (JSON)."""
        pr = self.progress
        _write_tsv(self.out.steps, pr.steps, ("step", "loss", "lr", "tokens_per_s"))
        val_bleu = ("val_bleu",) if bleus(pr.epochs) else ()
        _write_tsv(self.out.epochs, pr.epochs, ("epoch", "step", "train_loss", "val_loss", "val_ppl") + val_bleu)
        write_json(self.out.summary, summary)


def _summary(pr: Progress, clock: Clock, stopped: bool) -> dict[str, Any]:
    last, recent = pr.epochs[-1] if pr.epochs else {}, pr.steps[-50:]
    return {
        "steps": pr.step,
        "epochs": last.get("epoch", 0),
        "val_loss": last.get("val_loss"),
        "val_ppl": last.get("val_ppl"),
        "val_bleu": last.get("val_bleu"),
        "best_val_bleu": max(bleus(pr.epochs), default=None),
        "stopped_early": stopped,
        "train_time_s": round(pr.train_time_s, 1),
        "wall_s": round(pr.wall_s, 1),
        "resumed_s": round(clock.resumed_s, 1),
        "tokens_per_s": round(sum(r["tokens_per_s"] for r in recent) / len(recent), 1) if recent else None,
        "batch_wait_s": round(clock.batch_wait_s, 3),
        "restarts": restarts(),  # by torchrun, in this invocation
        "skipped_updates": pr.skipped_updates,  # by fp16's gradient scaler, over the run
        "host_class": pr.host_class,
    }


@contextlib.contextmanager
def tracked_run(params: Params, env: Dist, progress: Progress, identity: dict[str, Any], ckpt_dir: Path, factory):
    """Rank 0's MLflow run of a training run, for its RunRecord to log to; None on the other ranks and
    without tracking (`factory` None). It continues the checkpoint's MLflow run, or else the one that
    an invocation killed before its first checkpoint opened under the same `identity`. It ends as
    FAILED where the body raises; otherwise its end flushes the queued metrics and stops watching the
    system, so that the next member's run may open."""
    tracker = None
    if env.main and factory is not None:
        if not progress.step:  # a run killed before its first checkpoint may have opened its MLflow run
            progress.mlflow_run_id = opened_run(ckpt_dir, identity)
            factory = noting_opened_run(factory, ckpt_dir, identity)
        tracker = start_tracking(params, progress, factory)
    try:
        yield tracker
    except BaseException:
        if tracker:
            tracker.end("FAILED")
        raise
    if tracker:
        tracker.end()


def upload(tracker, vocab_dir: Path, ckpt_dir: Path) -> None:
    """Puts a trained run's files in its MLflow run (`tracker`, None where there is none): the
    vocabulary and the final checkpoint."""
    if tracker is None:
        return
    tracker.log_artifact(vocab_dir / "vocab.json", "vocab")
    final = checkpoints.listed(ckpt_dir)
    if final:
        tracker.log_artifact(final[-1], "checkpoints")


def start_tracking(params: Params, progress: Progress, tracker_factory):
    """The training's MLflow run (the checkpoint's, where it continues one), with the params that
    train, the versions installed and the tags that place the run; it watches the machine."""
    from transformer import tracking

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
            "host_class": progress.host_class,
        }
    )
    if restarts():  # torchrun restarted the job: a metric at the step it resumed from, one a restart
        tracker.log_metrics({"restarts": restarts()}, progress.step)
    return tracker


def bleus(rows: list[dict[str, float]]) -> list[float]:
    """The val BLEU of each validation that measured it, in order."""
    return [r["val_bleu"] for r in rows if "val_bleu" in r]


def _write_tsv(path: Path, rows: list[dict[str, float]], columns: tuple[str, ...]) -> None:
    lines = ["\t".join(columns)] + ["\t".join(f"{row[c]:.6g}" if c in row else "nan" for c in columns) for row in rows]
    write_text(path, "\n".join(lines) + "\n")
