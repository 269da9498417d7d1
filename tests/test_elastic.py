"""Elastic training: torchrun restarts a job whose worker died (train.max_restarts times), every
rank resumes from the last checkpoint, and the job ends by itself with an uninterrupted run's weights."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import ROOT, run, same_values, tiny_params, tool_env, torchrun, train_cmd

from transformer import checkpoints
from transformer.config import params_from_dict, training_params
from transformer.errors import ConfigError
from transformer.training.resume import comparable


@pytest.mark.parametrize(("value", "why"), [(-1, "must be >= 0"), (1.5, "must be int")])
def test_max_restarts_is_a_non_negative_int(value, why):
    with pytest.raises(ConfigError, match=rf"'train.max_restarts' .*{why}"):
        params_from_dict(tiny_params(**{"train.max_restarts": value}))


def test_a_changed_max_restarts_continues_the_run():
    def identity(n: int) -> dict:
        return {"params": training_params(tiny_params(**{"train.max_restarts": n})), "data": "ids"}

    assert comparable(identity(0)) == comparable(identity(3))


def test_the_train_stage_passes_max_restarts_to_torchrun():
    cmd = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["cmd"]
    assert cmd.startswith("torchrun ") and "--max-restarts ${train.max_restarts}" in cmd.split("stages/train.py")[0]


def _job(params: Path, vocab: Path, out: Path, restarts: int, track: bool) -> list[str]:
    return [*torchrun(1, 2), "--max-restarts", str(restarts), *train_cmd(params, vocab, out, track=track)]


def _workers(job: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(job.pid).children(recursive=True) if "stages/train.py" in " ".join(p.cmdline())]


def _kill_rank_1_after_a_checkpoint(job: subprocess.Popen, ckpt: Path) -> None:
    deadline = time.monotonic() + 900  # a hang guard
    while not checkpoints.listed(ckpt):
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint before the job ended"
        time.sleep(0.05)
    (rank1,) = [p for p in _workers(job) if p.environ().get("RANK") == "1"]
    rank1.send_signal(signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_killed_worker_restarts_the_job_which_ends_with_an_uninterrupted_runs_weights(
    tmp_path, vocab_dir, rendezvous
):
    """static: a master port named, as nodes meet (docs/scale.md); c10d: none, as `dvc repro` runs one
    node, where torchrun picks a free port itself."""
    from mlflow.tracking import MlflowClient

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(**{"train.nproc": 2, "train.epochs": 4, "train.save_every": 4})))
    run(_job(params, vocab_dir, tmp_path / "reference", 0, track=False), ROOT, timeout=1200)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = tool_env(MLFLOW_TRACKING_URI=store)
    if rendezvous == "c10d":
        del env["PET_MASTER_PORT"]
    job = subprocess.Popen(
        _job(params, vocab_dir, tmp_path / "killed", 3, track=True),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _kill_rank_1_after_a_checkpoint(job, tmp_path / "killed" / "ckpt")
        _, stderr = job.communicate(timeout=1200)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert "resuming from" in stderr, "the restarted workers did not resume from the checkpoint"
    mine, theirs = (checkpoints.listed(tmp_path / d / "ckpt") for d in ("killed", "reference"))
    assert [p.name for p in mine] == [p.name for p in theirs]
    a, b = (checkpoints.load(p[-1], checkpoints.RESUME_KEYS) for p in (mine, theirs))
    assert same_values(a["model"], b["model"]) and same_values(a["optimizer"], b["optimizer"])
    assert json.loads((tmp_path / "killed" / "reports" / "train.json").read_text())["restarts"] == 1
    client = MlflowClient(store)
    (run_,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [m.value for m in client.get_metric_history(run_.info.run_id, "restarts")] == [1]
    assert not list((tmp_path / "killed").rglob(".*.tmp"))
