"""A rerun with changed params continues what can be continued and sets aside what cannot:
bookkeeping never restarts a run, a longer run continues where its schedule so far is unchanged
(and ends as a fresh run of the new params would), and a restart moves the old run aside."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, run, same_values, train_cmd, write_params

from transformer import checkpoints
from transformer.config import params_from_dict, training_params
from transformer.training.resume import comparable, restart_reason


def _train(tmp_path, vocab_dir, out, **params):
    return run([sys.executable] + train_cmd(write_params(tmp_path, **params), vocab_dir, out), ROOT)


def _files(out):
    return [(p.name, p.stat().st_mtime_ns) for p in checkpoints.listed(out / "ckpt")]


@pytest.mark.slow
def test_bookkeeping_changes_retrain_nothing(tmp_path, vocab_dir):
    out, base = tmp_path / "out", {"train.epochs": 2}
    _train(tmp_path, vocab_dir, out, **base)
    before = _files(out)
    for change in ({"train.keep": 7}, {"train.save_every": 5}, {"train.patience": 3}):
        result = _train(tmp_path, vocab_dir, out, **base, **change)
        assert "resuming from" in result.stderr and "afresh" not in result.stderr, (change, result.stderr[-1500:])
        assert _files(out) == before, change  # nothing trained, nothing rewritten
    assert not (out / "ckpt.previous").exists()


@pytest.mark.slow
def test_raised_epochs_continue_and_end_as_a_fresh_run_of_the_longer_recipe(tmp_path, vocab_dir):
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    _train(tmp_path, vocab_dir, out, **{"train.epochs": 2})
    steps = checkpoints.load(checkpoints.listed(out / "ckpt")[-1], checkpoints.RESUME_KEYS)["step"]
    result = _train(tmp_path, vocab_dir, out, **{"train.epochs": 3})
    assert f"(step {steps}, epoch 3)" in result.stderr and "afresh" not in result.stderr
    _train(tmp_path, vocab_dir, fresh, **{"train.epochs": 3})
    continued, once = (checkpoints.load(checkpoints.listed(d / "ckpt")[-1]) for d in (out, fresh))
    assert continued["step"] == once["step"] > steps
    assert same_values(continued["model"], once["model"]) and same_values(continued["optimizer"], once["optimizer"])


@pytest.mark.slow
def test_raised_epochs_under_a_cooldown_restart_and_set_the_old_run_aside(tmp_path, vocab_dir):
    out, base = tmp_path / "out", {"train.epochs": 2, "train.cooldown": 0.3}
    _train(tmp_path, vocab_dir, out, **base)
    old = checkpoints.listed(out / "ckpt")
    result = _train(tmp_path, vocab_dir, out, **base | {"train.epochs": 3})
    (aside,) = (out / "ckpt.previous").iterdir()
    said = [line for line in result.stderr.splitlines() if "afresh" in line]
    assert said == [
        f"{old[-1]}: not resumed, train.epochs was 2, now 3, which changes the schedule from update "
        f"{said[0].split('from update ')[1].split(',')[0]}, before this checkpoint's "
        f"{checkpoints.step_of(old[-1])}; its run moved to {aside}; starting afresh"
    ]
    assert sorted(p.name for p in aside.iterdir()) == sorted(p.name for p in old)


def _identity(**train):
    params = params_from_dict(write_params_dict(**train)).to_dict()
    return {"params": training_params(params), "data": "0" * 32}


def write_params_dict(**train):
    import yaml

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["train"].update(train)
    return raw


def test_the_split_of_an_updates_micro_batches_is_not_part_of_the_run_but_their_number_is():
    one = comparable(_identity(nproc=1, accum=2))
    assert comparable(_identity(nproc=2, accum=1)) == one
    assert comparable(_identity(nproc=1, nnodes=2, accum=1)) == one
    assert comparable(_identity(nproc=2, accum=2)) != one
    assert comparable(_identity(nproc=1, accum=2, keep=9, save_every=7, compile=True, patience=4)) == one
    assert comparable(_identity(nproc=1, accum=2, warmup=123)) != one


def test_a_checkpoint_written_before_ddp_bf16_grads_continues_as_the_fp32_all_reduce_it_trained_with():
    fp32 = _identity(ddp_bf16_grads=False)
    before = fp32 | {"params": fp32["params"] | {"train": dict(fp32["params"]["train"])}}
    del before["params"]["train"]["ddp_bf16_grads"]
    assert comparable(before) == comparable(fp32)
    assert comparable(before) != comparable(_identity(ddp_bf16_grads=True))  # rounded gradients: another run
    assert training_params(before["params"]) == fp32["params"]  # an ensemble member of such a checkpoint too


def test_a_checkpoint_written_before_the_tokenize_filters_continues_as_the_unfiltered_run_it_was():
    now = _identity()
    before = now | {"params": now["params"] | {"tokenize": {"max_len": now["params"]["tokenize"]["max_len"]}}}
    assert comparable(before) == comparable(now)
    assert training_params(before["params"]) == now["params"]  # an ensemble member of such a checkpoint too
    deduped = now | {"params": now["params"] | {"tokenize": now["params"]["tokenize"] | {"dedupe": True}}}
    assert comparable(before) != comparable(deduped)  # other training pairs: another run


def _checkpoint(identity, step, epoch, bleus=()):
    history = [{"step": 10 * (i + 1), "val_bleu": b} for i, b in enumerate(bleus)]
    return {"identity": identity, "step": step, "epoch": epoch, "history": {"epochs": history}}


def test_a_changed_length_continues_only_where_the_schedule_so_far_is_the_same():
    def per_epoch(epoch):
        return 100

    base = dict(epochs=10, max_steps=0, cooldown=0.3, rdrop_from=0.0, bpe_dropout=0.0)
    early = _checkpoint(_identity(**base), step=500, epoch=5)  # before both cooldowns start (after updates 701 and 841)
    assert restart_reason(early, _identity(**base | {"epochs": 12}), per_epoch) is None
    late = _checkpoint(_identity(**base), step=800, epoch=8)  # inside the old cooldown
    assert "changes the schedule from update 702" in restart_reason(late, _identity(**base | {"epochs": 12}), per_epoch)
    flat = base | {"cooldown": 0.0}
    finished = _checkpoint(_identity(**flat), step=1000, epoch=10)
    assert restart_reason(finished, _identity(**flat | {"max_steps": 1500, "epochs": 15}), per_epoch) is None
    assert "past the new end" in restart_reason(finished, _identity(**flat | {"max_steps": 900}), per_epoch)
    rdrop = base | {"cooldown": 0.0, "rdrop_from": 0.5, "rdrop": 1.0}
    started = _checkpoint(_identity(**rdrop), step=600, epoch=6)  # R-Drop began at 500; with 12 epochs, at 600
    assert "schedule from update 501" in restart_reason(started, _identity(**rdrop | {"epochs": 12}), per_epoch)


def test_a_lowered_patience_that_would_have_stopped_the_run_earlier_restarts_it():
    ckpt = _checkpoint(_identity(patience=0), step=40, epoch=4, bleus=[10.0, 12.0, 11.0, 11.5])
    assert restart_reason(ckpt, _identity(patience=3), lambda e: 10) is None
    assert "would have stopped the run at step 40" not in (
        restart_reason(ckpt, _identity(patience=2), lambda e: 10) or ""
    )
    fired = restart_reason(ckpt, _identity(patience=1), lambda e: 10)
    assert fired == "train.patience 1 would have stopped the run at step 30, before this checkpoint"


def test_a_launch_of_another_world_size_than_the_params_is_one_clear_error(tmp_path, vocab_dir):
    params = write_params(tmp_path, **{"train.nproc": 2})
    result = run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "torchrun started 1 process, but train.nproc × train.nnodes = 2 × 1 = 2" in result.stderr
    assert not (tmp_path / "ckpt").exists()


def test_each_rank_draws_from_a_seed_of_its_own_and_rank_0_from_train_seed():
    from transformer.training.distributed import rank_seed

    assert rank_seed(7, 0) == 7 and len({rank_seed(7, r) for r in range(64)}) == 64


def test_a_checkpoint_of_fewer_ranks_leaves_the_extra_rank_to_a_stream_of_its_own():
    import torch

    rng = {"cpu": [torch.get_rng_state()], "cuda": [None]}
    assert checkpoints.restore_rng(rng, 0, torch.device("cpu"))
    assert not checkpoints.restore_rng(rng, 1, torch.device("cpu"))  # no IndexError
