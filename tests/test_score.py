"""sacreBLEU scoring: known values, signatures, line-count checks, the Markdown report."""

from __future__ import annotations

import json
import math
import re

import pytest
from click.testing import CliRunner

from transformer.cli import main
from transformer.evaluation.score import (
    BOOTSTRAP,
    flat_metrics,
    markdown_report,
    metrics_json,
    score_files,
    score_lines,
    values,
    with_interval,
)
from transformer.io import DataError

METRICS = ("bleu", "bleu_tok_lc", "chrf", "ter")


def test_identical_translations_score_perfectly():
    lines = ["A man rides a bike.", "Two dogs play in the snow."]
    scores = score_lines(lines, lines, "en", METRICS)
    assert scores["bleu"] == scores["bleu_tok_lc"] == scores["chrf"] == 100.0
    assert scores["ter"] == 0.0


def test_bleu_matches_a_hand_computed_value():
    # hyp 6 tokens, ref 7: precisions 6/6, 4/5, 3/4, 2/3; brevity penalty exp(1 - 7/6)
    expected = 100 * math.exp(1 - 7 / 6) * (1 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25
    scores = score_lines(["the cat sat on the mat"], ["the cat sat on the red mat"], "en", ("bleu",))
    assert scores["bleu"] == pytest.approx(expected, abs=0.01)
    assert 67.0 < scores["bleu"] < 67.6


def test_tokenized_lowercased_bleu_forgives_case_and_tokenization():
    scores = score_lines(["The Cat, sat down."], ["the cat , sat down ."], "en", ("bleu", "bleu_tok_lc"))
    assert scores["bleu_tok_lc"] == 100.0
    assert scores["bleu"] < 100.0
    assert scores["bleu_tok_lc"] >= scores["bleu"]


def test_tokenized_lowercased_bleu_does_not_warn_of_tokenized_input(caplog):
    lines = [f"A dog number {i} runs." for i in range(120)]  # sacreBLEU warns from 100 lines ending in " ."
    with caplog.at_level("WARNING"):
        score_lines(lines, lines, "en", ("bleu", "bleu_tok_lc"))
    assert "detokenize" not in caplog.text


def test_every_metric_comes_with_its_signature():
    scores = score_lines(["a b c d e"], ["a b c d f"], "en", METRICS)
    assert set(scores) == set(METRICS) | {f"{m}_signature" for m in METRICS}
    assert "tok:13a" in scores["bleu_signature"] and "nrefs:1" in scores["bleu_signature"]
    assert scores["bleu_tok_lc_signature"].endswith("|lc+moses") and "tok:none" in scores["bleu_tok_lc_signature"]
    assert "nc:6" in scores["chrf_signature"]  # chrF2: character 6-grams
    assert "tok:tercom" in scores["ter_signature"]


def test_only_the_requested_metrics_are_computed():
    assert set(score_lines(["a b"], ["a b"], "en", ("chrf",))) == {"chrf", "chrf_signature"}


def test_score_files_refuses_different_line_counts(tmp_path):
    (tmp_path / "hyp.txt").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        score_files(tmp_path / "hyp.txt", tmp_path / "ref.en", "en", ("bleu",))
    assert "has 3 lines" in str(e.value) and "has 2" in str(e.value)


def test_score_files_scores_the_files(tmp_path):
    (tmp_path / "hyp.txt").write_text("the cat sat on the mat\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("the cat sat on the mat\n", encoding="utf-8")
    assert score_files(tmp_path / "hyp.txt", tmp_path / "ref.en", "en", ("bleu",))["bleu"] == 100.0


def test_the_score_command_prints_the_stage_scores_as_json(tmp_path):
    hyps, refs = ["The cat sat on the mat.", "A dog runs."], ["the cat sat on the mat .", "A dog ran."]
    (tmp_path / "hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    (tmp_path / "ref.en").write_text("".join(r + "\n" for r in refs), encoding="utf-8")
    args = ["score", "--hyps", str(tmp_path / "hyp.txt"), "--refs", str(tmp_path / "ref.en"), "--lang", "en"]
    result = CliRunner().invoke(main, args + ["--metric", "bleu", "--metric", "bleu_tok_lc"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == score_lines(hyps, refs, "en", ("bleu", "bleu_tok_lc"), bootstrap=BOOTSTRAP)
    assert printed["bleu_tok_lc"] > printed["bleu"]
    assert set(json.loads(CliRunner().invoke(main, args).stdout)) == {
        f"{m}{suffix}" for m in ("bleu", "bleu_tok_lc", "chrf", "ter") for suffix in ("", "_ci95", "_signature")
    }


def test_the_score_command_refuses_files_of_different_lengths(tmp_path):
    (tmp_path / "hyp.txt").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("a\nb\n", encoding="utf-8")
    result = CliRunner().invoke(
        main, ["score", "--hyps", str(tmp_path / "hyp.txt"), "--refs", str(tmp_path / "ref.en"), "--lang", "en"]
    )
    assert result.exit_code == 1
    assert f"error: {tmp_path / 'hyp.txt'}: has 3 lines" in result.output


def _scores() -> dict:
    return {
        "val": score_lines(["a b c d"], ["a b c d"], "en", ("bleu", "chrf")),
        "test2016": score_lines(["a b c d e"], ["a b c d"], "en", ("bleu", "chrf")),
    }


def _table_rows(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith("|")]


def test_markdown_report_has_a_row_per_test_set_and_metric():
    scores = _scores()
    report = markdown_report(scores, {"model": "model.pt", "beam": 4})
    rows = _table_rows(report)
    assert len(rows) == 2 + 4  # header, rule, 2 test sets x 2 metrics
    for testset, metric in (("val", "bleu"), ("val", "chrf"), ("test2016", "bleu"), ("test2016", "chrf")):
        row = next(r for r in rows if re.search(rf"\|\s*{testset}\s*\|\s*{metric}\s*\|", r))
        assert float(row.split("|")[3]) == scores[testset][metric]
    assert "- model: model.pt" in report and "- beam: 4" in report


def test_markdown_report_rows_have_as_many_cells_as_the_header():
    # sacreBLEU signatures contain '|': unescaped, they split the signature over extra
    # cells, which Markdown renderers drop.
    rows = _table_rows(markdown_report(_scores(), {}))
    cells = [len(re.split(r"(?<!\\)\|", row)) for row in rows]
    assert cells == [cells[0]] * len(rows), rows


def test_markdown_report_without_scores_says_so():
    assert "(no scores)" in markdown_report({}, {"model": "m.pt"})


def test_a_metric_without_a_value_is_null_not_nan(monkeypatch):
    import sacrebleu

    real = sacrebleu.TER.corpus_score

    def nan_score(self, hyps, refs):
        result = real(self, hyps, refs)
        result.score = float("nan")
        return result

    monkeypatch.setattr(sacrebleu.TER, "corpus_score", nan_score)
    sentence = "a dog runs across the green field"
    scores = score_lines([sentence], [sentence], "en", ("bleu", "ter"))
    assert scores["ter"] is None and scores["bleu"] == 100.0


def _synthetic(n: int) -> tuple[list[str], list[str]]:
    """n hypotheses and references that differ by a word in most sentences, so the resamples differ."""
    words = "a man a dog two women the child on a bike in the snow near water".split()
    refs = [" ".join(words[i % 7 : i % 7 + 4 + i % 5]) for i in range(n)]
    hyps = [r.replace(words[i % 11], "cat", 1) if i % 3 else r for i, r in enumerate(refs)]
    return hyps, refs


def test_every_score_has_a_95_percent_interval_around_it_with_the_resampling_in_its_signature():
    hyps, refs = _synthetic(40)
    scores = score_lines(hyps, refs, "en", METRICS, bootstrap=BOOTSTRAP)
    for m in METRICS:
        low, high = scores[f"{m}_ci95"]
        assert low < scores[m] < high, (m, low, scores[m], high)
        assert f"|bs:{BOOTSTRAP}|seed:12345|" in scores[f"{m}_signature"]
    assert "bs:" not in score_lines(hyps, refs, "en", ("bleu",))["bleu_signature"]  # no resampling asked


def test_the_interval_narrows_as_the_test_set_grows():
    hyps, refs = _synthetic(40)
    small = score_lines(hyps, refs, "en", METRICS, bootstrap=BOOTSTRAP)
    large = score_lines(hyps * 4, refs * 4, "en", METRICS, bootstrap=BOOTSTRAP)
    for m in METRICS:
        assert large[m] == pytest.approx(small[m], abs=0.01)  # the same sentences: the same score
        width = {name: s[f"{m}_ci95"][1] - s[f"{m}_ci95"][0] for name, s in (("small", small), ("large", large))}
        assert width["large"] < 0.7 * width["small"], (m, width)  # about half: 1 / sqrt(4)


def test_the_interval_is_the_same_on_a_rerun():
    hyps, refs = _synthetic(40)
    assert score_lines(hyps, refs, "en", METRICS, bootstrap=BOOTSTRAP) == score_lines(
        hyps, refs, "en", METRICS, bootstrap=BOOTSTRAP
    )


def test_an_interval_stays_within_the_metrics_range_on_a_tiny_test_set():
    scores = score_lines(["A dog runs.", "A cat"], ["A dog runs.", "The cat sleeps."], "en", ("bleu",), bootstrap=100)
    assert 0 <= scores["bleu_ci95"][0] <= scores["bleu"] <= scores["bleu_ci95"][1] <= 100


def test_a_score_shows_its_intervals_half_width_and_one_without_an_interval_shows_as_before():
    assert with_interval(41.52, [40.6, 42.4]) == "41.52 ± 0.9"
    assert with_interval(41.52, None) == "41.52"
    assert with_interval(None, None) == "None"


def test_the_metrics_file_keeps_the_values_where_they_were_and_the_interval_beside_them():
    scores = score_lines(*_synthetic(10), "en", ("bleu", "ter"), bootstrap=BOOTSTRAP)
    written = metrics_json(scores)
    assert set(written) == {"bleu", "bleu_ci95", "ter", "ter_ci95"}
    assert values(written) == {"bleu": scores["bleu"], "ter": scores["ter"]}
    flat = flat_metrics({"test": written})
    assert flat["test_bleu"] == scores["bleu"]
    assert [flat["test_ter_ci_low"], flat["test_ter_ci_high"]] == scores["ter_ci95"]
    assert set(flat_metrics({"test": {"bleu": 40.0}})) == {"test_bleu"}  # a file from before intervals


def test_the_markdown_report_shows_the_interval_beside_the_score():
    scores = {"test": score_lines(*_synthetic(10), "en", ("bleu",), bootstrap=BOOTSTRAP)}
    row = _table_rows(markdown_report(scores, {}))[2]
    half = (scores["test"]["bleu_ci95"][1] - scores["test"]["bleu_ci95"][0]) / 2
    assert f"| {scores['test']['bleu']} ± {half:.1f} |" in re.sub(r" +", " ", row)
