"""The scripts beside bench/bench.py run end to end, on its synthetic corpus and a tiny model;
their timings are not checked, only that each row is measured and printed."""

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "bench"))
import dropout_masks  # noqa: E402
import gpu_attention  # noqa: E402
import loss_memory  # noqa: E402
import rdrop_loss  # noqa: E402
import update_profile  # noqa: E402

import bench  # noqa: E402
import transformer.dropout  # noqa: E402
import transformer.loss  # noqa: E402
from transformer.distributed import use_bf16  # noqa: E402


@pytest.fixture(autouse=True)
def tiny_model(monkeypatch):
    monkeypatch.setitem(bench.SIZES, "small", bench.Size("small", N=1, d_model=16, d_ff=32, h=2))


def run(main, args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


def test_update_profile_lists_the_matmuls_and_its_shares_by_kind_add_up_to_the_whole():
    every_op = ["--updates", "1", "--rows", "1000"]  # the tiny model's mask draws rank about 40th of 127 ops
    out = run(update_profile.main, [*every_op, "--warmup", "1"])
    assert "aten::mm" in out and "aten::random_" in out and "aten::bernoulli_" not in out  # our masks
    assert "aten::bernoulli_" in run(update_profile.main, [*every_op, "--masks", "torch"])
    assert "R-Drop α 5.0 on 50% of the sentences;" in run(update_profile.main, [*every_op, "--share", "0.5"])
    kinds = next(line for line in out.splitlines() if line.startswith("by kind:")).removeprefix("by kind:")
    shares = {k.rsplit(" ", 1)[0].strip(): float(k.rsplit(" ", 1)[1].rstrip("%")) for k in kinds.split(",")}
    assert list(shares) == ["matmuls", "dropout masks", "casts and copies", "the rest"]
    assert shares["matmuls"] > 0 and sum(shares.values()) == pytest.approx(100, abs=0.3)


def test_dropout_masks_times_both_ways_in_each_row_and_leaves_ours_in_the_model():
    out = run(dropout_masks.main, ["--reps", "1"])
    assert out.count("× torch's speed") == 6  # three rows, two ways
    assert transformer.dropout.dropout is dropout_masks.WAYS["ours"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dropout_masks_times_the_precision_asked_for(precision):
    assert f"; {precision}; " in run(dropout_masks.main, ["--reps", "1", "--precision", precision])


def test_rdrop_loss_times_every_block_size_and_both_updates(monkeypatch):
    monkeypatch.setattr(transformer.loss, "_BLOCK", transformer.loss._BLOCK)  # the script sets it
    out = run(rdrop_loss.main, ["--reps", "1"])
    assert out.count("× whole's speed") == len(rdrop_loss.BLOCKS) + 2


def test_loss_memory_measures_both_losses_whole_and_fused_in_each_precision():
    out = run(loss_memory.main, ["--tokens", "400", "--vocab", "300", "--d-model", "16", "--reps", "1"])
    precisions = 1 + use_bf16("auto", torch.device("cpu"))
    assert out.count("MB whole") == out.count("MB fused") == out.count(" s a call ") == 2 * precisions
    assert "token_loss fp32: peak " in out and "rdrop_loss fp32: peak " in out
    assert "(the code takes the whole loss)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without a CUDA device")
def test_gpu_attention_refuses_a_host_without_cuda_before_it_reads_anything(tmp_path):
    result = CliRunner().invoke(gpu_attention.main, ["--vocab-dir", str(tmp_path)])
    assert result.exit_code == 1 and "needs a CUDA device" in result.output
