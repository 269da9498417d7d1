"""The scripts beside bench/bench.py run end to end, on its synthetic corpus and a tiny model;
their timings are not checked, only that each row is measured and printed."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import TINY_SIZES

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "bench"))
import allocators  # noqa: E402
import attention_bf16  # noqa: E402
import batches  # noqa: E402
import dropout_masks  # noqa: E402
import gpu_attention  # noqa: E402
import gpu_check  # noqa: E402
import loss_memory  # noqa: E402
import rdrop_loss  # noqa: E402
import row_buckets  # noqa: E402
import scale  # noqa: E402
import update_profile  # noqa: E402

import bench  # noqa: E402
import transformer.kernels.dropout  # noqa: E402
import transformer.kernels.packing  # noqa: E402
import transformer.training.loss  # noqa: E402
from transformer.training.distributed import use_bf16  # noqa: E402


@pytest.fixture(autouse=True)
def tiny_model(monkeypatch):
    monkeypatch.setitem(bench.SIZES, "small", bench.Size("small", **TINY_SIZES))


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
    mfu = re.search(r"matmuls: [\d,]+ GFLOP/s in their own time, ([\d.]+)% .* the update: ([\d.]+)% MFU", out)
    ceiling, update = float(mfu[1]), float(mfu[2])
    assert 0 < update < ceiling  # the matmuls' own time is a part of the whole
    assert update == pytest.approx(ceiling * shares["matmuls"] / 100, rel=0.05, abs=0.1)
    lines = out.split("casts and copies by the op that made them:\n")[1].split("\nmatmuls:")[0].splitlines()
    origins = {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1].rstrip("%")) for line in lines}
    assert origins and not any(o.split(":")[0] in update_profile.COPY_PATHS for o in origins)  # walked up to the op
    assert sum(origins.values()) == pytest.approx(shares["casts and copies"], abs=0.05 * len(origins) + 0.1)


def test_dropout_masks_times_both_ways_in_each_row_and_leaves_ours_in_the_model():
    out = run(dropout_masks.main, ["--reps", "1"])
    assert out.count("× torch's speed") == 6  # three rows, two ways
    assert transformer.kernels.dropout.dropout is dropout_masks.WAYS["ours"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dropout_masks_times_the_precision_asked_for(precision):
    assert f"; {precision}; " in run(dropout_masks.main, ["--reps", "1", "--precision", precision])


def test_rdrop_loss_times_every_block_size_and_both_updates(monkeypatch):
    monkeypatch.setattr(transformer.training.loss, "_BLOCK", transformer.training.loss._BLOCK)  # the script sets it
    out = run(rdrop_loss.main, ["--reps", "1"])
    assert out.count("× whole's speed") == len(rdrop_loss.BLOCKS) + 2


def test_batches_times_this_trees_batching_and_another_commits_on_the_same_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "MULTI30K_TRAIN", 2000)
    out = tmp_path / "batches.json"
    run(batches.main, ["--before", "HEAD", "--rounds", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["sentences"] == 2000 and set(report["us_a_sentence"]) == {"now", "HEAD"}
    assert all(us > 0 for us in report["us_a_sentence"].values())


def test_batches_stops_where_another_commits_batches_differ(monkeypatch):
    original = batches.batching_at

    def reordered(rev):  # a version that puts every batch's sentences in reverse order
        module = original(rev)
        batch = module.ParallelCorpus.batch
        monkeypatch.setattr(module.ParallelCorpus, "batch", lambda self, index: batch(self, index[::-1]))
        return module

    monkeypatch.setattr(bench, "MULTI30K_TRAIN", 500)
    monkeypatch.setattr(batches, "batching_at", reordered)
    result = CliRunner().invoke(batches.main, ["--before", "HEAD", "--rounds", "1"])
    assert result.exit_code == 1 and "the batches differ from HEAD's" in result.output


def test_loss_memory_measures_both_losses_whole_and_fused_in_each_precision():
    out = run(loss_memory.main, ["--tokens", "400", "--vocab", "300", "--d-model", "16", "--reps", "1"])
    precisions = 1 + use_bf16("auto", torch.device("cpu"))
    assert out.count("MB whole") == out.count("MB fused") == out.count(" s a call ") == 2 * precisions
    assert "token_loss fp32: peak " in out and "rdrop_loss fp32: peak " in out
    assert "(the code takes the fused loss)" in out  # at any size, with the model's Linear generator


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without a CUDA device")
def test_gpu_attention_refuses_a_host_without_cuda_before_it_reads_anything(tmp_path):
    result = CliRunner().invoke(gpu_attention.main, ["--vocab-dir", str(tmp_path)])
    assert result.exit_code == 1 and "needs a CUDA device" in result.output


def test_attention_bf16_times_every_arm_and_leaves_torchs_switch_as_it_was():
    before, softmax = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed(), transformer.model.attention._Softmax
    out = run(attention_bf16.main, ["--warmup", "1", "--updates", "2", "--rdrop", "5", "--share", "0.5"])
    assert "R-Drop α 5.0 on 50% of the sentences (2 batches, ms):" in out
    for arm in attention_bf16.ARMS:
        assert re.search(rf"^ +{arm} +[0-9.]+ +[0-9.]+× math in bf16's speed$", out, re.MULTILINE), out
    assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() == before
    assert transformer.model.attention._Softmax is softmax  # put back after its arm


def test_attention_bf16_times_the_softmax_alone_at_every_row_length():
    out = run(attention_bf16.main, ["--softmax-table", "--warmup", "0", "--updates", "1"])
    rows = re.findall(r"^ +(\d+) +(\d+) +[0-9,]+ +[0-9,]+ +[0-9.]+×$", out, re.MULTILINE)
    assert [(int(s), int(b)) for s, b in rows] == [(s, 3000 // s) for s in attention_bf16.LENGTHS], out


@pytest.mark.parametrize("arm", row_buckets.ARMS)
def test_row_buckets_times_an_arm_and_leaves_the_buckets_in_place(arm):
    bucket = transformer.kernels.packing.row_bucket
    out = run(row_buckets.main, ["--arm", arm, "--warmup", "1", "--updates", "2"])
    timed = json.loads(out.splitlines()[-1])
    assert timed["ms_per_update"] > 0 and timed["tokens_per_s"] > 0
    assert transformer.kernels.packing.row_bucket is bucket


def test_row_buckets_compares_the_medians_of_the_bucketed_arm_with_the_others():
    def turn(ms: float, speed: float) -> dict:
        return {"ms_per_update": ms, "tokens_per_s": speed}

    table = row_buckets.summary(
        {"unbucketed": [turn(10, 100), turn(12, 90), turn(8, 110)], "bucketed": [turn(9, 120), turn(7, 130)]}
    )
    assert table == {
        "unbucketed": {"ms_per_update": 10, "tokens_per_s": 100},
        "bucketed": {"ms_per_update": 8, "tokens_per_s": 125},
        "speedup": 1.25,
    }


def test_allocators_compares_each_rows_median_speed_in_each_arm_with_the_firsts():
    def report(speed: float) -> dict:
        return {"train": [{"key": "c", "row": "ours", "tokens_per_s": speed}]}

    table = allocators.summary(
        {
            "glibc": [report(100), report(110), report(90)],
            "mimalloc": [report(99), report(120)],
            "training": [report(95)],
        }
    )
    assert table == [
        {
            "row": "c. ours",
            "glibc": 100,
            "mimalloc": 109.5,
            "training": 95,
            "mimalloc/glibc": 1.095,
            "training/glibc": 0.95,
        }
    ]


def test_allocators_refuses_a_host_without_mimalloc(monkeypatch):
    monkeypatch.setattr(allocators, "mimalloc_library", lambda: None)
    result = CliRunner().invoke(allocators.main, [])
    assert result.exit_code == 1 and "mimalloc is not installed" in result.output


def test_scale_reuses_the_corpus_it_generated_for_the_same_pairs_and_only_then(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "TYPES", 500)  # invented words a language: 1,000,000 take seconds
    scale.words.cache_clear()
    try:
        runs = [scale.generated(tmp_path, pairs) for pairs in (20, 20, 30)]
    finally:
        scale.words.cache_clear()
    assert [run["reused"] for run in runs] == [False, True, False]
    assert len((tmp_path / "corpus" / "train.en").read_text(encoding="utf-8").splitlines()) == 30


@pytest.mark.slow  # about 70 CPU seconds, most of them torch.compile's tracing of the two compiled rows
def test_gpu_check_dry_run_reports_every_figure_of_both_sizes_compiled_or_not_and_a_bit_identical_resume(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(gpu_check, "CUDA_TESTS", ("tests/test_distributed.py",))  # their CPU halves: seconds
    out = run(gpu_check.main, ["--dry-run", "--out", str(tmp_path / "report.json")])
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"machine", "tests", "peak_tflops", "train", "resume", "runtime_s", "flops_formula"} <= set(report)
    assert report["tests"]["exit_code"] == 0 and report["tests"]["counts"]["passed"] >= 2
    rows = {(r["size"], r["compile"]): r for r in report["train"]}
    assert set(rows) == {(size, compiled) for size in ("base", "big") for compiled in (False, True)}
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["ms_per_update"] > 0 and 0 <= r["waits_on_host_share"] <= 1
        assert r["tokens_per_s"] * r["ms_per_update"] / 1000 <= r["accum"] * r["max_tokens"]  # padded cap
        peak = report["peak_tflops"][r["dtype"]] * 1e12
        assert 0 < r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / peak, rel=0.05)
        assert any("mm" in k for k in r["top_kernels"])
        # on a CPU in bf16 attention is written out, and compiled it is traced into the graph: matmuls and a
        # softmax either way, no kernel of its own
        assert r["attention_kernels"] or r["compile"] or r["dtype"] == "bf16"
    assert rows["big", False]["flops_per_token"] > rows["base", False]["flops_per_token"]  # bench's count: wider
    resume = report["resume"]
    assert resume["killed_at_step"] and resume["killed_at_step"] < resume["steps"] and resume["bit_identical"]
    assert "resume after kill -9: largest weight difference 0" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without a CUDA device")
def test_gpu_check_without_a_gpu_or_dry_run_stops_with_one_line(tmp_path):
    result = CliRunner().invoke(gpu_check.main, ["--out", str(tmp_path / "report.json")])
    assert result.exit_code == 1 and result.output.startswith("Error: no CUDA device")
    assert result.output.count("\n") == 1
    assert not (tmp_path / "report.json").exists()
