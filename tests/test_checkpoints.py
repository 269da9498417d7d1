"""Checkpoint files: atomic saves, safe and strict loads, weight averaging."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from transformer import checkpoints
from transformer.checkpoints import average_checkpoints, average_state_dicts, load, save
from transformer.io import DataError


def _checkpoint(weight: float, step: int) -> dict:
    return {
        "model": {
            "w": torch.full((2, 3), weight),
            "b": torch.tensor([weight, -weight]),
            "n": torch.tensor(step, dtype=torch.long),
        },
        "model_config": {"N": 1, "d_model": 16},
        "params": {"average": {"last_k": 2}},
        "vocab": {"src": {"kind": "word", "itos": ["<s>"]}},
        "step": step,
    }


def test_average_of_three_state_dicts_is_the_exact_mean():
    states = [
        {"w": torch.tensor([1.0, 0.5, -2.0])},
        {"w": torch.tensor([2.0, 1.5, 0.0])},
        {"w": torch.tensor([3.0, 4.0, 8.0])},
    ]
    averaged = average_state_dicts(states)
    assert torch.equal(averaged["w"], torch.tensor([2.0, 2.0, 2.0]))
    assert averaged["w"].dtype == torch.float32


def test_half_precision_weights_are_averaged_in_float32_and_cast_back():
    # In float16, 2048 + 1 + 1 stays 2048 (the spacing there is 2); in float32 it is 2050.
    states = [
        {"w": torch.tensor([2048.0], dtype=torch.float16)},
        {"w": torch.tensor([1.0], dtype=torch.float16)},
        {"w": torch.tensor([1.0], dtype=torch.float16)},
    ]
    averaged = average_state_dicts(states)
    assert averaged["w"].dtype == torch.float16
    assert averaged["w"].item() == torch.tensor(2050 / 3).half().item()  # 683.5, not 682.5


def test_integer_buffers_come_from_the_last_state_and_stay_integer():
    states = [
        {
            "w": torch.tensor([float(i)]),
            "count": torch.tensor([i], dtype=torch.long),
            "mask": torch.tensor([i % 2 == 0]),
        }
        for i in (1, 2, 3)
    ]
    averaged = average_state_dicts(states)
    assert averaged["count"].dtype == torch.long and averaged["count"].tolist() == [3]
    assert averaged["mask"].dtype == torch.bool and averaged["mask"].tolist() == [False]
    assert averaged["w"].tolist() == [2.0]


def test_averaging_does_not_modify_its_inputs():
    states = [{"w": torch.tensor([1.0]), "n": torch.tensor([1])}, {"w": torch.tensor([3.0]), "n": torch.tensor([2])}]
    averaged = average_state_dicts(states)
    averaged["w"] += 10
    averaged["n"] += 10
    assert states[0]["w"].item() == 1.0 and states[1]["w"].item() == 3.0 and states[1]["n"].item() == 2


def test_mismatched_keys_are_named():
    states = [{"w": torch.zeros(2), "b": torch.zeros(1)}, {"w": torch.zeros(2), "bias": torch.zeros(1)}]
    with pytest.raises(DataError, match="parameters differ") as e:
        average_state_dicts(states, ["first.pt", "second.pt"])
    assert "bias" in str(e.value) and "second.pt" in str(e.value)


def test_mismatched_shapes_are_named():
    states = [{"w": torch.zeros(2, 3)}, {"w": torch.zeros(3, 2)}]
    with pytest.raises(DataError, match="'w' has shape") as e:
        average_state_dicts(states)
    assert "(3, 2)" in str(e.value) and "(2, 3)" in str(e.value)


def test_average_checkpoints_uses_the_last_k_by_step(tmp_path):
    for weight, step in ((100.0, 5), (1.0, 20), (3.0, 100)):  # step 100 sorts after step 20 numerically
        save(checkpoints.path_for(tmp_path, step), _checkpoint(weight, step))
    (tmp_path / "ckpt_notes.pt").write_text("not a checkpoint")  # ignored: not ckpt_<step>.pt
    averaged = average_checkpoints(tmp_path, 2)
    assert averaged["averaged"] == ["ckpt_00000020.pt", "ckpt_00000100.pt"]
    assert torch.equal(averaged["model"]["w"], torch.full((2, 3), 2.0))
    assert averaged["model"]["n"].item() == 100
    assert averaged["step"] == 100
    assert averaged["model_config"] == {"N": 1, "d_model": 16}


def test_average_of_one_checkpoint_is_a_plain_copy(tmp_path):
    original = _checkpoint(0.123456789, 7)
    save(checkpoints.path_for(tmp_path, 7), original)
    averaged = average_checkpoints(tmp_path, 1)
    assert averaged["model"].keys() == original["model"].keys()
    for key, value in original["model"].items():
        assert torch.equal(averaged["model"][key], value) and averaged["model"][key].dtype == value.dtype
    for key in checkpoints.MODEL_KEYS[1:]:
        assert averaged[key] == original[key]


def test_too_few_checkpoints_says_how_many_were_found(tmp_path):
    for step in (1, 2):
        save(checkpoints.path_for(tmp_path, step), _checkpoint(1.0, step))
    with pytest.raises(DataError, match="only 2 checkpoint") as e:
        average_checkpoints(tmp_path, 3)
    assert "last_k = 3" in str(e.value)


def test_saved_checkpoint_loads_back(tmp_path):
    save(tmp_path / "m.pt", _checkpoint(1.5, 3))
    loaded = load(tmp_path / "m.pt")
    assert torch.equal(loaded["model"]["w"], torch.full((2, 3), 1.5))
    assert loaded["step"] == 3


def _refused(path: Path, match: str) -> str:
    """The message of the DataError that load(path) raises, which must match `match`."""
    with pytest.raises(DataError, match=match) as e:
        load(path)
    return str(e.value)


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.5, 0.99])
def test_truncated_checkpoint_is_reported_as_truncated_or_corrupt(tmp_path, keep):
    path = tmp_path / "m.pt"
    save(path, _checkpoint(1.0, 1))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    assert str(path) in _refused(path, "truncated or corrupt")


def test_missing_checkpoint_is_named(tmp_path):
    _refused(tmp_path / "absent.pt", "not found")


class _WritesMarker:
    """Unpickling this calls exec(): the kind of payload a malicious checkpoint carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_checkpoint_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "model_config": _WritesMarker(marker), "params": {}, "vocab": {}}, evil)
    _refused(evil, "refused")
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the payload is real: an unsafe load runs it
    assert marker.read_text() == "ran"


