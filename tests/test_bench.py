"""bench/bench.py's training rows: bf16 rows only where the CPU has bf16 hardware."""

import pytest
import torch
from conftest import TINY_SIZES

from bench import bench, common

TINY = common.Size("tiny", **TINY_SIZES)
PLAN = bench.Plan(sizes=("tiny",), warmup=(0,), row_seconds=(0.0,), decode_sentences=4, matmul_seconds=0.0)


@pytest.fixture(autouse=True)
def _traced_without_a_cpp_build(monkeypatch):
    """The compiled rows run dynamo's graphs eagerly here: inductor would build C++ for each."""
    monkeypatch.setattr(common, "COMPILE_BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "synthetic.pt"
    common.write_synthetic(path, 11_000, 50, seed=1)  # 40 batches of 256 sentences
    return common.Data(common.ParallelCorpus(path), 50, 50, True, "synthetic")


@pytest.fixture(scope="module")
def fp32_rows(data):
    """The training rows a CPU without bf16 hardware runs, run once for the tests that read them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "COMPILE_BACKEND", "aot_eager")  # as _traced_without_a_cpp_build, for this module
        return bench.training_rows(TINY, data, PLAN, {"fp32": 1.0})


def test_without_a_bf16_peak_the_bf16_rows_are_left_out_and_the_rest_compared(fp32_rows):
    rows = fp32_rows
    assert [r["key"] for r in rows] == [
        "ours-256",
        "baseline-256",
        "plain-fp32",
        "annotated-transformer",
        "rdrop-fp32",
        "glibc-fp32",
        "rdrop-shared-fp32",
        "rdrop-half-fp32",
        "pad8-fp32",
        "compiled-fp32",
        "compiled-rdrop-half-fp32",
    ]
    assert {r["key"]: r["vs"] for r in rows} == {
        "ours-256": "baseline-256",
        "baseline-256": None,
        "plain-fp32": "annotated-transformer",
        "annotated-transformer": None,
        "rdrop-fp32": "plain-fp32",
        "glibc-fp32": "plain-fp32",
        "rdrop-shared-fp32": "rdrop-fp32",
        "rdrop-half-fp32": "rdrop-fp32",
        "pad8-fp32": "plain-fp32",
        "compiled-fp32": "pad8-fp32",
        "compiled-rdrop-half-fp32": "rdrop-half-fp32",
    }
    assert all(r["dtype"] == "fp32" and r["tokens_per_s"] > 0 for r in rows)
    assert "bf16 not measured" in bench.table({"fp32": 1.0}, 0.0, rows)


def test_with_a_bf16_peak_the_bf16_rows_run_in_bf16(data):
    rows = bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0})
    assert [(r["key"], r["dtype"], r["vs"]) for r in rows[4:]] == [
        ("plain-bf16", "bf16", "annotated-transformer"),
        ("torch-attention-bf16", "bf16", "annotated-transformer"),
        ("rdrop-fp32", "fp32", "plain-fp32"),
        ("rdrop-bf16", "bf16", "plain-bf16"),
        ("glibc-fp32", "fp32", "plain-fp32"),
        ("glibc-bf16", "bf16", "plain-bf16"),
        ("rdrop-shared-fp32", "fp32", "rdrop-fp32"),
        ("rdrop-shared-bf16", "bf16", "rdrop-bf16"),
        ("rdrop-half-fp32", "fp32", "rdrop-fp32"),
        ("rdrop-half-bf16", "bf16", "rdrop-bf16"),
        ("pad8-fp32", "fp32", "plain-fp32"),
        ("compiled-fp32", "fp32", "pad8-fp32"),
        ("pad8-bf16", "bf16", "plain-bf16"),
        ("compiled-bf16", "bf16", "pad8-bf16"),
        ("compiled-rdrop-half-fp32", "fp32", "rdrop-half-fp32"),
        ("compiled-rdrop-half-bf16", "bf16", "rdrop-half-bf16"),
    ]


def test_the_rdrop_row_counts_corpus_tokens_once_and_credits_both_passes(fp32_rows):
    rows = {r["key"]: r for r in fp32_rows}
    c, r = rows["plain-fp32"], rows["rdrop-fp32"]
    assert (c["updates"], c["target_tokens"]) == (r["updates"], r["target_tokens"])  # the same timed batches
    assert r["flops_per_token"] == pytest.approx(2 * c["flops_per_token"], abs=1)


def test_the_shared_encoder_row_credits_one_encoder_pass_and_two_decoder_passes(data, fp32_rows):
    rows = {r["key"]: r for r in fp32_rows}
    c, r, v = rows["plain-fp32"], rows["rdrop-fp32"], rows["rdrop-shared-fp32"]
    assert (v["updates"], v["target_tokens"]) == (r["updates"], r["target_tokens"])
    encoder = sum(
        common.train_flops(b, TINY, 50, 2) - common.train_flops(b, TINY, 50, 2, shared_encoder=True)
        for b in common.training_batches(data.corpus, bench.MAX_BATCHES)["token batches"][: v["updates"]]
    )
    assert 0 < encoder / v["target_tokens"] < c["flops_per_token"]
    assert v["flops_per_token"] == pytest.approx(r["flops_per_token"] - encoder / v["target_tokens"], abs=1)


def test_the_half_rdrop_row_credits_one_and_a_half_passes(fp32_rows):
    rows = {r["key"]: r for r in fp32_rows}
    c, r, x = rows["plain-fp32"], rows["rdrop-fp32"], rows["rdrop-half-fp32"]
    assert (x["updates"], x["target_tokens"]) == (r["updates"], r["target_tokens"])
    assert x["flops_per_token"] == pytest.approx(1.5 * c["flops_per_token"], abs=1)


def test_ours_keeps_freed_memory_as_training_does_but_the_glibc_rows_and_the_baseline_do_not(data, monkeypatch):
    kept = []
    monkeypatch.setattr(bench, "keep_freed_memory", lambda keep=True: kept.append(keep))
    rows = bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0})
    keys = [
        *("ours-256", "baseline-256", "plain-fp32", "annotated-transformer", "plain-bf16", "torch-attention-bf16"),
        *("rdrop-fp32", "rdrop-bf16", "glibc-fp32", "glibc-bf16", "rdrop-shared-fp32", "rdrop-shared-bf16"),
        *("rdrop-half-fp32", "rdrop-half-bf16", "pad8-fp32", "compiled-fp32", "pad8-bf16", "compiled-bf16"),
        *("compiled-rdrop-half-fp32", "compiled-rdrop-half-bf16"),
    ]
    assert [r["key"] for r in rows] == keys
    malloc_defaults = {
        "baseline-256",
        "annotated-transformer",
        "glibc-fp32",
        "glibc-bf16",
    }  # the baseline's rows, and those about glibc's settings
    assert kept == [key not in malloc_defaults for key in keys] + [True]  # each row's, then training's again


def test_rows_asked_for_are_the_rows_run_and_glibcs_settings_only_on_glibc(data, monkeypatch):
    asked = ("plain-fp32", "glibc-fp32", "glibc-bf16")
    rows = bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0}, names=asked)
    assert [r["key"] for r in rows] == list(asked)  # this test process runs on glibc's malloc
    monkeypatch.setattr(bench, "allocator", lambda: "mimalloc")
    assert [r["key"] for r in bench.training_rows(TINY, data, PLAN, {"fp32": 1.0, "bf16": 1.0}, names=asked)] == [
        "plain-fp32"
    ]


def test_a_compiled_rows_warm_up_takes_every_trace_its_timed_updates_would_need(data, monkeypatch):
    traces = []

    def counting(graph, example_inputs):
        traces.append(graph)
        return graph.forward  # run as traced, without a C++ build

    monkeypatch.setattr(common, "COMPILE_BACKEND", counting)
    torch._dynamo.reset()  # the other tests' traces of the same code would count toward dynamo's limit
    batches = common.training_batches(data.corpus, bench.MAX_BATCHES)["token batches to 8"]
    same = [b for b in batches if b.src.size(1) == b.tgt_in.size(1)]
    parted = [b for b in batches if b.src.size(1) != b.tgt_in.size(1)]
    # S == T past the least warm-up, so duck sizing's second trace comes after it
    batches = same[: bench.COMPILE_WARMUP + 1] + parted[:2] + same[-2:]
    warmup = bench.compile_warmup(batches)
    assert warmup == bench.COMPILE_WARMUP + 2
    assert bench.compile_warmup(batches[-3:] + batches[:-3]) == bench.COMPILE_WARMUP  # S != T first: one trace
    step = common.ours_step(data, TINY, bf16=False, compile=True)
    for batch in batches[:warmup]:
        step(batch)
    assert len(traces) == 2
    for batch in batches[warmup:]:
        step(batch)
    assert len(traces) == 2  # no trace among the timed updates


def test_rows_are_asked_for_by_name_and_an_unknown_name_is_refused_with_the_names():
    from click.testing import CliRunner

    result = CliRunner().invoke(bench.main, ["--rows", "plain-fp32,c"])
    assert result.exit_code == 2 and "no row c; the rows: ours-256, baseline-256," in result.output


def test_the_decoding_rows_decode_every_sentence_to_its_forced_length(data):
    rows = bench.decoding_rows(TINY, data, PLAN)
    assert [(r["key"], r["vs"]) for r in rows] == [
        ("greedy", "baseline-greedy"),
        ("beam", "baseline-greedy"),
        ("baseline-greedy", None),
    ]
    assert all(r["forced_length_held"] and r["sentences"] == PLAN.decode_sentences for r in rows)
