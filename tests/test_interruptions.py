"""Interruptions: a killed decode or a dead DDP worker loses nothing and leaves nothing half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import BIN, ROOT, free_port, run, tiny_params, toy_pairs, train_options
from transformer import checkpoints


def _env() -> dict:
    return os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PET_MASTER_PORT": str(free_port())}


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def trained_model(tmp_path, vocab_dir) -> Path:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(**{"train.epochs": 2})))
    run([sys.executable, "stages/train.py", "--params", str(params), "--vocab", str(vocab_dir), *train_options(tmp_path), "--references", str(tmp_path / "toy" / "val.en"),
         "--no-track"], ROOT)
    model = tmp_path / "model.pt"
    checkpoints.save(model, checkpoints.average_checkpoints(tmp_path / "ckpt", 1))
    return model


def test_decode_killed_midway_leaves_no_output_and_rerun_is_complete(tmp_path, vocab_dir, trained_model):
    from transformer.tokenize import Tokenizer

    source = tmp_path / "source.de"
    source.write_text("\n".join(Tokenizer("de").pipe(p[0] for p in toy_pairs(3000, seed=7))) + "\n")
    out = tmp_path / "translations" / "test.txt"
    cmd = [sys.executable, "stages/decode.py", "--params", str(tmp_path / "params.yaml"), "--model", str(trained_model),
           "--vocab", str(vocab_dir), "--source", str(source), "--out", str(out), "--report", str(tmp_path / "speed.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: "sent/s" in (proc.stderr.readline() or ""), 60), "decoding never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "a killed decode must not leave a (partial) output"

    run(cmd, ROOT)
    lines = out.read_text().splitlines()
    assert len(lines) == 3000 and all(lines)
    assert not list(out.parent.glob(".*.tmp")), "temporary files are cleaned up"


@pytest.mark.slow
def test_dead_ddp_worker_stops_the_job_and_the_rerun_resumes(tmp_path, vocab_dir):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(**{"train.nproc": 2, "train.epochs": 40, "train.save_every": 5})))
    cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "stages/train.py", "--params", str(params),
           "--vocab", str(vocab_dir), *train_options(tmp_path), "--references", str(tmp_path / "toy" / "val.en"),
           "--references", str(tmp_path / "toy" / "val.en"), "--no-track"]
    job = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: len(checkpoints.listed(tmp_path / "ckpt")) >= 1, 120), "no checkpoint written"
    workers = [p for p in psutil.Process(job.pid).children(recursive=True) if "stages/train.py" in " ".join(p.cmdline())]
    assert len(workers) == 2
    rank1 = next(p for p in workers if p.environ().get("RANK") == "1")
    rank1.send_signal(signal.SIGKILL)
    _, stderr = job.communicate(timeout=120)  # no hang: torchrun stops the other rank
    assert job.returncode != 0
    assert any(sign in stderr for sign in ("SIGKILL", "Signal 9", "exitcode")), stderr[-2000:]

    resumed = run(cmd, ROOT, timeout=300)
    assert "resuming from" in resumed.stderr
    assert checkpoints.load(checkpoints.listed(tmp_path / "ckpt")[-1])["epoch"] == 40