def test_checkpoint_lacking_keys_lists_them(tmp_path):
    save(tmp_path / "m.pt", {"model": {}, "params": {}})
    message = _refused(tmp_path / "m.pt", "lacks")
    assert "model_config" in message and "vocab" in message
    assert "params" not in message.split("lacks")[1]


def test_file_that_is_not_a_dict_is_refused(tmp_path):
    torch.save([torch.zeros(1)], tmp_path / "m.pt")
    _refused(tmp_path / "m.pt", "not a checkpoint")


_WRITE_PAST_THE_LIMIT = """
import resource, signal, sys, torch
from transformer.checkpoints import save

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as a full disk does
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    save(sys.argv[1], {"model": {"w": torch.zeros(256, 256)}, "params": {}, "step": 2})
except OSError as e:
    print(f"OSError {e.errno}: {e}")
"""


def test_failed_save_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path):
    """A real failed write (the file size limit, which fails writes as a full disk does), through
    torch's own writer: the previous checkpoint stays, no temporary file is left, and the error
    names the checkpoint."""
    import errno
    import subprocess
    import sys

    path = tmp_path / "ckpt_00000001.pt"
    save(path, _checkpoint(1.0, 1))
    before = path.read_bytes()
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_PAST_THE_LIMIT, str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.stdout.startswith(f"OSError {errno.EFBIG}:") and str(path) in done.stdout, done.stdout + done.stderr
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert load(path)["model"]["w"][0, 0].item() == 1.0


def test_prune_keeps_the_newest(tmp_path):
    for step in (3, 10, 200, 40):
        save(checkpoints.path_for(tmp_path, step), _checkpoint(1.0, step))
    checkpoints.prune(tmp_path, 2)
    assert [p.name for p in checkpoints.listed(tmp_path)] == ["ckpt_00000040.pt", "ckpt_00000200.pt"]


