"""Interruptions: a killed decode or a dead DDP worker loses nothing and leaves nothing half-written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from conftest import ROOT, run, tiny_params, tool_env, torchrun, toy_pairs, train_cmd, train_options

from transformer import checkpoints


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
    run(
        [
            sys.executable,
            "stages/train.py",
            "--params",
            str(params),
            "--vocab",
            str(vocab_dir),
            *train_options(tmp_path),
            "--references",
            str(tmp_path / "toy" / "val.en"),
            "--no-track",
        ],
        ROOT,
    )
    model = tmp_path / "model.pt"
    checkpoints.save(model, checkpoints.average_checkpoints(tmp_path / "ckpt", 1))
    return model


def test_decode_killed_midway_keeps_the_previous_output_and_rerun_is_complete(tmp_path, vocab_dir, trained_model):
    from transformer.data.tokenize import Tokenizer

    source = tmp_path / "source.de"
    # The kill follows the progress bar's first count (it redraws once a second), and decode writes only after
    # its last sentence: with 1,000 sentences an idle machine decoded the rest before the kill arrived and was
    # killed inside the write. 5,000 sentences leave seconds between that first count and the write.
    total = 5000
    source.write_text("\n".join(Tokenizer("de").pipe(p[0] for p in toy_pairs(total, seed=7))) + "\n")
    slow = tmp_path / "slow.yaml"  # a few sentences a batch: over a thousand batches
    slow.write_text(yaml.safe_dump(tiny_params(**{"train.epochs": 2, "decode.batch_tokens": 40})))
    out = tmp_path / "translations" / "test.txt"
    out.parent.mkdir()
    out.write_text("the previous output\n")

    def decode(params: Path) -> list[str]:
        return [
            sys.executable,
            "stages/decode.py",
            "--params",
            str(params),
            "--model",
            str(trained_model),
            "--vocab",
            str(vocab_dir),
            "--source",
            str(source),
            "--out",
            str(out),
            "--report",
            str(tmp_path / "speed.json"),
        ]

    proc = subprocess.Popen(
        decode(slow), cwd=ROOT, env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    done = _sentences_done(proc, total=total)  # the progress bar's first count past 0
    assert done is not None and 0 < done < total // 2, f"decoding was not seen in its first half ({done} of {total})"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "decode finished before the kill"
    assert out.read_text() == "the previous output\n", "a killed decode must leave the previous output as it was"
    assert not list(out.parent.glob(".*.tmp")) and not (tmp_path / "speed.json").exists()

    run(decode(tmp_path / "params.yaml"), ROOT)  # larger batches, the same translations
    lines = out.read_text().splitlines()
    assert len(lines) == total and all(lines)
    assert not list(out.parent.glob(".*.tmp")), "temporary files are cleaned up"


def _sentences_done(proc: subprocess.Popen, total: int) -> int | None:
    """Reads decode's progress bar (tqdm ends each redraw with \\r) until it shows a count past 0."""
    for line in proc.stderr:
        match = re.search(rf"\b(\d+)/{total}\b", line)
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None


def test_a_killed_launcher_takes_its_worker_with_it(tmp_path, vocab_dir):
    """torchrun starts its workers in sessions of their own: killing the launcher's process group
    (as killing `dvc repro` does) must not leave a worker training on, orphaned."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(**{"train.epochs": 1000})))  # it trains until killed
    job = subprocess.Popen(
        [*torchrun(1, 1), *train_cmd(params, vocab_dir, tmp_path)],
        cwd=ROOT,
        env=tool_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    worker = None
    try:
        assert _wait_for(lambda: checkpoints.listed(tmp_path / "ckpt") or job.poll() is not None, 300)
        workers = [p for p in psutil.Process(job.pid).children() if "stages/train.py" in " ".join(p.cmdline())]
        assert len(workers) == 1 and job.poll() is None, "the job ended before its launcher could be killed"
        worker = workers[0]
        assert os.getsid(worker.pid) != os.getsid(job.pid)  # what makes the group kill miss it
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        assert _wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 30), (
            "the worker trains on after its launcher was killed"
        )
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        if worker is not None and worker.is_running():
            worker.kill()


@pytest.mark.slow
def test_dead_ddp_worker_stops_the_job_and_the_rerun_resumes_to_the_same_weights(tmp_path, vocab_dir):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(**{"train.nproc": 2, "train.epochs": 8, "train.save_every": 4})))

    def job_cmd(out: Path) -> list[str]:
        return [*torchrun(1, 2), *train_cmd(params, vocab_dir, out)]

    run(job_cmd(tmp_path / "reference"), ROOT, timeout=1200)  # timeouts here are hang guards, not speed tests
    last = checkpoints.listed(tmp_path / "reference" / "ckpt")[-1]
    job = subprocess.Popen(
        job_cmd(tmp_path / "killed"),
        cwd=ROOT,
        env=tool_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert _wait_for(lambda: len(checkpoints.listed(tmp_path / "killed" / "ckpt")) >= 1 or job.poll() is not None, 900)
    workers = [
        p for p in psutil.Process(job.pid).children(recursive=True) if "stages/train.py" in " ".join(p.cmdline())
    ]
    assert len(workers) == 2, "the job ended before a worker could be killed"
    rank1 = next(p for p in workers if p.environ().get("RANK") == "1")
    rank1.send_signal(signal.SIGKILL)
    _, stderr = job.communicate(timeout=300)  # no hang: torchrun stops the other rank
    assert job.returncode != 0
    assert f"Signal 9 (SIGKILL) received by PID {rank1.pid}" in stderr, stderr[-3000:]
    before = checkpoints.listed(tmp_path / "killed" / "ckpt")
    assert before[-1].name < last.name, "the job finished before the worker died"

    resumed = run(job_cmd(tmp_path / "killed"), ROOT, timeout=1200)
    assert f"resuming from {before[-1]}" in resumed.stderr
    kept = checkpoints.listed(tmp_path / "killed" / "ckpt")
    assert [p.name for p in kept] == [p.name for p in checkpoints.listed(tmp_path / "reference" / "ckpt")]
    mine, theirs = checkpoints.load(kept[-1], checkpoints.RESUME_KEYS), checkpoints.load(last, checkpoints.RESUME_KEYS)
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])
    assert all(
        torch.equal(a, b)
        for s, t in zip(mine["optimizer"]["state"].values(), theirs["optimizer"]["state"].values())
        for a, b in zip(s.values(), t.values())
    )
