"""Checkpoints written in the background: the file holds the state as it stood at the save, byte for
byte as a synchronous save writes it; one write at a time; a failed write is raised in the training
thread; the old checkpoints go only once the new one is whole; a kill at any instant resumes.

The background writer is the GPU's; these tests run it on the CPU, where it works the same way."""

from __future__ import annotations

import dataclasses
import errno
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import ROOT, same_values, tiny_config, tiny_params

from transformer import checkpoints
from transformer.config import params_from_dict, training_params
from transformer.errors import TrainingError
from transformer.model.model import make_model
from transformer.training.checkpointing import Checkpointer
from transformer.training.distributed import Dist
from transformer.training.resume import Progress, resume
from transformer.training.train import make_optimizer
from transformer.training.writer import BackgroundWriter, Writer, writer_for

CPU = torch.device("cpu")
VOCAB = 20


def _checkpointer(directory: Path, writer: Writer, keep: int = 3, device: torch.device = CPU) -> Checkpointer:
    """A tiny run after its first update, saving into `directory`: its embeddings tied (one storage
    under three names), and AdamW's state, which the update made. The same run in every process."""
    torch.manual_seed(0)
    config = tiny_config(VOCAB, VOCAB, tie_embeddings=True)
    model = make_model(**config).to(device)
    params = params_from_dict(tiny_params(**{"train.keep": keep, "average.last_k": 1}))
    identity = {"params": training_params(params.to_dict()), "data": "0" * 32}
    meta = {"model_config": config, "vocab": {"src": None, "tgt": None}, "identity": identity}
    optimizer = make_optimizer(model, params.train.weight_decay, device)
    run = Checkpointer(
        directory=directory,
        params=params,
        env=Dist(device=device),
        progress=Progress(),
        meta=meta,
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler(device.type, enabled=False),
        writer=writer,
    )
    _update(run)
    return run


def _update(run: Checkpointer) -> None:
    """An update of the run: its weights and Adam's state change in place, and its history grows a row."""
    for w in run.model.parameters():
        w.grad = torch.randn_like(w)
    run.optimizer.step()
    run.progress.step += 1
    run.progress.steps.append({"step": run.progress.step, "loss": 1.0 / run.progress.step})


def _steps(directory: Path) -> list[int]:
    return [checkpoints.step_of(p) for p in checkpoints.listed(directory)]


class Gate:
    """Holds each write into `directory` at its start until opened: a write in flight for as long as a
    test needs. Writes elsewhere go through."""

    def __init__(self, monkeypatch, directory: Path):
        self.opened, self.started = threading.Event(), []
        real = checkpoints.save

        def save(path: Path, checkpoint: dict) -> None:
            if path.parent == directory:
                self.started.append(checkpoints.step_of(path))
                assert self.opened.wait(30), "the gate was never opened"  # a hang guard
            real(path, checkpoint)

        monkeypatch.setattr(checkpoints, "save", save)


def test_checkpoints_are_written_in_the_background_on_a_gpu_and_in_the_training_thread_on_a_cpu():
    assert type(writer_for(CPU)) is Writer
    assert isinstance(writer_for(torch.device("cuda", 0)), BackgroundWriter)


def test_a_background_write_holds_the_state_at_the_save_byte_for_byte_as_a_synchronous_one(tmp_path, monkeypatch):
    now = _checkpointer(tmp_path / "sync", Writer())
    later = dataclasses.replace(now, directory=tmp_path / "later", writer=BackgroundWriter(CPU))
    gate = Gate(monkeypatch, later.directory)
    for _ in range(2):  # the second save reuses the first one's host buffers
        now.save(12.5)
        later.save(12.5)
        _update(later)  # while its write is held: the same weights, Adam's state and history change
        gate.opened.set()
        later.writer.wait()
        gate.opened.clear()
    assert _steps(now.directory) == _steps(later.directory) == [1, 2]
    for a, b in zip(checkpoints.listed(now.directory), checkpoints.listed(later.directory)):
        assert a.read_bytes() == b.read_bytes(), b.name


def test_a_write_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    writer, gate = BackgroundWriter(CPU), Gate(monkeypatch, tmp_path)

    def write(step: int) -> None:
        writer.write(checkpoints.path_for(tmp_path, step), {"w": torch.zeros(3)}, {"step": step}, lambda: None)

    write(1)
    second = threading.Thread(target=write, args=(2,))
    second.start()
    second.join(0.5)
    assert second.is_alive() and gate.started == [1], "the second write began while the first was in flight"
    gate.opened.set()
    second.join()
    writer.wait()
    assert gate.started == [1, 2] and _steps(tmp_path) == [1, 2]


def _full_disk(path: Path, checkpoint: dict) -> None:
    raise OSError(errno.ENOSPC, "could not write: No space left on device", str(path))


def test_a_failed_background_write_is_raised_in_the_training_thread_at_the_next_save(tmp_path, monkeypatch):
    writer, pruned = BackgroundWriter(CPU), []
    monkeypatch.setattr(checkpoints, "save", _full_disk)
    writer.write(tmp_path / "ckpt_00000001.pt", {"w": torch.zeros(3)}, {}, lambda: pruned.append(1))
    with pytest.raises(OSError, match="ckpt_00000001.pt") as raised:
        writer.write(tmp_path / "ckpt_00000002.pt", {"w": torch.ones(3)}, {}, lambda: pruned.append(2))
    assert raised.value.errno == errno.ENOSPC and not pruned  # nothing pruned for a checkpoint not written
    writer.wait()  # raised once: the training that goes on past it starts afresh


