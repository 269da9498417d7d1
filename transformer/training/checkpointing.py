"""Checkpointing during training: what a checkpoint of a running model holds, and which ones stay.
Every rank takes part in a save, since each keeps random generators of its own; rank 0 writes the
file, through a writer.Writer (on a GPU, in the background). resume.py reads the newest one back."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.amp import GradScaler
from torch.optim import Optimizer

from transformer import checkpoints
from transformer.config import Params
from transformer.errors import TrainingError
from transformer.kernels.memory import peak_rss_mb
from transformer.training.distributed import Dist, gathered, rank_seed
from transformer.training.resume import Progress
from transformer.training.writer import Writer


@dataclass(frozen=True)
class Checkpointer:
    """The checkpoints of one run, in `directory`. A checkpoint is a plain dict: the weights, the
    optimizer and fp16's gradient scaler, the run's Progress, every rank's random generators, and
    the constants (`meta`) that let the file be decoded or resumed on its own."""

    directory: Path
    params: Params
    env: Dist
    progress: Progress
    meta: dict[str, Any]  # model_config, vocab and identity: the same in every checkpoint of the run
    model: nn.Module
    optimizer: Optimizer
    scaler: GradScaler
    writer: Writer  # writer_for(device): on a GPU, each checkpoint is written while the training goes on

    def save(self, wall_s: float) -> list[float]:
        """Checkpoints the run at its current step, as of `wall_s` seconds of wall time over every
        invocation, and prunes the old checkpoints. Every rank calls it, because the generators are
        gathered from each; the resident-set peaks (MiB) of the ranks travel in the same gather, so
        they are returned for the run's record."""
        # Each rank resumes its own dropout masks from its own generators.
        ranks = gathered({"rng": checkpoints.rng_state(self.env.device), "peak": peak_rss_mb()}, self.env)
        if self.env.main:
            self._write([r["rng"] for r in ranks], wall_s)
        return [r["peak"] for r in ranks]

    def _write(self, rng: list[dict], wall_s: float) -> None:
        """Rank 0's part of a save. A loss read as finite can still be followed by an update that
        overflows the weights, so they are checked first: non-finite weights stop the run and leave the
        last good checkpoint in place, once the write still in flight has made it whole."""
        pr = self.progress
        self.writer.wait()
        _check_finite(self.model, pr, self.directory)
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler.is_enabled():  # other checkpoints hold none, as those written before fp16
            state["scaler"] = self.scaler.state_dict()
        run = _run_state(self.params, self.env, pr, rng, wall_s)
        a = self.params.average  # with select best, its candidates stay until better ones replace them
        best = checkpoints.best_steps(checkpoints.scores_of(pr.epochs), a.last_k) if a.select == "best" else []
        prune = functools.partial(checkpoints.prune, self.directory, self.params.train.keep, best)
        self.writer.write(checkpoints.path_for(self.directory, pr.step), state, run | self.meta, prune)


def _check_finite(model: nn.Module, pr: Progress, kept: Path) -> None:
    broken = next((name for name, t in model.named_parameters() if not torch.isfinite(t).all()), None)
    if broken:
        raise TrainingError(
            f"parameter '{broken}' became non-finite at step {pr.step} (epoch {pr.epoch + 1}); stopped; "
            f"the last good checkpoint in {kept} is kept. Lower train.factor or raise train.warmup."
        )


def _run_state(params: Params, env: Dist, pr: Progress, rng: list[dict], wall_s: float) -> dict[str, Any]:
    """What a checkpoint holds of the run besides its weights, its optimizer and its constants: built
    afresh for each checkpoint, its history lists copied (their rows never change once recorded), so
    that a write in the background sees the run as it stood at the save."""
    return {
        "params": params.to_dict(),
        "step": pr.step,
        "epoch": pr.epoch,
        "step_in_epoch": pr.step_in_epoch,
        "train_time_s": pr.train_time_s,
        "wall_s": wall_s,
        "rng": {"cpu": [r["cpu"] for r in rng], "cuda": [r["cuda"] for r in rng]},
        "rank_seeds": [rank_seed(params.train.seed, r) for r in range(env.world)],
        "history": {"steps": list(pr.steps), "epochs": list(pr.epochs)},
        "mlflow_run_id": pr.mlflow_run_id,
        "host_class": pr.host_class,
        "skipped_updates": pr.skipped_updates,
    }
