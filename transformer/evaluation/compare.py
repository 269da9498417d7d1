"""Is one system better than another? Systems' translations of one test set, against one reference: each score
with its 95% interval, each system's difference to the first (the baseline) with the difference's interval, and
the p-values of sacreBLEU's paired approximate randomization and paired bootstrap resampling tests.

A system is a translation file, or a git revision or DVC experiment whose decode stage's output DVC reads."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from transformer.evaluation.report import markdown_table
from transformer.evaluation.score import BOOTSTRAP, make_metric, percentiles, prepared, resample, signature
from transformer.io import DataError, decode_lines, read_lines

DECODE = "decode"  # the dvc.yaml stage, one decode@<testset> a test set, that writes the translations
TESTS = {"ar": "approximate randomization", "bs": "paired bootstrap"}  # sacreBLEU's paired tests


def stage_output(stage: str, dvc_yaml: Path, testset: str | None = None) -> str:
    """Where a dvc.yaml stage writes its output: its command's --out, the one place the path is written
    (the decode stage's for `testset`, as its foreach fills it in)."""
    import yaml

    entry = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8"))["stages"][stage]
    words = shlex.split(entry["do"]["cmd"] if "do" in entry else entry["cmd"])
    out = words[words.index("--out") + 1]
    return out if testset is None else out.replace("${item}", testset)


def load_system(spec: str, testset: str) -> list[str]:
    """A system's translations: the lines of the file `spec`, or where there is no such file, the decode
    stage's output for `testset` at the git revision or DVC experiment `spec`, from DVC's cache."""
    if Path(spec).is_file():
        return read_lines(spec)
    if not Path("dvc.yaml").is_file():
        raise DataError(f"{spec}: no such file; revisions and experiments are found from the project's root")
    import dvc.api
    from dvc.exceptions import DvcException, NotDvcRepoError
    from dvc.scm import RevError

    path = stage_output(DECODE, Path("dvc.yaml"), testset)
    try:
        data = dvc.api.read(path, rev=spec, mode="rb")
    except (RevError, NotDvcRepoError):
        raise DataError(f"{spec}: no such file, git revision or DVC experiment") from None
    except (DvcException, FileNotFoundError):
        raise DataError(
            f"{spec}: has no {path} (not decoded there, or not in the DVC cache); run `dvc repro {DECODE}@{testset}` "
            f"at {spec} (or `dvc pull` it)"
        ) from None
    return decode_lines(data, f"{path} at {spec}")


def compare(
    systems: list[tuple[str, list[str]]], refs: list[str], lang: str, metrics: tuple[str, ...], stepwise: bool = False
) -> dict[str, Any]:
    """{metric: {signature, systems: [{system, score, ci95[, diff, diff_ci95, p_ar, p_bs]}]}}, the first system
    the baseline. Every system is resampled alike (one seed, one test set), so each difference's interval
    comes from paired resamples. `stepwise` compares each system with the one before it instead, as a
    ladder of changes is read: each step is the step before plus one change."""
    if len(systems) < 2:
        raise DataError("compare needs two systems or more: a baseline and what to compare with it")
    check_lengths(systems, refs)
    if not stepwise:
        return {m: _compare_metric(m, systems, refs, lang) for m in metrics}
    # A system's score and interval do not depend on what it is compared with (its resamples depend only on
    # the seed and the test set's size), so the pairs' rows join into one table.
    pairs = [compare(systems[i : i + 2], refs, lang, metrics) for i in range(len(systems) - 1)]
    return {
        m: {
            "signature": pairs[0][m]["signature"],
            "systems": [pairs[0][m]["systems"][0]] + [p[m]["systems"][1] for p in pairs],
        }
        for m in metrics
    }


def check_lengths(systems: list[tuple[str, list[str]]], refs: list[str]) -> None:
    """Refuses, naming it, a system whose line count is not the reference's: translations of another test set."""
    for name, hyps in systems:
        if len(hyps) != len(refs):
            raise DataError(f"{name}: has {len(hyps)} lines but the reference has {len(refs)}; not the same test set")


def _compare_metric(name: str, systems: list[tuple[str, list[str]]], refs: list[str], lang: str) -> dict[str, Any]:
    r = prepared(name, refs, lang)
    hyps = [(system, prepared(name, lines, lang)) for system, lines in systems]
    rows, baseline = [], None
    for system, h in hyps:
        metric = make_metric(name)
        score, resampled = metric.corpus_score(h, [r]).score, resample(metric, h, r, BOOTSTRAP)
        row = {"system": system, "score": round(score, 2), "ci95": percentiles(resampled)}
        if baseline is None:
            baseline = (score, resampled, h)
        else:
            diffs = [mine - theirs for mine, theirs in zip(resampled, baseline[1])]
            row |= {"diff": round(score - baseline[0], 2), "diff_ci95": percentiles(diffs)}
        rows.append(row)
    signature_ = _p_values(name, hyps, r, rows)
    for row, (_, h) in zip(rows[1:], hyps[1:]):
        if h == baseline[2]:
            # sacreBLEU counts the trials whose difference exceeds the observed one, so translations equal to
            # the baseline's, whose every trial ties at 0, would get its smallest p-value: nothing differs.
            row |= {f"p_{test}": 1.0 for test in TESTS}
    return {"signature": signature_, "systems": rows}


def _p_values(name: str, hyps: list[tuple[str, list[str]]], refs: list[str], rows: list[dict[str, Any]]) -> str:
    """Each system's p-values against the baseline in `rows`, from sacreBLEU's PairedTest; returns the
    signature, which names both tests' trials and the seed."""
    from sacrebleu.significance import PairedTest

    found = {}
    for test in TESTS:
        samples = BOOTSTRAP if test == "bs" else 0  # approximate randomization: sacreBLEU's 10,000 trials
        signatures, results = PairedTest(hyps, {name: make_metric(name)}, [refs], test, samples)()
        (key,) = signatures
        found[test] = signatures[key]
        for row, result in zip(rows[1:], results[key][1:]):
            row[f"p_{test}"] = round(float(result.p_value), 4)
    found["ar"].update("bs", BOOTSTRAP)  # the intervals' resamples
    return signature(name, found["ar"])


def markdown(compared: dict[str, Any], testset: str, stepwise: bool = False) -> str:
    """compare's result as a Markdown table a metric, with its signature."""
    from transformer.config import METRICS

    parts = []
    for metric, found in compared.items():
        against = "− the row above" if stepwise else "− baseline"
        header = ["system", METRICS.get(metric, metric), "95% interval", against, "95% interval"]
        header += [f"p ({how})" for how in TESTS.values()]
        rows = [
            [
                r["system"],
                r["score"],
                r["ci95"],
                *([r["diff"], r["diff_ci95"], r["p_ar"], r["p_bs"]] if "diff" in r else ["baseline", "", "", ""]),
            ]
            for r in found["systems"]
        ]
        parts += [
            f"{testset}, {METRICS.get(metric, metric)}: `{found['signature']}`",
            "",
            *markdown_table(header, rows),
        ]
        parts.append("")
    return "\n".join(parts)
