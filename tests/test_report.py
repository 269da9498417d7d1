"""reports/reproduction.md: sections per corpus and direction, scores beside published figures and our baselines."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch
import yaml
from conftest import ROOT, tiny_config, tiny_model, tiny_params

from transformer.checkpoints import average_state_dicts
from transformer.config import ADDED_KEYS, METRICS, load_params, params_from_dict
from transformer.evaluation import report, system
from transformer.evaluation.score import interval, values, with_interval
from transformer.evaluation.system import describe_model
from transformer.io import DataError, write_json
from transformer.presets import names, recipe

SCORES = {
    "val": {"bleu": 30.0, "bleu_tok_lc": 31.0, "chrf": 55.0, "ter": 50.0},
    "test2016": {"bleu": 39.72, "bleu_tok_lc": 39.97, "chrf": 58.37, "ter": 42.47},
}
SIGNATURES = {t: {"bleu": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"} for t in SCORES}
MODEL = {
    "model": "N=3, d_model=256, d_ff=1024, h=4, pre-norm",
    "parameters": "7.6M (7,578,624)",
    "updates": 2610,
    "training time": "43.4 min",
    "averaged": "no",
}
ANCHOR = {
    "kind": "published",
    "testset": "test2016",
    "metric": "bleu_tok_lc",
    "bleu": 36.52,
    "how": "greedy",
    "source": "a notebook",
}
BASELINE = {
    "kind": "baseline",
    "testset": "test2016",
    "metric": "bleu",
    "bleu": 37.5,
    "how": "torch.nn.Transformer",
    "source": "our calibration run",
}


def _section(corpus="multi30k", src="de", tgt="en", timings=None, anchors=(ANCHOR,), label=""):
    params = params_from_dict(
        tiny_params(**{"data.corpus": corpus, "data.src_lang": src, "data.tgt_lang": tgt, "report.label": label})
    )
    timings = (
        timings
        if timings is not None
        else {"download": {"wall_s": 2.0, "finished": "t0"}, "train": {"wall_s": 118.0, "finished": "t1"}}
    )
    return report.section(params, SCORES, SIGNATURES, MODEL, timings, list(anchors), "2 CPU cores", "abc123")


def test_examples_are_sentences_spread_over_the_test_set_with_their_sentence_bleu():
    sources = [f"satz {i}" for i in range(10)]
    references = [f"a man rides sentence {i} ." for i in range(10)]
    translations = [r if i % 4 else "the | dog" for i, r in enumerate(references)]
    lines = report.examples(sources, references, translations, count=3)
    assert lines[0] == "| line | source | reference | translation | sentence BLEU |"
    assert lines[2:] == [
        "| 1 | satz 0 | a man rides sentence 0 . | the \\| dog | 0.0 |",  # its "|" escaped: one cell still
        "| 4 | satz 3 | a man rides sentence 3 . | a man rides sentence 3 . | 100.0 |",
        "| 7 | satz 6 | a man rides sentence 6 . | a man rides sentence 6 . | 100.0 |",
    ]
    assert len(report.examples(sources[:2], references[:2], translations[:2], count=5)) == 2 + 2  # no line twice


def test_a_section_shows_its_examples_after_the_recipe():
    body = _section()
    assert "Translations of a few" not in body
    params = params_from_dict(tiny_params())
    shown = ("test2016", report.examples(["satz"], ["a man ."], ["a man ."]))
    body = report.section(params, SCORES, SIGNATURES, MODEL, {}, [ANCHOR], "2 CPU cores", "abc123", shown=shown)
    assert "Translations of a few test2016 sentences:\n\n| line | source |" in body
    assert body.index("Recipe:") < body.index("| 1 | satz | a man . | a man . | 100.0 |") < body.index("Wall time")


def test_section_sets_ours_beside_the_published_figure_in_its_metric():
    text = _section()
    assert (
        "| multi30k | de→en | test2016 | 39.72 | 39.97 | 58.37 | 42.47 | 36.52 BLEU tok-lc | none | 2.0 min |" in text
    )
    assert "| test2016 | BLEU tok-lc | 36.52 | 39.97 | +3.45 | greedy | a notebook |" in text
    assert "`nrefs:1\\|case:mixed\\|eff:no\\|tok:13a\\|smooth:exp\\|version:2.6.0`" in text  # escaped inside the table
    assert "| **total** | **2.0 min** |" in text and "git commit abc123" in text


def _with_intervals(low: float, high: float) -> dict:
    return {t: s | {f"{m}_ci95": [low + s[m], high + s[m]] for m in s} for t, s in SCORES.items()}


def test_a_section_with_intervals_shows_each_score_with_its_half_width():
    params = params_from_dict(tiny_params(**{"data.corpus": "multi30k"}))
    text = report.section(params, _with_intervals(-1.0, 0.8), SIGNATURES, MODEL, {}, [ANCHOR], "2 CPU cores", "abc")
    assert "| multi30k | de→en | test2016 | 39.72 ± 0.9 | 39.97 ± 0.9 | 58.37 ± 0.9 | 42.47 ± 0.9 |" in text
    assert "| val | BLEU | 30.0 ± 0.9 | `nrefs:1" in text
    assert "±" not in _section()  # scores from before intervals show as they did


def test_the_report_says_whether_the_published_figure_lies_inside_our_interval():
    def where(low, high):
        (row,) = [r for r in report.comparison(_with_intervals(low, high), [ANCHOR], "published") if "36.52" in r]
        return row

    assert "| +3.45 | outside: the published figure is below our 95% interval [38.97, 40.97] |" in where(-1.0, 1.0)
    assert "| inside our 95% interval [35.97, 40.97] |" in where(-4.0, 1.0)  # 36.52 in it
    assert "outside: the published figure is above our 95% interval [30.97, 35.97]" in where(-9.0, -4.0)
    header = report.comparison(SCORES, [ANCHOR], "published")[0]
    assert "interval" not in header and "significan" not in where(-1.0, 1.0)  # no interval: no column, no claim


def test_recipe_names_the_cooldown_and_a_single_checkpoint():
    params = params_from_dict(tiny_params(**{"train.cooldown": 0.3, "average.last_k": 1}))
    text = "\n".join(report.recipe(params, MODEL))
    assert "cooldown over the last 30%" in text and "| averaged | no: the last checkpoint alone |" in text
    assert "cooldown" not in "\n".join(report.recipe(params_from_dict(tiny_params()), MODEL))


def test_recipe_names_the_regularizers_in_use_only():
    params = params_from_dict(
        tiny_params(**{"train.bpe_dropout": 0.1, "train.rdrop": 5.0, "model.dropout": 0.3, "train.weight_decay": 0.05})
    )
    text = "\n".join(report.recipe(params, MODEL))
    assert (
        "| regularization | label smoothing 0.1, dropout 0.3, BPE-dropout 0.1, weight decay 0.05, R-Drop α 5.0 |"
        in text
    )
    assert "| regularization | label smoothing 0.1, dropout 0.0 |" in "\n".join(
        report.recipe(params_from_dict(tiny_params()), MODEL)
    )
    shared = params_from_dict(
        tiny_params(**{"train.rdrop": 5.0, "train.rdrop_shared_encoder": True, "model.dropout": 0.1})
    )
    assert "| regularization | label smoothing 0.1, dropout 0.1, R-Drop α 5.0 on one encoder pass |" in "\n".join(
        report.recipe(shared, MODEL)
    )
    partial = params_from_dict(
        tiny_params(**{"train.rdrop": 4.0, "train.rdrop_share": 0.5, "train.rdrop_from": 0.3, "model.dropout": 0.1})
    )
    assert (
        "| regularization | label smoothing 0.1, dropout 0.1, R-Drop α 4.0 on 50% of each batch's sentences "
        "over the last 70% of the updates |"
    ) in "\n".join(report.recipe(partial, MODEL))
    extra = params_from_dict(
        tiny_params(
            **{"model.dropout": 0.1, "model.attn_dropout": 0.1, "model.ff_dropout": 0.2, "model.word_dropout": 0.15}
        )
    )
    assert (
        "| regularization | label smoothing 0.1, dropout 0.1, attention dropout 0.1, feed-forward dropout 0.2, "
        "source word dropout 0.15 |"
    ) in "\n".join(report.recipe(extra, MODEL))


def test_section_without_an_anchor_says_so():
    text = _section(corpus="toy", anchors=())
    assert "| none | none |" in text and "No published figure is on record" in text
    assert "baseline" not in text.split("| pipeline wall time |")[1]  # no baseline table either


def test_our_baseline_stands_apart_from_the_published_figures():
    text = _section(anchors=(ANCHOR, BASELINE))
    assert "| 42.47 | 36.52 BLEU tok-lc | 37.5 BLEU | 2.0 min |" in text  # published, then baseline
    published, baselines = text.split("Beside the published figures")[1].split("Beside our own baselines")
    assert "| test2016 | BLEU tok-lc | 36.52 | 39.97 | +3.45 |" in published and "37.5" not in published
    assert "| test2016 | BLEU | 37.5 | 39.72 | +2.22 | torch.nn.Transformer | our calibration run |" in baselines
    assert "| baseline | ours | ours − baseline |" in baselines


def test_the_calibration_runs_are_baselines_not_published_figures():
    for src, tgt in (("de", "en"), ("en", "de")):
        anchors = report.load_anchors("multi30k", src, tgt)
        assert {a["kind"] for a in anchors if "calibration" in a["source"]} == {"baseline"}


def test_an_anchor_of_no_known_kind_is_refused_by_file(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("toy:\n  de-en:\n    - {testset: test, metric: bleu, bleu: 1.0, how: x, source: y}\n")
    with pytest.raises(DataError, match="kind must be one of published, baseline") as e:
        report.load_anchors("toy", "de", "en", path)
    assert str(path) in str(e.value)


def test_the_report_counts_a_tied_embedding_once():
    """The averaged file holds the tied embedding under three names (source, target, generator),
    each its own tensor; the model as built has it once."""
    torch.manual_seed(0)
    config = tiny_config(40, 40, tie_embeddings=True)
    model = tiny_model(**config)
    built = sum(p.numel() for p in model.parameters())
    averaged = average_state_dicts([model.state_dict(), model.state_dict()])
    assert sum(t.numel() for t in averaged.values()) == built + 2 * 40 * 16
    described = describe_model({"model": averaged, "model_config": config, "step": 1})
    recipe = "\n".join(report.recipe(params_from_dict(tiny_params()), described))
    assert f"| parameters | 0.0M ({built:,}) |" in recipe


@pytest.mark.parametrize(
    "decoder_N, model", [(0, "N=2, d_model=16"), (2, "N=2, d_model=16"), (1, "N=2 (decoder 1), d_model=16")]
)
def test_the_report_names_the_decoders_depth_where_it_differs_from_the_encoders(decoder_N, model):
    config = tiny_config(40, 40, N=2, tie_embeddings=True, decoder_N=decoder_N)
    described = describe_model({"model": tiny_model(**config).state_dict(), "model_config": config, "step": 1})
    assert described["model"].startswith(model + ",")


def test_merge_rewrites_its_own_section_and_keeps_the_others():
    de_en = report.merge("", "multi30k de-en", _section())
    both = report.merge(de_en, "multi30k en-de", _section(src="en", tgt="de"))
    rewritten = report.merge(both, "multi30k de-en", _section(timings={"train": {"wall_s": 30.0, "finished": "t2"}}))
    assert rewritten.startswith(report.TITLE)
    assert rewritten.count("<!-- begin multi30k de-en -->") == rewritten.count("<!-- begin multi30k en-de -->") == 1
    de_en_part = rewritten.split("<!-- begin multi30k de-en -->")[1].split("<!-- end multi30k de-en -->")[0]
    assert "| train | 30.0 s | t2 |" in de_en_part and "118" not in de_en_part
    assert "en→de" in rewritten.split("<!-- begin multi30k en-de -->")[1]


def test_a_labelled_recipe_has_its_own_section_beside_the_default():
    long = params_from_dict(
        tiny_params(**{"data.corpus": "multi30k", "data.src_lang": "en", "data.tgt_lang": "de", "report.label": "long"})
    )
    assert report.key(long) == "multi30k en-de long"
    default = report.merge("", "multi30k en-de", _section(src="en", tgt="de"))
    both = report.merge(default, report.key(long), _section(src="en", tgt="de", label="long"))
    long_part = both.split("<!-- begin multi30k en-de long -->")[1]
    assert (
        long_part.startswith("\n## multi30k en→de (long)\n") and "| multi30k | en→de (long) | test2016 |" in long_part
    )
    assert (
        both.count("<!-- begin multi30k en-de -->") == 1
        and "(long)" not in both.split("<!-- begin multi30k en-de long")[0]
    )


def test_no_two_shipped_params_files_write_the_same_section():
    keys = {name: report.key(params_from_dict(recipe(name, ROOT))) for name in names(ROOT)}
    owners = {}
    for name, key in keys.items():
        owners.setdefault(key, []).append(name)
    shared = {k: v for k, v in owners.items() if len(v) > 1}
    assert not shared, shared


def test_timings_come_in_the_order_the_stages_finished(tmp_path):
    finished = {
        "score": "02:50:58",
        "decode@val": "02:50:40",
        "figures": "02:51:10",
        "download": "02:09:25",
        "train": "02:50:20",
        "decode@test2016": "02:50:52",
    }
    for name, time in finished.items():
        write_json(tmp_path / f"{name}.json", {"wall_s": 1.0, "finished": f"2026-11-22T{time}+00:00"})
    order = ["download", "train", "decode@val", "decode@test2016", "score", "figures"]
    assert list(report.load_timings(tmp_path, ("val", "test2016"))) == order


def test_the_timing_of_a_test_set_dropped_from_decode_testsets_is_left_out(tmp_path):
    for name in ("train", "decode@val", "decode@test2016"):  # test2016 decoded by an earlier run, then dropped
        write_json(tmp_path / f"{name}.json", {"wall_s": 60.0, "finished": "2026-11-22T02:50:40+00:00"})
    timings = report.load_timings(tmp_path, ("val",))
    assert list(timings) == ["decode@val", "train"]
    assert "| **total** | **2.0 min** |  |" in report.timing_table(timings)


def test_a_broken_timing_file_is_named(tmp_path):
    (tmp_path / "train.json").write_text("{not json")
    with pytest.raises(DataError, match="train.json"):
        report.load_timings(tmp_path, ("val",))


def test_every_multi30k_direction_has_a_published_anchor():
    for src, tgt in (("de", "en"), ("en", "de")):
        anchors = report.load_anchors("multi30k", src, tgt)
        assert any(a["kind"] == "published" for a in anchors) and all(a["metric"] in METRICS for a in anchors)


def test_the_package_ships_the_data_files_it_reads():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "transformer"
    ]
    assert sorted(package_data) == sorted(p.name for p in (ROOT / "transformer").glob("*.yaml"))


def test_readme_results_are_copied_from_the_report():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [
        line
        for line in readme.split("<!-- results -->")[1].split("<!-- /results -->")[0].splitlines()
        if line.startswith("| multi30k")
    ]
    committed = (ROOT / "reports/reproduction.md").read_text(encoding="utf-8").splitlines()
    assert rows and all(row in committed for row in rows)


def test_the_committed_metrics_are_the_default_recipes_run_the_readme_and_the_report_show():
    """dvc.lock, reports/scores.json and reports/train/train.json are one run of params.yaml's
    recipe; its row in the README and its section of the report carry the same scores."""
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text(encoding="utf-8"))
    params = load_params(ROOT / "params.yaml").to_dict()
    for stage in ("train", "decode@test2016", "score"):
        recorded = lock["stages"][stage]["params"]["params.yaml"]
        for key, value in recorded.items():
            section, _, name = key.partition(".")
            expected = params[section][name] if name else params[section]
            if not name:  # a run from before a key was added trained as that key's value in ADDED_KEYS says
                value = ADDED_KEYS[section] | value
            assert _same(value, expected), f"dvc.lock's {stage} ran with {key} = {value}, params.yaml says {expected}"
    scores = json.loads((ROOT / "reports/scores.json").read_text(encoding="utf-8"))
    p = load_params(ROOT / "params.yaml")
    direction = f"{p.data.src_lang}→{p.data.tgt_lang}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("<!-- results -->")[1]
    (row,) = [line for line in readme.splitlines() if line.startswith(f"| {p.data.corpus} | {direction} | test2016 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    test2016 = scores["test2016"]
    assert cells[3:7] == [
        with_interval(test2016[m], interval(test2016, m)) for m in ("bleu", "bleu_tok_lc", "chrf", "ter")
    ]
    name = report.key(p)
    text = (ROOT / "reports/reproduction.md").read_text(encoding="utf-8")
    section = text.split(f"<!-- begin {name} -->")[1].split(f"<!-- end {name} -->")[0]
    for testset, scored in scores.items():
        for metric, value in values(scored).items():
            shown = with_interval(value, interval(scored, metric))
            assert f"| {testset} | {METRICS[metric]} | {shown} |" in section, (testset, metric)
    train = json.loads((ROOT / "reports/train/train.json").read_text(encoding="utf-8"))
    assert train["epochs"] == p.train.epochs and f"| {direction} | test2016 |" in section.split("\n\n")[1]


def _same(a, b) -> bool:
    return list(a) == list(b) if isinstance(a, (list, tuple)) else a == b


def test_stages_write_their_wall_time_once_under_torchrun(tmp_path, monkeypatch):
    import click
    from click.testing import CliRunner

    from transformer.stage import stage

    @click.command()
    @stage
    def command() -> None:
        pass

    runner = CliRunner()
    monkeypatch.setenv("RANK", "1")
    assert runner.invoke(command, ["--timing", str(tmp_path / "t.json")]).exit_code == 0
    assert not (tmp_path / "t.json").exists()  # only the first process writes
    monkeypatch.setenv("RANK", "0")
    assert runner.invoke(command, ["--timing", str(tmp_path / "t.json")]).exit_code == 0
    timing = report.load_timings(tmp_path, ("val",))["t"]
    assert timing["wall_s"] > 0 and timing["finished"].endswith(
        "+00:00"
    )  # since the process started: pytest's age here


def test_a_stage_that_resumed_counts_the_earlier_invocations_time_and_the_report_says_so(tmp_path):
    import click
    from click.testing import CliRunner

    from transformer.stage import Resumed, stage

    @click.command()
    @stage
    def command() -> Resumed:
        return Resumed(3600.0)

    result = CliRunner().invoke(command, ["--timing", str(tmp_path / "train.json")])
    assert result.exit_code == 0 and "(and 3600.0 s in earlier invocations, resumed)" in result.output
    timing = report.load_timings(tmp_path, ("val",))["train"]
    assert timing["resumed_s"] == 3600.0 and timing["wall_s"] > 3600.0
    table = "\n".join(report.timing_table({"download": {"wall_s": 2.0, "finished": "t0"}, "train": timing}))
    assert f"| train | {timing['wall_s'] / 60:.1f} min (60.0 min of it before a resume) |" in table
    assert "| download | 2.0 s | t0 |" in table  # a stage that resumed nothing says nothing of it


def test_an_ensembles_recipe_names_its_members_counts_one_and_sums_their_training_times():
    config = tiny_config(40, 40, tie_embeddings=True)
    one = sum(p.numel() for p in tiny_model(**config).parameters())
    described = describe_model(
        {"model_config": config, "step": 9, "train_time_s": 600.0, "members": [{"seed": 3}, {"seed": 4}]}
    )
    recipe = "\n".join(report.recipe(params_from_dict(tiny_params(**{"train.seed": 2, "train.members": 3})), described))
    assert f"| parameters | 0.0M ({one:,}) × 3 members |" in recipe
    assert "| ensemble | 3 models, seeds 2, 3, 4:" in recipe and "| training time | 10.0 min |" in recipe
    assert "ensemble" not in "\n".join(
        report.recipe(params_from_dict(tiny_params()), describe_model({"model_config": config}))
    )


def test_the_host_class_names_the_cpus_family_and_model_where_its_name_is_only_a_vendor_line(monkeypatch):
    monkeypatch.setattr(system, "cpuinfo", lambda: {"model name": "AMD EPYC", "cpu family": "25", "model": "17"})
    assert system.host_class().startswith("AMD EPYC, family 25 model 17; ")
    monkeypatch.setattr(system, "cpuinfo", lambda: {"model name": "AMD EPYC"})
    assert system.host_class().startswith("AMD EPYC; ")


@pytest.mark.parametrize(
    "capability, flags, named",
    [
        ("AVX512", "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "AMX"),
        ("AVX512", "fpu avx2 avx512f avx512_bf16", "AVX-512 bf16"),
        ("AVX512", "fpu avx2 avx512f", "AVX-512"),
        ("AVX2", "fpu avx2 avx512f avx512_bf16", "AVX2"),  # torch held at AVX2 (ATEN_CPU_CAPABILITY)
    ],
)
def test_the_host_class_names_the_instruction_set_that_chose_the_kernels(monkeypatch, capability, flags, named):
    monkeypatch.setattr(system, "cpuinfo", lambda: {"model name": "X", "flags": flags})
    monkeypatch.setattr(system.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert system.host_class().split("; ")[1] == named


def test_a_run_resumed_on_another_class_names_both():
    assert system.after(None, "A") == "A" and system.after("A", "A") == "A"
    assert system.after("A", "B") == "A, then B" and system.after("A, then B", "B") == "A, then B"


def test_every_readme_row_is_a_committed_reference_holding_its_scores_and_what_made_it():
    """A row of the results table is a run a user's run is judged against (evaluation.verdict), and the
    suite checks it still is what today's code makes (tests/test_pipeline.py): its reference must exist."""
    from transformer.evaluation.verdict import RECORD, REFERENCES

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- results -->")[1].split("<!-- /results -->")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("| ")]
    for cells in rows[2:]:  # below the header and its rule
        direction, _, label = cells[1].partition(" (")
        section = " ".join(filter(None, [cells[0], direction.replace("→", "-"), label.rstrip(")")]))
        path = ROOT / REFERENCES / section.replace(" ", "_") / RECORD
        assert path.is_file(), f"the README's row {section} has no committed reference ({path})"
        record = json.loads(path.read_text(encoding="utf-8"))
        scores = record["scores"]
        assert cells[3:7] == [with_interval(scores[m], interval(scores, m)) for m in METRICS], section
        assert record["host_class"] and record["commit"] and record["fingerprint"]["toy"], section
