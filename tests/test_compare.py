"""transformer compare: systems on one test set, with intervals, differences and sacreBLEU's paired tests."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import DVC, tool_env

from transformer.cli import main
from transformer.evaluation.compare import compare
from transformer.evaluation.score import BOOTSTRAP, score_lines

WORDS = "a man dog two women the child on bike in snow near water runs sits".split()


def _corpus(n: int = 60) -> tuple[list[str], list[str], list[str]]:
    """References, a good system (about 1 word in 10 wrong) and a worse one (about 4 in 10)."""
    rng = random.Random(0)
    refs = [" ".join(rng.choices(WORDS, k=10)) for _ in range(n)]
    return refs, _noisy(refs, 0.9, rng), _noisy(refs, 0.6, rng)


def _noisy(refs: list[str], kept: float, rng: random.Random) -> list[str]:
    """The references with each word kept with probability `kept`, else replaced."""
    return [" ".join(w if rng.random() < kept else "cat" for w in r.split()) for r in refs]


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _compare(*args: str):
    return CliRunner().invoke(main, ["compare", *args], catch_exceptions=False)


def test_a_system_against_itself_differs_by_nothing_and_a_worse_one_significantly(tmp_path):
    refs, good, worse = _corpus()
    files = [_write(tmp_path / name, lines) for name, lines in (("good.txt", good), ("same.txt", good))]
    files.append(_write(tmp_path / "worse.txt", worse))
    args = [*files, "--refs", _write(tmp_path / "test2016.en", refs), "--lang", "en", "--metric", "bleu"]
    result = _compare(*args, "--metric", "ter", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["testset"] == "test2016" and set(found["metrics"]) == {"bleu", "ter"}
    for metric in ("bleu", "ter"):
        baseline, same, worse_row = found["metrics"][metric]["systems"]
        assert (
            "diff" not in baseline
            and baseline["ci95"] == score_lines(good, refs, "en", (metric,), bootstrap=BOOTSTRAP)[f"{metric}_ci95"]
        )  # the score stage's interval
        assert same["diff"] == 0 and same["diff_ci95"] == [0, 0] and same["p_ar"] == same["p_bs"] == 1.0
        assert worse_row["p_ar"] < 0.01 and worse_row["p_bs"] < 0.01
        low, high = worse_row["diff_ci95"]
        assert low <= worse_row["diff"] <= high and (high < 0 if metric == "bleu" else low > 0)  # TER: lower is better
        assert f"|bs:{BOOTSTRAP}|ar:10000|seed:12345|" in found["metrics"][metric]["signature"]
    table = _compare(*args).stdout
    assert "| system | BLEU | 95% interval | − baseline | 95% interval | p (approximate randomization) |" in table
    assert f"| {files[1]} | {found['metrics']['bleu']['systems'][0]['score']} |" in table


def test_stepwise_compares_each_system_with_the_one_before_it(tmp_path):
    refs, good, worse = _corpus()
    files = [
        _write(tmp_path / f"{name}.txt", lines) for name, lines in (("worse", worse), ("good", good), ("g2", good))
    ]
    args = [*files, "--refs", _write(tmp_path / "test2016.en", refs), "--lang", "en", "--metric", "bleu"]
    found = json.loads(_compare(*args, "--stepwise", "--json").stdout)
    first, better, same = found["metrics"]["bleu"]["systems"]
    pairs = [
        compare([(a, x), (b, y)], refs, "en", ("bleu",))["bleu"]["systems"]
        for a, x, b, y in ((files[0], worse, files[1], good), (files[1], good, files[2], good))
    ]
    assert found["against"] == "previous" and [first, better, same] == [pairs[0][0], pairs[0][1], pairs[1][1]]
    assert better["diff"] > 0 and better["p_ar"] < 0.01 and same["diff"] == 0 and same["p_ar"] == 1.0
    assert "| system | BLEU | 95% interval | − the row above |" in _compare(*args, "--stepwise").stdout
    grouped = _compare(f"{files[0]},{files[1]}", files[2], *args[3:], "--stepwise")
    assert grouped.exit_code == 2 and "--stepwise compares single systems, not groups" in grouped.output


def test_a_system_of_the_same_quality_is_not_called_significantly_different():
    refs, good, _ = _corpus()
    rng = random.Random(1)
    alike = _noisy(refs, 0.9, rng)  # good's noise, redrawn
    (_, other) = compare([("good", good), ("alike", alike)], refs, "en", ("bleu",))["bleu"]["systems"]
    assert other["p_ar"] > 0.05 and other["p_bs"] > 0.05
    assert other["diff_ci95"][0] < 0 < other["diff_ci95"][1]


def test_systems_of_another_test_set_are_refused_naming_the_file(tmp_path):
    refs, good, _ = _corpus()
    files = [_write(tmp_path / "good.txt", good), _write(tmp_path / "short.txt", good[:-1])]
    result = _compare(*files, "--refs", _write(tmp_path / "test2016.en", refs), "--lang", "en")
    assert result.exit_code == 1 and result.stdout == ""
    assert f"error: {files[1]}: has 59 lines but the reference has 60; not the same test set" in result.output


def test_one_system_or_one_group_is_refused(tmp_path):
    refs, good, _ = _corpus()
    system, reference = _write(tmp_path / "a.txt", good), ["--refs", _write(tmp_path / "t.en", refs), "--lang", "en"]
    result = _compare(system, *reference)
    assert result.exit_code == 1 and "error: compare needs two systems or more" in result.output
    group = _compare(f"{system},{system}", *reference)
    assert group.exit_code == 1 and "error: compare needs two groups or more" in group.output


def test_a_missing_file_outside_a_project_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refs, good, _ = _corpus()
    result = _compare(
        _write(tmp_path / "a.txt", good), "b.txt", "--refs", _write(tmp_path / "t.en", refs), "--lang", "en"
    )
    assert result.exit_code == 1 and "error: b.txt: no such file;" in result.output


def _seeds(tmp_path: Path, name: str, kept: float, refs: list[str]) -> str:
    """Three systems of one quality, as three seeds of a recipe would give, as a group argument a,b,c."""
    rng = random.Random(name)
    return ",".join(_write(tmp_path / f"{name}{seed}.txt", _noisy(refs, kept, rng)) for seed in (1, 2, 3))


def _bleu(system: str, refs: list[str]) -> float:
    return score_lines(Path(system).read_text().splitlines(), refs, "en", ("bleu",))["bleu"]


def test_groups_get_their_mean_and_spread_over_systems_and_welchs_t_test_against_the_first(tmp_path):
    from scipy.stats import ttest_ind

    refs, *_ = _corpus()
    good, worse = (_seeds(tmp_path, name, kept, refs) for name, kept in (("good", 0.9), ("worse", 0.8)))
    args = [good, worse, good, "--refs", _write(tmp_path / "test2016.en", refs), "--lang", "en", "--metric", "bleu"]
    result = _compare(*args, "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    baseline, other, same = found["metrics"]["bleu"]["groups"]
    scores = {g: [_bleu(s, refs) for s in g.split(",")] for g in (good, worse)}
    for row, group in ((baseline, good), (other, worse)):
        assert row["group"] == group and row["systems"] == group.split(",") and row["scores"] == scores[group]
        assert row["mean"] == round(statistics.fmean(scores[group]), 2)
        assert row["sd"] == round(statistics.stdev(scores[group]), 2) > 0
    assert "diff" not in baseline and other["diff"] == round(other["mean"] - baseline["mean"], 2) < 0
    assert other["test"] == "welch"
    assert other["p"] == round(ttest_ind(scores[worse], scores[good], equal_var=False).pvalue, 4) < 0.05
    assert same["diff"] == 0 and same["p"] == 1.0
    assert found["metrics"]["bleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    table = _compare(*args).stdout
    assert "| group | systems | BLEU mean ± sd | scores | − baseline | p |" in table
    assert (
        f"| {good} | 3 | {baseline['mean']} ± {baseline['sd']} | {', '.join(map(str, scores[good]))} | baseline |"
        in table
    )
    assert f"| {other['p']} (Welch's t-test) |" in table


def test_groups_without_spread_get_p_1_where_their_scores_are_equal_and_0_where_they_differ(tmp_path):
    refs, good, worse = _corpus()
    same, other = _write(tmp_path / "good.txt", good), _write(tmp_path / "worse.txt", worse)
    groups = [f"{same},{same}", f"{same},{same},{same}", f"{other},{other}"]
    result = _compare(*groups, "--refs", _write(tmp_path / "t.en", refs), "--lang", "en", "--metric", "chrf", "--json")
    assert result.exit_code == 0, result.output
    baseline, equal, differing = json.loads(result.stdout)["metrics"]["chrf"]["groups"]
    assert baseline["sd"] == equal["sd"] == differing["sd"] == 0
    assert equal["diff"] == 0 and equal["p"] == 1.0
    assert differing["diff"] < 0 and differing["p"] == 0


def test_a_single_system_against_a_group_gets_students_t_test_and_two_single_systems_are_refused(tmp_path):
    from scipy.stats import ttest_ind

    refs, good, worse = _corpus()
    group = _seeds(tmp_path, "good", 0.9, refs)
    single, other = _write(tmp_path / "worse.txt", worse), _write(tmp_path / "good.txt", good)
    reference = ["--refs", _write(tmp_path / "test2016.en", refs), "--lang", "en", "--metric", "bleu", "--json"]
    result = _compare(group, single, *reference)
    assert result.exit_code == 0, result.output
    _, row = json.loads(result.stdout)["metrics"]["bleu"]["groups"]
    seeds, alone = [_bleu(s, refs) for s in group.split(",")], _bleu(single, refs)
    assert row["scores"] == [alone] and row["sd"] is None and row["test"] == "student"
    assert row["p"] == round(ttest_ind([alone], seeds).pvalue, 4) < 0.05
    assert row["diff"] == round(alone - round(statistics.fmean(seeds), 2), 2)
    refused = _compare(single, other, group, *reference)
    assert refused.exit_code == 1 and refused.stdout == ""
    assert f"error: {other}: a single system against the single baseline {single}: a t-test needs" in refused.output


def test_a_group_with_a_system_of_another_test_set_is_refused_naming_it(tmp_path):
    refs, good, _ = _corpus()
    short = _write(tmp_path / "short.txt", good[:-1])
    group = _seeds(tmp_path, "good", 0.9, refs)
    result = _compare(
        group, f"{group.split(',')[0]},{short}", "--refs", _write(tmp_path / "t.en", refs), "--lang", "en"
    )
    assert result.exit_code == 1 and result.stdout == ""
    assert f"error: {short}: has 59 lines but the reference has 60; not the same test set" in result.output


def test_a_file_whose_name_has_a_comma_is_one_system_and_an_empty_group_member_is_refused(tmp_path):
    refs, good, worse = _corpus()
    comma, other = _write(tmp_path / "good,1.txt", good), _write(tmp_path / "worse.txt", worse)
    reference = ["--refs", _write(tmp_path / "t.en", refs), "--lang", "en", "--metric", "bleu", "--json"]
    result = _compare(comma, other, *reference)
    assert result.exit_code == 0, result.output
    assert [r["system"] for r in json.loads(result.stdout)["metrics"]["bleu"]["systems"]] == [comma, other]
    empty = _compare(comma, f"{other},", *reference)
    assert empty.exit_code == 1 and f"error: {other},: an empty system between commas" in empty.output


def _git(repo: Path, *args: str) -> None:
    who = {
        f"GIT_{role}_{key}": value
        for role in ("AUTHOR", "COMMITTER")
        for key, value in (("NAME", "t"), ("EMAIL", "t@t"))
    }
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env=tool_env(**who))


def _dvc(repo: Path, *args: str) -> None:
    subprocess.run([DVC, *args], cwd=repo, check=True, capture_output=True, env=tool_env())


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A git and DVC project whose decode stage copies system.txt to its output: one commit with DVC alone,
    then one per system, decoded and committed."""
    repo = tmp_path_factory.mktemp("project")
    refs, good, worse = _corpus()
    _git(repo, "init", "-q")
    _dvc(repo, "init", "-q")
    _git(repo, "commit", "-qm", "dvc")
    _write(repo / "test2016.en", refs)
    (repo / "copy.py").write_text("import shutil, sys\nshutil.copy('system.txt', sys.argv[2])\n")
    (repo / "dvc.yaml").write_text(
        "stages:\n  decode:\n    foreach: [test2016]\n    do:\n"
        "      cmd: python copy.py --out data/translations/${item}.txt\n"
        "      deps: [copy.py, system.txt]\n      outs:\n        - data/translations/${item}.txt\n"
    )
    (repo / "data/translations").mkdir(parents=True)
    for name, lines in (("good", good), ("worse", worse)):
        _write(repo / "system.txt", lines)
        _dvc(repo, "repro", "-q")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", name)
    return repo


