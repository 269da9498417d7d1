"""Resuming a training run: which checkpoint continues it, and what a changed param means for it.

A checkpoint records its run's identity: the params that train (config.training_params) and the
token ids. A rerun continues it when the new params train the same function step for step:

- bookkeeping never restarts a run: where checkpoints go and how many stay, whether the step is
  compiled, how often torchrun may restart a failed job, and early stopping's patience where it
  would not already have stopped the run;
- the split of an update's micro-batches between processes, nodes and accumulation does not
  either, as long as their number stays: the batches are the same (each rank draws its own
  dropout masks, so a resplit run is another draw of the same recipe);
- a longer or shorter run (epochs, max_steps) continues where the learning rate and R-Drop's
  start up to the checkpoint's step are what the new length gives them, and the new end lies
  at or beyond that step: the run so far is then a prefix of a fresh run of the new params.

Anything else restarts the run, and a restart never deletes: the old checkpoints move to a
dated folder beside the checkpoint directory, and one line names the changed keys and the folder.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from transformer import checkpoints
from transformer.config import with_added_keys
from transformer.training.distributed import Dist, broadcast, check_same_run, rank_seed
from transformer.training.schedule import rate

# never change the trained weights
BOOKKEEPING = ("keep", "save_every", "compile", "patience", "members", "max_restarts")
LENGTH = ("epochs", "max_steps")  # how far the run goes
SPLIT = ("nproc", "nnodes", "accum")  # only their product reaches the weights: the micro-batches an update sums
ASIDE = ".previous"  # <checkpoints>.previous/<UTC time>/: a restarted run's old checkpoints
OPENED = "mlflow_run.json"  # in the checkpoint directory: the MLflow run a run opened, before its first checkpoint


@dataclass
class Progress:
    """Everything that must survive a restart, besides weights and optimizer."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    train_time_s: float = 0.0
    wall_s: float = 0.0  # the run's wall time up to its newest checkpoint, over every invocation
    steps: list[dict[str, float]] = field(default_factory=list)
    epochs: list[dict[str, float]] = field(default_factory=list)
    mlflow_run_id: str | None = None
    host_class: str | None = None  # transformer.host's line, naming each class a resumed run trained on
    skipped_updates: int = 0  # by fp16's gradient scaler (training/precision.py)


def comparable(identity: dict[str, Any]) -> dict[str, Any]:
    """What two runs must share for one to continue the other: the identity without bookkeeping and
    length, and the micro-batches an update sums in place of their split."""
    params = with_added_keys(identity.get("params", {}))
    train = {k: v for k, v in params.get("train", {}).items() if k not in BOOKKEEPING + LENGTH + SPLIT}
    train["micro_batches_per_update"] = math.prod(params.get("train", {}).get(k, 1) for k in SPLIT)
    return {"params": {**params, "train": train}, "data": identity.get("data")}


def resume(ckpt_dir: Path, identity: dict, model: nn.Module, optimizer, env: Dist, epoch_updates, scaler) -> Progress:
    """Continues from rank 0's newest checkpoint, sent to every rank: nodes other than 0 need no
    copy of the checkpoint directory. Each rank takes back its own RNG state, or, where the
    checkpoint was saved by fewer ranks, starts a stream of its own. `epoch_updates(epoch)`: the
    updates of that epoch under the current params (the schedule's length). `scaler`: fp16's
    gradient scaler, which takes back its scale and growth tracker from a checkpoint of an fp16 run."""
    if env.world > 1:
        check_same_run(identity, env)
    state = read_resume_state(ckpt_dir, identity, epoch_updates) if env.main else None
    if env.world > 1:
        state = broadcast(state, env.device)
    if state is None:
        return Progress()
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if state["scaler"] is not None:  # train.precision is part of the run: only an fp16 run's has one
        scaler.load_state_dict(state["scaler"])
    progress = Progress(**state["progress"])
    if not checkpoints.restore_rng(state["rng"], env.rank, env.device):
        seed = identity["params"]["train"]["seed"]
        torch.manual_seed(rank_seed(seed, env.rank) + 1_000_003 * progress.step)
        print(f"rank {env.rank}: the checkpoint holds no stream of its own; drawing a new one", file=sys.stderr)
    return progress


