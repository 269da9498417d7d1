"""Did this run reproduce the committed reference? A run on the reference's host class should match it to
the digit; a run on another class trains a different model, so it is judged by a paired test against
the reference's translations, never by its digits.

A reference is one committed run of a recipe, in `reports/reference/<section>/`: its headline test set's
translations and `reference.json` (the params it ran with, its scores, host class, commit, and the
fingerprint of the code's numerics on that class that bench/reference.py took). The translations are in
git, not DVC's cache, so that every clone, with or without a DVC remote, can judge its own run
(about 70 KB a test set)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformer.config import Params, flatten
from transformer.evaluation.report import example_rows, headline_testset, key, load_anchors
from transformer.io import read_json, read_lines, write_json, write_lines

REFERENCES = Path("reports/reference")
RECORD = "reference.json"
METRIC = "bleu"  # the word follows the headline metric; the report shows the others
LEVEL = 0.05
RULE = (
    "identical: the same translations as the reference, line for line; reproduced: the reference's BLEU "
    f"lies inside this run's 95% interval and paired bootstrap resampling finds no difference (p ≥ {LEVEL}); "
    "differs: otherwise"
)
# Not approximate randomization: sacreBLEU's counts a shuffle as evidence only where its difference exceeds the
# observed one, never where it ties, so two runs apart in a handful of lines, whose every shuffle ties, get its
# smallest p-value, 1 / 10,001. Both p-values are shown.
# Not the recipe: how a run is scored and labelled, which test sets it also decodes, and its seed, a draw of
# the recipe's randomness as the host class is of its rounding: another seed is judged, not refused.
NOT_RECIPE = ("score.", "report.", "decode.testsets", "train.seed")


def reference_dir(params: Params, root: Path = REFERENCES) -> Path:
    """Where the reference of params' report section lives (one a corpus, direction and label)."""
    return root / key(params).replace(" ", "_")


def recipe(params: Params) -> dict[str, Any]:
    """The params that decide a run's translations, as reference.json holds them (a list for a tuple)."""
    return json.loads(json.dumps({k: v for k, v in flatten(params).items() if not k.startswith(NOT_RECIPE)}))


def judge(params: Params, translations: Path, raw: Path, reference: Path) -> dict[str, Any]:
    """{verdict, line[, testset, diff, diff_ci95, ci95, p_ar, p_bs]}: this run's translations (a <testset>.txt
    a test set, references in `raw`) against the reference in `reference` (a reference_dir)."""
    record_path = reference / RECORD
    if not record_path.is_file():
        return _said("no reference", f"no committed reference for {key(params)} ({record_path} is missing)")
    record = read_json(record_path)
    ours, theirs = recipe(params), record["params"]
    changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if changed:
        k = changed[0]
        return _said(
            "not compared",
            f"not compared with the reference: another recipe ({k} is {ours.get(k)!r} here, {theirs.get(k)!r} "
            f"in {record_path}{f', and {len(changed) - 1} more' if len(changed) > 1 else ''})",
        )
    testset = record["testset"]
    if testset not in params.decode.testsets:
        return _said("not compared", f"not compared with the reference: this run does not decode {testset}")
    mine, refs = read_lines(translations / f"{testset}.txt"), read_lines(raw / f"{testset}.{params.data.tgt_lang}")
    kept = read_lines(reference / f"{testset}.txt")
    where = f"{testset}, reference made on {record['host_class']}"
    if mine == kept:
        return _said("identical", f"identical to the reference ({where})", testset=testset)
    return _paired(kept, mine, refs, params.data.tgt_lang, testset, where)


def _paired(kept: list[str], mine: list[str], refs: list[str], lang: str, testset: str, where: str) -> dict[str, Any]:
    from transformer.evaluation.compare import compare

    reference, run = compare([("reference", kept), ("this run", mine)], refs, lang, (METRIC,))[METRIC]["systems"]
    low, high = run["ci95"]
    word = "reproduced" if low <= reference["score"] <= high and run["p_bs"] >= LEVEL else "differs"
    line = (
        f"{word}: {testset} BLEU {run['score']} [{low}, {high}] against the reference's {reference['score']}, "
        f"difference {run['diff']:+.2f} [{run['diff_ci95'][0]}, {run['diff_ci95'][1]}], "
        f"p {run['p_ar']} (approximate randomization), {run['p_bs']} (paired bootstrap) ({where})"
    )
    found = {k: run[k] for k in ("score", "ci95", "diff", "diff_ci95", "p_ar", "p_bs")}
    return _said(word, line, testset=testset, reference_score=reference["score"], **found)


def paragraph(found: dict[str, Any]) -> str:
    """The verdict as the report states it, with its rule."""
    return f"Against the committed reference: {found['line'].removeprefix('verdict: ')}. The rule: {RULE}."


def _said(verdict: str, line: str, **found: Any) -> dict[str, Any]:
    return {"verdict": verdict, "line": f"verdict: {line}", **found}


def record(
    params: Params, scores: dict[str, dict[str, Any]], translations: Path, raw: Path, out: Path, **made_with: Any
) -> dict[str, Any]:
    """The reference record of a finished run whose scores are `scores` (the score stage's JSON), its
    headline test set's translations (references in `raw`) copied beside it under `out`, with the
    report's example sentences; `made_with`: host_class, commit, fingerprint."""
    d = params.data
    testset = headline_testset(scores, load_anchors(d.corpus, d.src_lang, d.tgt_lang))
    translated = read_lines(translations / f"{testset}.txt")
    sides = [read_lines(raw / f"{testset}.{lang}") for lang in (d.src_lang, d.tgt_lang)]
    written = {"section": key(params), "testset": testset, "scores": scores[testset], **made_with}
    write_lines(out / f"{testset}.txt", translated)
    write_json(out / RECORD, written | {"examples": example_rows(*sides, [translated]), "params": recipe(params)})
    return written
