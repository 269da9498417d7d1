"""bench/bench.py's training rows: bf16 rows only where the CPU has bf16 hardware."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_SIZES

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "bench"))
import bench  # noqa: E402

TINY = bench.Size("tiny", **TINY_SIZES)
PLAN = bench.Plan(sizes=("tiny",), warmup=(0,), row_seconds=(0.0,), decode_sentences=4, matmul_seconds=0.0)


@pytest.fixture(autouse=True)
def _traced_without_a_cpp_build(monkeypatch):
    """The compiled rows (n, p) run dynamo's graphs eagerly here: inductor would build C++ for each."""
    monkeypatch.setattr(bench, "COMPILE_BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "synthetic.pt"
    bench.write_synthetic(path, 11_000, 50, seed=1)  # 40 batches of 256 sentences
    return bench.Data(bench.ParallelCorpus(path), 50, 50, True, "synthetic")


@pytest.fixture(scope="module")
def fp32_rows(data):
    """The training rows a CPU without bf16 hardware runs, run once for the tests that read them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "COMPILE_BACKEND", "aot_eager")  # as _traced_without_a_cpp_build, for this module
        return bench.training_rows(TINY, data, PLAN, {"fp32": 1.0})


def test_without_a_bf16_peak_the_bf16_rows_are_left_out_and_the_rest_compared(fp32_rows):
    rows = fp32_rows
    assert [r["key"] for r in rows] == ["a", "b", "c", "d", "r", "t", "v", "x", "m", "n"]
    assert {r["key"]: r["vs"] for r in rows} == {
        "a": "b",
        "b": None,
        "c": "d",
        "d": None,
        "r": "c",
        "t": "c",
        "v": "r",
        "x": "r",
        "m": "c",
        "n": "m",
    }
    assert all(r["dtype"] == "fp32" and r["tokens_per_s"] > 0 for r in rows)
    assert "bf16 not measured" in bench.table({"fp32": 1.0}, 0.0, rows)


def test_with_a_bf16_peak_rows_e_f_s_u_w_and_y_run_in_bf16(data):
    rows = bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0})
    assert [(r["key"], r["dtype"], r["vs"]) for r in rows[4:]] == [
        ("e", "bf16", "d"),
        ("f", "bf16", "d"),
        ("r", "fp32", "c"),
        ("s", "bf16", "e"),
        ("t", "fp32", "c"),
        ("u", "bf16", "e"),
        ("v", "fp32", "r"),
        ("w", "bf16", "s"),
        ("x", "fp32", "r"),
        ("y", "bf16", "s"),
        ("m", "fp32", "c"),
        ("n", "fp32", "m"),
        ("o", "bf16", "e"),
        ("p", "bf16", "o"),
    ]


def test_the_rdrop_row_counts_corpus_tokens_once_and_credits_both_passes(fp32_rows):
    rows = {r["key"]: r for r in fp32_rows}
    c, r = rows["c"], rows["r"]
    assert (c["updates"], c["target_tokens"]) == (r["updates"], r["target_tokens"])  # the same timed batches
    assert r["flops_per_token"] == pytest.approx(2 * c["flops_per_token"], abs=1)


def test_the_shared_encoder_row_credits_one_encoder_pass_and_two_decoder_passes(data, fp32_rows):
    rows = {r["key"]: r for r in fp32_rows}
    c, r, v = rows["c"], rows["r"], rows["v"]
    assert (v["updates"], v["target_tokens"]) == (r["updates"], r["target_tokens"])
    encoder = sum(
        bench.train_flops(b, TINY, 50, 2) - bench.train_flops(b, TINY, 50, 2, shared_encoder=True)
        for b in bench.training_batches(data.corpus, bench.MAX_BATCHES)["token batches"][: v["updates"]]
    )
    assert 0 < encoder / v["target_tokens"] < c["flops_per_token"]
    assert v["flops_per_token"] == pytest.approx(r["flops_per_token"] - encoder / v["target_tokens"], abs=1)


def test_the_half_rdrop_row_credits_one_and_a_half_passes(fp32_rows):
    rows = {r["key"]: r for r in fp32_rows}
    c, r, x = rows["c"], rows["r"], rows["x"]
    assert (x["updates"], x["target_tokens"]) == (r["updates"], r["target_tokens"])
    assert x["flops_per_token"] == pytest.approx(1.5 * c["flops_per_token"], abs=1)


def test_ours_keeps_freed_memory_as_training_does_but_rows_t_and_u_and_the_baseline_do_not(data, monkeypatch):
    kept = []
    monkeypatch.setattr(bench, "keep_freed_memory", lambda keep=True: kept.append(keep))
    rows = bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0})
    keys = ["a", "b", "c", "d", "e", "f", "r", "s", "t", "u", "v", "w", "x", "y", "m", "n", "o", "p"]
    assert [r["key"] for r in rows] == keys
    malloc_defaults = {"b", "d", "t", "u"}  # the baseline's rows, and those about glibc's settings
    assert kept == [key not in malloc_defaults for key in keys] + [True]  # each row's, then training's again


def test_rows_asked_for_are_the_rows_run_and_glibcs_settings_only_on_glibc(data, monkeypatch):
    rows = bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0}, keys="ctu")
    assert [r["key"] for r in rows] == ["c", "t", "u"]  # this test process runs on glibc's malloc
    monkeypatch.setattr(bench, "allocator", lambda: "mimalloc")
    assert [r["key"] for r in bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0}, keys="ctu")] == ["c"]


def test_a_compiled_rows_warm_up_takes_every_trace_its_timed_updates_would_need(data, monkeypatch):
    traces = []

    def counting(graph, example_inputs):
        traces.append(graph)
        return graph.forward  # run as traced, without a C++ build

    monkeypatch.setattr(bench, "COMPILE_BACKEND", counting)
    torch._dynamo.reset()  # the other tests' traces of the same code would count toward dynamo's limit
    batches = bench.training_batches(data.corpus, bench.MAX_BATCHES)["token batches to 8"]
    same = [b for b in batches if b.src.size(1) == b.tgt_in.size(1)]
    parted = [b for b in batches if b.src.size(1) != b.tgt_in.size(1)]
    # S == T past the least warm-up, so duck sizing's second trace comes after it
    batches = same[: bench.COMPILE_WARMUP + 1] + parted[:2] + same[-2:]
    warmup = bench.compile_warmup(batches)
    assert warmup == bench.COMPILE_WARMUP + 2
    assert bench.compile_warmup(batches[-3:] + batches[:-3]) == bench.COMPILE_WARMUP  # S != T first: one trace
    step = bench.ours_step(data, TINY, bf16=False, compile=True)
    for batch in batches[:warmup]:
        step(batch)
    assert len(traces) == 2
    for batch in batches[warmup:]:
        step(batch)
    assert len(traces) == 2  # no trace among the timed updates