def opened_run(ckpt_dir: Path, identity: dict) -> str | None:
    """The MLflow run that an invocation of this run opened and did not checkpoint (killed before its
    first checkpoint), for the rerun to continue in place of opening a second one."""
    try:
        opened = json.loads((ckpt_dir / OPENED).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return opened["run_id"] if comparable(opened["identity"]) == comparable(identity) else None


def noting_opened_run(tracker_factory, ckpt_dir: Path, identity: dict):
    """`tracker_factory` that notes the run it opens or continues at once, for opened_run to find."""
    from transformer.io import write_json

    def factory(*args, **kwargs):
        tracker = tracker_factory(*args, **kwargs)
        write_json(ckpt_dir / OPENED, {"run_id": tracker.run_id, "identity": identity})
        return tracker

    return factory


def read_resume_state(ckpt_dir: Path, identity: dict, epoch_updates) -> dict[str, Any] | None:
    """The newest checkpoint if the run it belongs to continues under `identity`; otherwise its
    checkpoints move aside and None says to start afresh."""
    found = checkpoints.listed(ckpt_dir)
    if found:
        ckpt = checkpoints.load(found[-1], checkpoints.RESUME_KEYS)
        why = restart_reason(ckpt, identity, epoch_updates)
        if why is None:
            print(f"resuming from {found[-1]} (step {ckpt['step']}, epoch {ckpt['epoch'] + 1})", file=sys.stderr)
            h = ckpt["history"]
            progress = {
                "step": ckpt["step"],
                "epoch": ckpt["epoch"],
                "step_in_epoch": ckpt["step_in_epoch"],
                "train_time_s": ckpt.get("train_time_s", 0.0),
                "wall_s": ckpt.get("wall_s", 0.0),
                "steps": h["steps"],
                "epochs": h["epochs"],
                "mlflow_run_id": ckpt.get("mlflow_run_id"),
                "host_class": ckpt.get("host_class"),
                "skipped_updates": ckpt.get("skipped_updates", 0),
            }
            kept = {k: ckpt[k] for k in ("model", "optimizer", "rng")}
            return kept | {"scaler": ckpt.get("scaler"), "progress": progress}
        aside = set_aside(ckpt_dir, found)
        print(f"{found[-1]}: not resumed, {why}; its run moved to {aside}; starting afresh", file=sys.stderr)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return None


def set_aside(ckpt_dir: Path, found: list[Path]) -> Path:
    """Moves a run's checkpoints into a new folder of <ckpt_dir>.previous named by the time."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = ckpt_dir.with_name(ckpt_dir.name + ASIDE) / stamp
    n = 1
    while aside.exists():  # two restarts within one second
        n += 1
        aside = aside.with_name(f"{stamp}-{n}")
    aside.mkdir(parents=True)
    for path in found:
        path.rename(aside / path.name)
    return aside


def restart_reason(ckpt: dict[str, Any], identity: dict, epoch_updates) -> str | None:
    """None where the checkpoint's run continues under `identity`; else why it cannot."""
    old = ckpt.get("identity")
    if not old:
        return "it records no params"
    if comparable(old) != comparable(identity):
        return changed(old, identity)
    before, now = old["params"]["train"], identity["params"]["train"]
    step = ckpt["step"]
    if any(before.get(k) != now[k] for k in LENGTH):
        why = _length_change(before, now, step, ckpt["epoch"], epoch_updates)
        if why:
            return why
    fired = _patience_fired_at(ckpt["history"]["epochs"], now["patience"])
    if fired is not None and fired < step:
        return f"train.patience {now['patience']} would have stopped the run at step {fired}, before this checkpoint"
    return None


def _length_change(before: dict, now: dict, step: int, epoch: int, epoch_updates) -> str | None:
    lengths = ", ".join(f"train.{k} was {before.get(k)!r}, now {now[k]!r}" for k in LENGTH if before.get(k) != now[k])
    if now["max_steps"] and now["max_steps"] < step or now["epochs"] < epoch:
        return f"{lengths}: the run is already past the new end"
    scheduled = now["cooldown"] > 0 or now["rdrop_from"] > 0
    if not scheduled:
        return None
    if now["bpe_dropout"] > 0:
        return f"{lengths}, and with BPE-dropout the schedule's length so far cannot be replayed"
    per_epoch = epoch_updates(epoch)
    old, new = (_planned(per_epoch, p["epochs"], p["max_steps"]) for p in (before, now))
    for s in range(step):  # d_model and factor scale both alike
        rates = [rate(s + 1, 1, 1.0, now["warmup"], total, now["cooldown"]) for total in (old, new)]
        rdrop = [s >= now["rdrop_from"] * total for total in (old, new)]
        if rates[0] != rates[1] or rdrop[0] != rdrop[1]:
            return f"{lengths}, which changes the schedule from update {s + 1}, before this checkpoint's {step}"
    return None


def _planned(per_epoch: int, epochs: int, max_steps: int) -> int:
    planned = per_epoch * epochs
    return min(planned, max_steps) if max_steps else planned


def _patience_fired_at(validations: list[dict[str, float]], patience: int) -> int | None:
    """The step of the validation at which `patience` stops a run with this history, if any."""
    bleus = []
    for row in validations:
        if "val_bleu" in row:
            bleus.append(row["val_bleu"])
            if patience_spent(bleus, patience):
                return int(row["step"])
    return None


def patience_spent(bleus: list[float], patience: int) -> bool:
    """True once the last `patience` validations all scored no higher than the best before them."""
    if not patience or len(bleus) <= patience:
        return False
    return max(bleus[-patience:]) <= max(bleus[:-patience])


def changed(old: dict, new: dict) -> str:
    """What differs between a checkpoint's run and this one: the vocabulary, the data, or the
    params (every changed key, as the comparison sees them)."""
    if old.get("data", "")[:16] != new["data"][:16]:
        return "the vocabulary (vocab.pt) changed"
    if old.get("data") != new["data"]:
        return "the training data (token ids) changed"
    before, now = comparable(old)["params"], comparable(new)["params"]
    keys = []
    for section, values in now.items():
        for key, value in values.items():
            was = before.get(section, {}).get(key)
            if was != value:
                shown = "train.nproc * nnodes * accum" if key == "micro_batches_per_update" else f"{section}.{key}"
                keys.append(f"{shown} was {was!r}, now {value!r}")
    return "; ".join(keys) or "its params differ"
