"""Checkpoints as plain dicts: written atomically, read with weights_only, averaged."""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from transformer.config import training_params
from transformer.io import DataError, save_torch

PATTERN = re.compile(r"^ckpt_(\d+)\.pt$")
MODEL_KEYS = ("model", "model_config", "params", "vocab", "step")
MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive; its legacy format, a pickle
RESUME_KEYS = MODEL_KEYS + ("optimizer", "epoch", "step_in_epoch", "rng", "history")


def save(path: Path, checkpoint: dict[str, Any]) -> None:
    """Atomic: a failure (disk full, kill) leaves the previous file, never a torn one."""
    save_torch(checkpoint, path)


def load(path: Path | str, required: tuple[str, ...] = MODEL_KEYS) -> dict[str, Any]:
    """Loads without executing pickled code; any defect raises DataError naming the file."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: checkpoint not found")
    with open(path, "rb") as f:
        head = f.read(4)
    if head and not head.startswith(MAGIC):  # empty: truncated, below
        raise DataError(
            f"{path}: not a model file of this project (those are PyTorch files written by the "
            f"train or average_checkpoints stage)"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((line.strip() for line in str(e).splitlines() if "WeightsUnpickler error" in line), "")
        raise DataError(
            f"{path}: refused to load: it holds pickled objects other than weights, "
            f"which could run code; only load checkpoints written by this project. {why}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise DataError(
            f"{path}: truncated or corrupt checkpoint ({(str(e).splitlines() or [type(e).__name__])[0]})"
        ) from None
    if not isinstance(checkpoint, dict):
        raise DataError(f"{path}: not a checkpoint (a {type(checkpoint).__name__}, not a dict)")
    missing = [k for k in required if k not in checkpoint]
    if missing:
        raise DataError(f"{path}: checkpoint lacks {', '.join(missing)}")
    return checkpoint


def member_dir(ckpt_dir: Path, k: int, seed: int) -> Path:
    """Where member k of an ensemble trains: the first where a single model would, each further one
    in seed<S>/ below it, so that adding members keeps the models already trained."""
    return ckpt_dir if k == 0 else ckpt_dir / f"seed{seed}"


def listed(ckpt_dir: Path | str) -> list[Path]:
    """Checkpoints in `ckpt_dir`, oldest first (by update step)."""
    found = [p for p in Path(ckpt_dir).glob("ckpt_*.pt") if PATTERN.match(p.name)]
    return sorted(found, key=step_of)


def path_for(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"ckpt_{step:08d}.pt"


def step_of(path: Path) -> int:
    return int(PATTERN.match(path.name).group(1))


def best_steps(scores: dict[int, float], k: int) -> list[int]:
    """The k steps with the highest score, in step order; a tie goes to the later step."""
    ranked = sorted(scores, key=lambda step: (scores[step], step), reverse=True)
    return sorted(ranked[:k])


def prune(ckpt_dir: Path, keep: int, also: Iterable[int] = ()) -> None:
    """Removes every checkpoint but the last `keep` and those of the steps in `also`."""
    also = set(also)
    for old in listed(ckpt_dir)[:-keep]:
        if step_of(old) not in also:
            old.unlink()


def rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    """This process's generators: the CPU one, and the one of its GPU (dropout there draws from it)."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng(rng: dict[str, Any], rank: int, device: torch.device) -> bool:
    """Sets this rank's generators from a checkpoint's per-rank states ({"cpu": [...], "cuda": [...]});
    False where the checkpoint was saved by fewer ranks and holds none for this one.

    A checkpoint from before per-rank states holds one CPU state, which every rank then takes."""
    if "cpu" not in rng:
        torch.set_rng_state(rng["torch"])
        return True
    if rank >= len(rng["cpu"]):
        return False
    torch.set_rng_state(rng["cpu"][rank])
    if device.type == "cuda" and rng["cuda"] and rng["cuda"][rank] is not None:
        torch.cuda.set_rng_state(rng["cuda"][rank], device)
    return True


