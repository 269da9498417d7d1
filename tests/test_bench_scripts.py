"""The scripts beside bench/bench.py run end to end, on its synthetic corpus and a tiny model;
their timings are not checked, only that each row is measured and printed."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
import torch
from click.testing import CliRunner
from conftest import ROOT, TINY_SIZES
from test_docs import shell_commands

from bench import ab, common, gpu_attention, gpu_check, gpu_profile, scale, update_profile


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


SLOWER = """
_ours_step = ours_step


def ours_step(*args, **kwargs):  # the other checkout's update, a second slower: more than a loaded host's noise
    step = _ours_step(*args, **kwargs)

    def slower(batch):
        time.sleep(1.0)
        return step(batch)

    return slower
"""


def checkout_copy(tmp_path: Path, appended: str) -> Path:
    """A copy of this checkout's packages, with `appended` at the end of its bench/common.py."""
    copy = tmp_path / "other"
    for name in ab.CHECKOUT:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, copy / name)
    with open(copy / "bench" / "common.py", "a", encoding="utf-8") as f:
        f.write(appended)
    return copy


def test_ab_times_each_checkouts_own_code_on_the_same_batches_and_puts_this_checkouts_modules_back(tmp_path):
    other = checkout_copy(tmp_path, SLOWER)
    rows = ["--rows", "ours-256,annotated-transformer", "--updates", "4", "--warmup", "1"]
    run(ab.main, ["--against", str(other), *rows, "--out", str(tmp_path / "ab.json")])
    by_row = {r["row"]: r for r in json.loads((tmp_path / "ab.json").read_text())["rows"]}
    assert list(by_row) == ["ours-256", "annotated-transformer"]
    assert by_row["ours-256"]["ms_other"] > by_row["ours-256"]["ms_this"] + 500  # the other's sleep, on its side
    assert by_row["ours-256"]["speed_ratio"] > 1.5
    assert 0.5 < by_row["annotated-transformer"]["median_ratio"] < 2  # the same code on both sides
    assert sys.modules["bench.common"] is common and sys.modules["bench.ab"] is ab


def test_ab_refuses_checkouts_that_batch_differently_an_unknown_revision_and_rows_it_cannot_compare(tmp_path):
    other = checkout_copy(tmp_path, "SEED = 4321\n")
    result = CliRunner().invoke(ab.main, ["--against", str(other), "--out", str(tmp_path / "ab.json")])
    assert result.exit_code == 1 and "batch the corpus differently" in result.output
    result = CliRunner().invoke(ab.main, ["--against", "no-such-revision"])
    assert result.exit_code == 1 and "git archive no-such-revision" in result.output
    result = CliRunner().invoke(ab.main, ["--against", str(other), "--rows", "compiled-fp32"])
    assert result.exit_code == 1 and "compiled-fp32        left out: compiled:" in result.output
    assert "no row to compare" in result.output
    assert not (tmp_path / "ab.json").exists()


def test_ab_unpacks_a_revision_with_the_packages_it_loads(tmp_path):
    unpacked = ab.unpack("HEAD", tmp_path)
    assert (unpacked / "bench" / "bench.py").is_file() and (unpacked / "transformer" / "__init__.py").is_file()
    assert (unpacked / "params.yaml").read_bytes() == subprocess.run(
        ["git", "show", "HEAD:params.yaml"], cwd=ROOT, capture_output=True, check=True
    ).stdout