def test_prune_also_keeps_the_steps_it_is_told_to(tmp_path):
    for step in (3, 10, 40, 200):
        save(checkpoints.path_for(tmp_path, step), _checkpoint(1.0, step))
    checkpoints.prune(tmp_path, 1, also=[10, 40, 999])  # 999: no such checkpoint, nothing to keep
    assert [checkpoints.step_of(p) for p in checkpoints.listed(tmp_path)] == [10, 40, 200]


def test_best_steps_are_the_highest_scores_in_step_order_and_ties_go_to_the_later_step():
    scores = {100: 30.0, 200: 31.5, 300: 29.0, 400: 31.5, 500: 30.0}
    assert checkpoints.best_steps(scores, 2) == [200, 400]
    assert checkpoints.best_steps(scores, 3) == [200, 400, 500]  # 500 ties 100 and is later
    assert checkpoints.best_steps(scores, 9) == [100, 200, 300, 400, 500]


def _with_history(weight: float, step: int, bleus: dict[int, float]) -> dict:
    rows = [
        {"epoch": i + 1, "step": s, "val_loss": 1.0} | ({"val_bleu": b} if b is not None else {})
        for i, (s, b) in enumerate(bleus.items())
        if s <= step
    ]
    return _checkpoint(weight, step) | {"history": {"steps": [], "epochs": rows}}


def test_average_best_takes_the_k_with_the_highest_val_bleu_from_the_newest_history(tmp_path):
    bleus = {10: 20.0, 20: 25.0, 30: 22.0, 40: 24.0, 45: None, 50: 21.0}  # 45: saved between validations
    for weight, step in ((1.0, 10), (2.0, 20), (3.0, 30), (4.0, 40), (100.0, 45), (5.0, 50)):
        save(checkpoints.path_for(tmp_path, step), _with_history(weight, step, bleus))
    averaged = average_checkpoints(tmp_path, 2, "best")
    assert averaged["averaged"] == ["ckpt_00000020.pt", "ckpt_00000040.pt"]
    assert torch.equal(averaged["model"]["w"], torch.full((2, 3), 3.0))
    assert averaged["step"] == 40 and averaged["model"]["n"].item() == 40
    assert average_checkpoints(tmp_path, 2, "last")["averaged"] == ["ckpt_00000045.pt", "ckpt_00000050.pt"]


def test_average_best_skips_scored_checkpoints_that_were_pruned(tmp_path):
    bleus = {10: 40.0, 20: 25.0, 30: 22.0}
    for step in (20, 30):  # the best, step 10, is gone
        save(checkpoints.path_for(tmp_path, step), _with_history(float(step), step, bleus))
    assert average_checkpoints(tmp_path, 1, "best")["averaged"] == ["ckpt_00000020.pt"]


def test_average_best_with_too_few_scored_checkpoints_says_so(tmp_path):
    bleus = {10: 20.0, 15: None, 20: 25.0}
    for step in (10, 15, 20):
        save(checkpoints.path_for(tmp_path, step), _with_history(1.0, step, bleus))
    with pytest.raises(DataError, match="needs 3 checkpoints with a val BLEU, found 2"):
        average_checkpoints(tmp_path, 3, "best")


def test_the_fault_summary_counts_each_test_once_with_skips_apart_from_failures(monkeypatch):
    from types import SimpleNamespace

    import conftest

    monkeypatch.setitem(conftest.FAULTS, "0 summary", ["test_fake.py::"])

    def report(nodeid, when, outcome):
        return SimpleNamespace(
            nodeid=nodeid, when=when, outcome=outcome, passed=outcome == "passed", failed=outcome == "failed"
        )

    for r in (
        report("tests/test_fake.py::test_a", "setup", "skipped"),  # skipped at setup: counted
        report("tests/test_fake.py::test_b", "setup", "passed"),
        report("tests/test_fake.py::test_b", "call", "skipped"),  # skipped mid-body: not a failure
        report("tests/test_fake.py::test_c", "call", "passed"),
        report("tests/test_fake.py::test_c", "teardown", "failed"),  # a failed teardown fails it
    ):
        conftest.pytest_runtest_logreport(r)
    outcomes = conftest._fault_results.pop("0 summary")
    assert conftest.fault_summary(outcomes) == "0 passed, 1 failed, 2 skipped"