def test_systems_are_read_at_git_revisions(project, monkeypatch):
    monkeypatch.chdir(project)
    result = _compare("HEAD~1", "HEAD", "--refs", "test2016.en", "--lang", "en", "--metric", "bleu", "--json")
    assert result.exit_code == 0, result.output
    baseline, worse = json.loads(result.stdout)["metrics"]["bleu"]["systems"]
    refs, good, worse_lines = _corpus()
    assert baseline["score"] == score_lines(good, refs, "en", ("bleu",))["bleu"]
    assert worse["score"] == score_lines(worse_lines, refs, "en", ("bleu",))["bleu"] and worse["p_ar"] < 0.01


def test_an_unknown_revision_and_one_without_translations_are_named(project, monkeypatch):
    monkeypatch.chdir(project)
    unknown = _compare("HEAD", "no-such-experiment", "--refs", "test2016.en", "--lang", "en")
    assert unknown.exit_code == 1
    assert "error: no-such-experiment: no such file, git revision or DVC experiment" in unknown.output
    undecoded = _compare("HEAD~2", "HEAD", "--refs", "test2016.en", "--lang", "en")
    assert undecoded.exit_code == 1
    assert "error: HEAD~2: has no data/translations/test2016.txt" in undecoded.output
    assert "run `dvc repro decode@test2016` at HEAD~2" in undecoded.output