@pytest.mark.slow  # about 80 CPU seconds: torch.compile tracing the two compiled rows, and four runs of the train stage
def test_gpu_check_dry_run_reports_every_figure_of_both_sizes_compiled_or_not_and_a_bit_identical_resume(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(gpu_check, "CUDA_TESTS", ("tests/test_distributed.py",))  # their CPU halves: seconds
    out = run(gpu_check.main, ["--dry-run", "--out", str(tmp_path / "report.json")])
    report = json.loads((tmp_path / "report.json").read_text())
    parts = {"machine", "tests", "peak_tflops", "train", "loss", "attention", "resume", "runtime_s", "flops_formula"}
    assert parts <= set(report)
    assert report["tests"]["exit_code"] == 0 and report["tests"]["counts"]["passed"] >= 2
    assert report["datasheet_peak"] == {"card": "cpu", "tflops": None, "dtype": None}
    rows = report["train"]
    assert [(r["size"], r["compile"]) for r in rows] == [("base", False), ("base", True), ("big", False), ("big", True)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["ms_per_update"] > 0 and 0 <= r["waits_on_host_share"] <= 1
        for side in ("src", "tgt"):
            assert 0 < r[f"{side}_real_tokens_per_update"] <= r[f"{side}_padded_tokens_per_update"]
            assert r[f"{side}_padded_tokens_per_update"] <= r["accum"] * r["max_tokens"]
        # the unprofiled timing's tokens/s is the target's real tokens of an update over its time
        target = r["tokens_per_s"] * r["ms_per_update"] / 1000
        assert target == pytest.approx(r["tgt_real_tokens_per_update"], rel=1e-3)
        peak = report["peak_tflops"][r["dtype"]] * 1e12
        assert 0 < r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / peak, rel=0.05)
        assert r["mfu_datasheet"] is None  # a CPU has no datasheet peak here
        assert any("mm" in k for k in r["top_kernels"])
        # on a CPU in bf16 attention is written out, and compiled it is traced into the graph: matmuls and a
        # softmax either way, no kernel of its own
        assert r["attention_kernels"] or r["compile"] or r["dtype"] == "bf16"
        categories, phases = r["device_ms_by_category"], r["device_ms_by_phase"]
        assert categories["GEMM"] > 0 and categories["optimizer"] > 0
        assert categories.get("loss", 0) > 0 or r["compile"]  # eager: the loss phase's kernels but its matmuls
        assert sum(categories.values()) == pytest.approx(r["device_busy_ms_per_update"], abs=0.01)
        assert sum(phases.values()) == pytest.approx(sum(categories.values()), abs=0.01)
        # every op of an update falls in one of its phases; compiled, the loss is traced into the forward's graph
        assert set(phases) == ({"forward", "backward", "step"} | ({"loss"} if not r["compile"] else set()))
        assert all(ms > 0 for ms in phases.values())
        assert ("compile_s" in r) == r["compile"]
    for r in (rows[1], rows[3]):
        assert r["compile_s"] >= 0 and r["frames_compiled"] >= 1 and r["recompiles"] >= 0 and r["graph_breaks"] >= 0
    assert rows[2]["flops_per_token"] > rows[0]["flops_per_token"]  # bench's count: wider
    loop = report["trainer"]  # the train stage at the base row's sizes, timed by its own clock
    assert loop["vocab_kind"] == "bpe" and loop["vocab_size"] == 200  # the tiny preset's vocab.size, reached
    assert loop["updates"] == gpu_check.LOG_EVERY and loop["steps"] == loop["warmup_updates"] + loop["updates"]
    assert loop["tokens_per_s"] > 0 and loop["ms_per_update"] > 0
    assert 0 <= loop["batch_wait_s"] <= loop["train_time_s"]  # the waits are inside the loop's clock
    target = loop["tokens_per_s"] * loop["ms_per_update"] / 1000
    assert target == pytest.approx(loop["tgt_real_tokens_per_update"], rel=1e-3)
    assert loop["ratio_to_eager_row"] == pytest.approx(loop["tokens_per_s"] / rows[0]["tokens_per_s"], abs=1e-3)
    peak = report["peak_tflops"][loop["dtype"]] * 1e12
    assert 0 < loop["mfu"] == pytest.approx(loop["flops_per_token"] * loop["tokens_per_s"] / peak, rel=0.05)
    assert "the train stage, base: " in out and " of the eager row's tokens/s" in out
    loss = report["loss"]
    assert loss["fused_ms"] > 0 and loss["plain_ms"] > 0 and loss["loss_relative_difference"] < 1e-2
    attention = report["attention"]  # a CPU: torch's masked attention alone, flash's kernel needs a card
    assert attention["masked_ms"] > 0 and "varlen_ms" not in attention and attention["varlen_max_difference"] is None
    assert 0 < attention["real_source_share"] < 1 and attention["sentences"] > 1
    assert f"source attention of a micro-batch: masked {attention['masked_ms']} ms\n" in out
    resume = report["resume"]
    assert resume["killed_at_step"] and resume["killed_at_step"] < resume["steps"] and resume["bit_identical"]
    assert "resume after kill -9: largest weight difference 0" in out


def test_gpu_check_with_its_budget_spent_records_every_part_as_skipped_with_the_reason(tmp_path):
    out = run(gpu_check.main, ["--dry-run", "--budget-s", "0", "--out", str(tmp_path / "report.json")])
    report = json.loads((tmp_path / "report.json").read_text())
    parts = [report[key] for key in ("peak_tflops", "trainer", "loss", "attention", "resume", "tests")]
    parts += report["train"]
    assert len(parts) == 10 and all("the budget of 0 s was spent" in part["skipped"] for part in parts)
    assert [(r["size"], r["compile"]) for r in report["train"]][-1] == ("big", True)
    assert "big   compiled skipped: the budget of 0 s was spent" in out
    assert "the train stage, base: skipped: the budget of 0 s was spent" in out


def test_the_loops_timed_seconds_leave_its_first_sync_window_out_and_need_whole_windows(tmp_path):
    every, steps = gpu_check.LOG_EVERY, tmp_path / "steps.tsv"

    def report(rates: list[float]) -> Path:  # as RunRecord writes it: a window's rows share its tokens/s
        rows = [f"{k + 1}\t5.0\t1e-05\t{rate:g}" for k, rate in enumerate(rates)]
        steps.write_text("step\tloss\tlr\ttokens_per_s\n" + "\n".join(rows) + "\n")
        return steps

    rates, tokens = [1000.0] * every + [50.0] * every + [40.0] * every, [10] * 2 * every + [20] * every
    assert gpu_check.after_warmup(report(rates), tokens) == pytest.approx(every * 10 / 50 + every * 20 / 40)
    rates[-1] = 41.0  # a window cut short: an epoch's end or a checkpoint among the timed updates
    with pytest.raises(click.ClickException, match="not one sync window"):
        gpu_check.after_warmup(report(rates), tokens)


def test_a_part_that_raises_is_recorded_with_its_exception_and_the_parts_after_it_still_run(tmp_path):
    report = gpu_check.Report(tmp_path / "report.json", 60.0, {"dry_run": True})

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    report.row("train", {"size": "base", "compile": False}, out_of_memory)
    on_disk = json.loads((tmp_path / "report.json").read_text())  # written before the next part begins
    assert on_disk["train"] == [
        {
            "size": "base",
            "compile": False,
            "error": {"type": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB"},
        }
    ]
    report.row("train", {"size": "base", "compile": True}, lambda: {"tokens_per_s": 1.0})
    report.section("loss", lambda: {"fused_ms": 2.0})
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["train"][1]["tokens_per_s"] == 1.0 and on_disk["loss"] == {"fused_ms": 2.0}


def test_gpu_check_killed_after_its_first_row_leaves_that_row_on_disk_as_valid_json(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)]
    job = subprocess.Popen(cmd, cwd=common.ROOT, env=os.environ | {"PYTHONPATH": str(common.ROOT)})
    try:
        while job.poll() is None and not (out.exists() and json.loads(out.read_text()).get("train")):
            time.sleep(0.3)
        assert job.poll() is None, "it ended before it could be killed"
        job.send_signal(signal.SIGKILL)
        job.wait()
    finally:
        job.kill()
        job.wait()
    report = json.loads(out.read_text())  # valid JSON: every write replaced the file whole
    assert report["peak_tflops"]["bf16"] > 0
    assert len(report["train"]) == 1 and report["train"][0]["tokens_per_s"] > 0
    assert "loss" not in report and "resume" not in report and "tests" not in report  # not reached


def test_datasheet_peaks_by_the_cards_name_and_none_for_a_card_not_listed():
    peaks = {
        name: gpu_check.datasheet_peak(name)["tflops"]
        for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA L4")
    }
    assert list(peaks.values()) == [989.0, 756.0, 989.0, 312.0, 121.0]
    assert gpu_check.datasheet_peak("Tesla T4") == {"card": "Tesla T4", "tflops": 65.0, "dtype": "fp16"}
    assert gpu_check.datasheet_peak("NVIDIA L40S")["tflops"] is None  # not the L4's
    assert gpu_check.datasheet_peak("NVIDIA H100 NVL")["tflops"] is None


def test_a_cuda_kernel_is_placed_at_its_launching_ops_host_time_and_the_devices_annotation_ranges_are_left_out():
    def event(name, device, start, end, id=0, linked=0, annotation=False):
        kind = SimpleNamespace(name=device)
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(
            name=name,
            device_type=kind,
            time_range=span,
            id=id,
            linked_correlation_id=linked,
            is_user_annotation=annotation,
        )

    events = [
        event("gpu_check::forward", "CPU", 100, 200, id=1, annotation=True),
        event("aten::mm", "CPU", 120, 130, id=7),
        event("gpu_check::forward", "CUDA", 900, 990, annotation=True),  # the range drawn on the device's timeline
        event("sm90_xmma_gemm_bf16", "CUDA", 950, 980, linked=7),  # ran long after the host left the range
        event("Memcpy DtoD", "CUDA", 990, 995),  # linked to no op
    ]
    work = gpu_profile.device_work(events, torch.device("cuda"))
    assert work == [("sm90_xmma_gemm_bf16", 120, 30), ("Memcpy DtoD", None, 5)]


def test_kernels_fall_in_their_category_by_name_the_loss_before_attention_and_the_norm_before_elementwise():
    kernels = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM",
        "aten::mm": "GEMM",
        "flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>": "attention",
        "triton_red_fused__log_softmax__to_copy_0": "loss",
        "void at::native::cunn_SoftMaxForward<LogSoftMaxForwardEpilogue>": "loss",
        "triton_per_fused_add_native_dropout_native_layer_norm_3": "norm",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, AddFunctor<float>>": "elementwise",
        "Memcpy HtoD (Pageable -> Device)": "other",
    }
    assert {name: gpu_profile.category(name) for name in kernels} == kernels
    # the fused loss's kernels have no name of their own: in the loss phase they count as the loss, but its matmuls
    phased = [("aten::softmax", "loss"), ("aten::softmax", "forward"), ("aten::mm", "loss"), ("aten::exp", "loss")]
    assert [gpu_profile.by_category(*k) for k in phased] == ["loss", "attention", "GEMM", "loss"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without a CUDA device")
def test_gpu_check_without_a_gpu_or_dry_run_stops_with_one_line(tmp_path):
    result = CliRunner().invoke(gpu_check.main, ["--out", str(tmp_path / "report.json")])
    assert result.exit_code == 1 and result.output.startswith("Error: no CUDA device")
    assert result.output.count("\n") == 1
    assert not (tmp_path / "report.json").exists()


def test_the_scale_pages_cuda_test_command_runs_the_files_gpu_check_runs():
    commands = [" ".join(line.split()) for line in shell_commands(ROOT / "docs" / "scale.md")]
    assert f'python -m pytest -k "cuda or gpu" {" ".join(gpu_check.CUDA_TESTS)}' in commands
