"""What a kill at an unlucky instant must not leave behind in MLflow: a second run of one training."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run, tool_env, train_cmd, write_params

from transformer import checkpoints
from transformer.training.resume import OPENED


@pytest.mark.slow
def test_a_training_killed_before_its_first_checkpoint_continues_its_mlflow_run(tmp_path, vocab_dir):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable] + train_cmd(write_params(tmp_path, **{"train.epochs": 2}), vocab_dir, tmp_path / "out")
    cmd[cmd.index("--no-track")] = "--track"
    env = {"MLFLOW_TRACKING_URI": store}
    log = tmp_path / "train.log"
    with log.open("w") as stderr:
        job = subprocess.Popen(cmd, cwd=ROOT, env=tool_env(**env), stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 600
    try:
        while not (tmp_path / "out" / "ckpt" / OPENED).exists():  # its MLflow run is open, nothing checkpointed
            ended = job.poll() is not None or time.monotonic() > deadline
            assert not ended, f"the training ended before it was seen:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        job.send_signal(signal.SIGKILL)
        job.wait()
    finally:
        if job.poll() is None:
            job.kill()
    assert not checkpoints.listed(tmp_path / "out" / "ckpt"), "the kill came after the first checkpoint"
    # Only now: a client creates a missing store in place, which a training starting beside it would
    # find half made.
    client = MlflowClient(store)
    (opened,) = _runs(client)
    run(cmd, ROOT, env=env, timeout=900)
    (finished,) = _runs(client)
    assert finished.info.run_id == opened.info.run_id and finished.info.status == "FINISHED"
    losses = client.get_metric_history(finished.info.run_id, "loss")
    assert losses and all(len({m.value for m in losses if m.step == s}) == 1 for s in {m.step for m in losses})


def _runs(client) -> list:
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
