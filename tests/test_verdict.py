"""A run's verdict against its recipe's committed reference: identical, reproduced or differs by a paired
test, or not compared, with the reason."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import tiny_params

from transformer.config import params_from_dict
from transformer.evaluation import verdict
from transformer.io import read_json, write_lines

WORDS = "a dog runs in the park while two men play football near the river".split()


def _lines(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 9))) for _ in range(n)]


def _worse(lines: list[str], every: int) -> list[str]:
    """`lines` with every `every`-th line's second half dropped."""
    return [line if i % every else " ".join(line.split()[: len(line.split()) // 2]) for i, line in enumerate(lines)]


@pytest.fixture
def project(tmp_path: Path):
    """A finished toy run's references and translations, and its recipe's reference made from them."""
    params = params_from_dict(tiny_params())
    refs = _lines(300, 0)
    write_lines(tmp_path / "raw/test2016.en", refs)
    write_lines(tmp_path / "translations/test2016.txt", _worse(refs, 3))
    scores = {"test2016": {"bleu": 50.0}}
    reference = verdict.reference_dir(params, tmp_path / "reference")
    write_lines(tmp_path / "raw/test2016.de", [f"source {i}" for i in range(len(refs))])
    translations, raw = tmp_path / "translations", tmp_path / "raw"
    verdict.record(params, scores, translations, raw, reference, host_class="X", commit="abc", fingerprint={})
    return params, tmp_path, reference


def _judge(params, root: Path, reference: Path) -> dict:
    return verdict.judge(params, root / "translations", root / "raw", reference)


def test_a_rerun_that_translates_alike_is_identical(project):
    found = _judge(*project)
    assert found["verdict"] == "identical" and found["line"].startswith("verdict: identical to the reference")


def test_a_run_a_few_lines_apart_is_reproduced_with_its_difference_and_interval(project):
    params, root, reference = project
    mine = (root / "translations/test2016.txt").read_text().splitlines()
    mine[0] = mine[0] + " park"  # one line of 300
    write_lines(root / "translations/test2016.txt", mine)
    found = _judge(params, root, reference)
    assert found["verdict"] == "reproduced", found
    low, high = found["diff_ci95"]
    assert low <= found["diff"] <= high and found["p_bs"] >= verdict.LEVEL
    assert found["ci95"][0] <= found["reference_score"] <= found["ci95"][1]


def test_a_run_much_worse_than_the_reference_differs(project):
    params, root, reference = project
    refs = (root / "raw/test2016.en").read_text().splitlines()
    write_lines(root / "translations/test2016.txt", _worse(refs, 1))  # every line cut in half
    found = _judge(params, root, reference)
    assert found["verdict"] == "differs" and found["diff"] < 0 and found["p_bs"] < verdict.LEVEL, found
    assert "differs: test2016 BLEU" in found["line"]


def test_another_seed_is_judged_but_another_recipe_is_refused_naming_the_key(project):
    _, root, reference = project
    seeded = params_from_dict(tiny_params(**{"train.seed": 7}))
    assert _judge(seeded, root, reference)["verdict"] == "identical"
    found = _judge(params_from_dict(tiny_params(**{"decode.beam": 5})), root, reference)
    assert found["verdict"] == "not compared" and "decode.beam is 5 here, 2 in" in found["line"], found


def test_a_run_without_the_references_test_set_is_not_compared(project):
    _, root, reference = project
    found = _judge(params_from_dict(tiny_params(**{"decode.testsets": ["val"]})), root, reference)
    assert found["verdict"] == "not compared" and "does not decode test2016" in found["line"]


def test_a_direction_without_a_reference_says_so(project):
    _, root, _ = project
    other = params_from_dict(tiny_params(**{"data.src_lang": "en", "data.tgt_lang": "de"}))
    found = _judge(other, root, verdict.reference_dir(other, root / "reference"))
    assert found["verdict"] == "no reference" and "toy en-de" in found["line"]


def test_the_record_holds_the_recipe_the_scores_and_what_made_them(project):
    params, _, reference = project
    record = read_json(reference / verdict.RECORD)
    assert record["testset"] == "test2016" and record["scores"] == {"bleu": 50.0}
    assert record["host_class"] == "X" and record["params"]["decode.beam"] == 2
    assert [row["line"] for row in record["examples"]] == [1, 61, 121, 181, 241]  # the report's five
    assert record["examples"][1]["source"] == "source 60"
    assert not any(k.startswith(verdict.NOT_RECIPE) for k in record["params"])