def test_a_failed_background_write_is_raised_at_the_end_of_the_training(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "save", _full_disk)
    with pytest.raises(OSError, match="ckpt_00000001.pt"), BackgroundWriter(CPU) as writer:
        writer.write(tmp_path / "ckpt_00000001.pt", {"w": torch.zeros(3)}, {}, lambda: None)


def test_a_training_that_fails_during_a_write_ends_with_its_own_error_after_the_write(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, tmp_path)
    with pytest.raises(TrainingError, match="out of memory"), BackgroundWriter(CPU) as writer:
        writer.write(tmp_path / "ckpt_00000001.pt", {"w": torch.zeros(3)}, {}, lambda: None)
        threading.Timer(0.2, gate.opened.set).start()
        raise TrainingError("out of memory at step 2")
    assert _steps(tmp_path) == [1]


def test_the_old_checkpoint_stays_until_the_new_one_is_whole_on_disk(tmp_path, monkeypatch):
    run = _checkpointer(tmp_path, BackgroundWriter(CPU), keep=1)
    run.save(0.0)
    run.writer.wait()
    _update(run)
    gate = Gate(monkeypatch, tmp_path)
    run.save(0.0)
    _update(run)
    assert gate.started == [2] and _steps(tmp_path) == [1], "train.keep 1 pruned the only whole checkpoint"
    gate.opened.set()
    run.writer.wait()
    assert _steps(tmp_path) == [2]


def test_weights_that_became_non_finite_stop_the_run_once_the_write_in_flight_is_whole(tmp_path, monkeypatch):
    run = _checkpointer(tmp_path, BackgroundWriter(CPU))
    gate = Gate(monkeypatch, tmp_path)
    run.save(0.0)
    with torch.no_grad():
        next(run.model.parameters()).fill_(float("nan"))
    threading.Timer(0.2, gate.opened.set).start()
    with pytest.raises(TrainingError, match="non-finite"):
        run.save(0.0)
    assert _steps(tmp_path) == [1], "the last good checkpoint was not whole when the run stopped"
    assert all(t.isfinite().all() for t in checkpoints.load(checkpoints.listed(tmp_path)[0])["model"].values())


# A tiny run that saves step 1, then step 2 in the background, and is killed during that write.
_KILLED_WRITE = """
import io, os, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[3])
import test_writer
from transformer import checkpoints
from transformer.training.writer import BackgroundWriter

directory, when = Path(sys.argv[1]), sys.argv[2]
real_save = torch.save

def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

def half_written(obj, f):
    whole = io.BytesIO()
    real_save(obj, whole)
    f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
    f.flush()
    killed()

run = test_writer._checkpointer(directory, BackgroundWriter(torch.device("cpu")), keep=1)
run.save(0.0)
run.writer.wait()
test_writer._update(run)
if when == "serializing":  # half the file written under its temporary name
    torch.save = half_written
elif when == "renaming":  # the whole file written and synced, not yet renamed
    os.replace = killed
else:  # "pruning": the new checkpoint in place, the old one not yet removed
    checkpoints.prune = killed
run.save(0.0)
test_writer._update(run)  # the training goes on during the write
run.writer.wait()
"""


@pytest.mark.parametrize(("when", "kept"), [("serializing", [1]), ("renaming", [1]), ("pruning", [1, 2])])
def test_a_kill_during_a_background_write_leaves_a_whole_checkpoint_to_resume_from(tmp_path, when, kept):
    directory = tmp_path / "ckpt"
    args = [str(directory), when, str(ROOT / "tests")]
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITE, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert _steps(directory) == kept
    expected = _checkpointer(tmp_path / "expected", Writer())
    for _ in range(kept[-1] - 1):
        _update(expected)
    rerun = _checkpointer(tmp_path / "rerun", Writer(), keep=1)
    identity = rerun.meta["identity"]
    progress = resume(directory, identity, rerun.model, rerun.optimizer, Dist(), lambda epoch: 100, scaler=rerun.scaler)
    assert progress.step == kept[-1]
    assert same_values(rerun.model.state_dict(), expected.model.state_dict())
    assert same_values(rerun.optimizer.state_dict(), expected.optimizer.state_dict())
    rerun = dataclasses.replace(rerun, directory=directory, progress=progress)
    _update(rerun)
    rerun.save(0.0)  # the rerun's first checkpoint removes what the killed write left
    assert _steps(directory) == [kept[-1] + 1] and not list(directory.glob(".*.tmp"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_background_write_on_cuda_holds_the_values_a_synchronous_one_holds(tmp_path):
    cuda = torch.device("cuda", 0)
    now = _checkpointer(tmp_path / "sync", Writer(), device=cuda)
    later = dataclasses.replace(now, directory=tmp_path / "later", writer=BackgroundWriter(cuda))
    now.save(0.0)
    later.save(0.0)
    _update(later)  # queued on the GPU behind the copies the save waited for
    later.writer.wait()
    a, b = (checkpoints.load(checkpoints.listed(run.directory)[0]) for run in (now, later))
    assert same_values(a["model"], b["model"]) and same_values(a["optimizer"], b["optimizer"])
    assert all(buffer.is_pinned() for buffer in later.writer._buffers)
