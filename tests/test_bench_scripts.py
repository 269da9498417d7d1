"""The scripts beside bench/bench.py run end to end, on its synthetic corpus and a tiny model;
their timings are not checked, only that each row is measured and printed."""

import json
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import TINY_SIZES

from bench import common, gpu_attention, gpu_check, scale, update_profile


@pytest.fixture(autouse=True)
def tiny_model(monkeypatch):
    monkeypatch.setitem(common.SIZES, "small", common.Size("small", **TINY_SIZES))


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without a CUDA device")
def test_gpu_attention_refuses_a_host_without_cuda_before_it_reads_anything(tmp_path):
    result = CliRunner().invoke(gpu_attention.main, ["--vocab-dir", str(tmp_path)])
    assert result.exit_code == 1 and "needs a CUDA device" in result.output


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