def average_state_dicts(
    states: list[dict[str, torch.Tensor]], names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """Mean of model weights, accumulated in float32 and cast back; integer buffers from the last.

    Every state must have the same keys and shapes; a mismatch names the checkpoint and key."""
    if not states:
        raise ValueError("no checkpoints to average")
    names = names or [f"checkpoint {i}" for i in range(len(states))]
    reference = states[0]
    for name, state in zip(names[1:], states[1:]):
        if state.keys() != reference.keys():
            diff = sorted(state.keys() ^ reference.keys())
            raise DataError(f"{name}: parameters differ from {names[0]}: {', '.join(diff[:5])}")
        for key, value in state.items():
            if value.shape != reference[key].shape:
                raise DataError(
                    f"{name}: '{key}' has shape {tuple(value.shape)}, {names[0]} has {tuple(reference[key].shape)}"
                )
    averaged = {}
    for key, value in reference.items():
        if value.is_floating_point():
            total = torch.zeros_like(value, dtype=torch.float32)
            for state in states:
                total += state[key].float()
            averaged[key] = (total / len(states)).to(value.dtype)
        else:
            averaged[key] = states[-1][key].clone()
    return averaged


def scores_of(validations: list[dict[str, float]]) -> dict[int, float]:
    """{step: val BLEU} of the validations (a training history's "epochs" rows) that measured it."""
    return {int(row["step"]): row["val_bleu"] for row in validations if "val_bleu" in row}


def average_checkpoints(ckpt_dir: Path, last_k: int, select: str = "last") -> dict[str, Any]:
    """A model checkpoint whose weights average `last_k` checkpoints in `ckpt_dir`: the last ones
    (select "last") or those with the highest val BLEU (select "best", read from the newest one's history)."""
    paths = listed(ckpt_dir)
    if len(paths) < last_k:
        raise DataError(f"{ckpt_dir}: average.last_k = {last_k} but only {len(paths)} checkpoint(s) found")
    newest = load(paths[-1])
    if select == "best":
        if "history" not in newest:
            raise DataError(
                f"{paths[-1]}: checkpoint lacks history, which average.select = best reads the val BLEU from"
            )
        on_disk = {step_of(p) for p in paths}
        scores = {s: v for s, v in scores_of(newest["history"]["epochs"]).items() if s in on_disk}
        if len(scores) < last_k:
            raise DataError(
                f"{ckpt_dir}: average.select = best needs {last_k} checkpoints with a val BLEU, "
                f"found {len(scores)} (checkpoints saved between validations have none)"
            )
        chosen = [p for p in paths if step_of(p) in best_steps(scores, last_k)]
    else:
        chosen = paths[-last_k:]
    loaded = [newest if p == paths[-1] else load(p) for p in chosen]
    last = loaded[-1]
    model = average_state_dicts([c["model"] for c in loaded], [str(p) for p in chosen])
    return {key: last[key] for key in MODEL_KEYS} | {
        "model": model,
        "averaged": [p.name for p in chosen],
        "step": last["step"],
        "mlflow_run_id": last.get("mlflow_run_id"),
        "train_time_s": last.get("train_time_s"),
        "host_class": last.get("host_class"),
    }


def average_members(ckpt_dir: Path, seeds: list[int], last_k: int, select: str = "last") -> dict[str, Any]:
    """The model file of the members trained with `seeds` (train.member_seeds()), each averaged as
    average_checkpoints does: one model as it would be alone, or the first member's with the others
    under "members" (their seed, weights, step, averaged files, training time and MLflow run)."""
    first = average_checkpoints(ckpt_dir, last_k, select)
    if len(seeds) == 1:
        return first
    members = []
    for k, seed in enumerate(seeds[1:], 1):
        where = member_dir(ckpt_dir, k, seed)
        other = average_checkpoints(where, last_k, select)
        expected, found = (_as_member(training_params(c["params"]), seed) for c in (first, other))
        if found != expected:
            changed = next(
                f"{s}.{key}"
                for s in expected
                for key in expected[s] | found.get(s, {})
                if found.get(s, {}).get(key) != expected[s].get(key)
            )
            raise DataError(f"{where}: trained with other params than {ckpt_dir} ({changed}); rerun the train stage")
        members.append(
            {
                "seed": seed,
                "model": other["model"],
                "step": other["step"],
                "averaged": other["averaged"],
                "train_time_s": other["train_time_s"],
                "mlflow_run_id": other["mlflow_run_id"],
            }
        )
    times = [first["train_time_s"]] + [m["train_time_s"] for m in members]
    params = first["params"] | {"train": first["params"]["train"] | {"members": len(seeds)}}
    return first | {"members": members, "params": params, "train_time_s": sum(times) if None not in times else None}


def _as_member(trained_by: dict[str, Any], seed: int) -> dict[str, Any]:
    return trained_by | {"train": trained_by["train"] | {"seed": seed}}
