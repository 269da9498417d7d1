"""Is one recipe better than another, over seeds? Groups of systems on one test set, each group one recipe's
runs (its seeds): each group's mean score and standard deviation over its systems, and a t-test of each group
against the first (the baseline) on those per-system corpus scores.

A t-test, not a permutation test: with three seeds a side, the six scores have only 20 ways to split into two
groups of three, so a permutation test's p-value cannot go below 0.1. Welch's t-test, where both groups have
two systems or more, since a recipe's seeds may spread more than another's; Student's pooled t-test where one
side is a single system, which then counts as one more seed of a recipe spreading as the other group does."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from transformer.evaluation.compare import check_lengths
from transformer.evaluation.score import score_lines
from transformer.io import DataError

TESTS = {"welch": "Welch's t-test", "student": "Student's t-test"}


def members(spec: str) -> list[str]:
    """The systems of one argument: an existing file is one system even with a comma in its name; otherwise
    the argument's comma-separated parts."""
    if Path(spec).is_file() or "," not in spec:
        return [spec]
    parts = spec.split(",")
    if not all(parts):
        raise DataError(f"{spec}: an empty system between commas; a group is systems joined by single commas")
    return parts


def compare_groups(
    groups: list[tuple[str, list[tuple[str, list[str]]]]], refs: list[str], lang: str, metrics: tuple[str, ...]
) -> dict[str, Any]:
    """{metric: {signature, groups: [{group, systems, scores, mean, sd[, diff, test, p]}]}}, the first group the
    baseline; `groups` holds (name, [(system, translations)]) pairs. sd is the sample standard deviation (None
    for a single system) and p the t-test's two-sided p-value, all taken over the scores as printed (two
    decimals, as scores.json holds them), so that a reader can recompute them from the table."""
    if len(groups) < 2:
        raise DataError("compare needs two groups or more: a baseline and what to compare with it")
    baseline, *others = groups
    for name, systems in others:
        if len(systems) == 1 and len(baseline[1]) == 1:
            raise DataError(
                f"{name}: a single system against the single baseline {baseline[0]}: a t-test needs the spread "
                "over seeds of one side at least; give it two systems or more, comma-separated"
            )
    check_lengths([system for _, systems in groups for system in systems], refs)
    scored = {system: score_lines(hyps, refs, lang, metrics) for _, systems in groups for system, hyps in systems}
    return {m: _compare_metric(m, groups, scored) for m in metrics}


def _compare_metric(
    metric: str, groups: list[tuple[str, list[tuple[str, list[str]]]]], scored: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    rows = []
    for name, systems in groups:
        scores = [scored[system][metric] for system, _ in systems]
        sd = round(statistics.stdev(scores), 2) if len(scores) > 1 else None
        row = {"group": name, "systems": [s for s, _ in systems], "scores": scores, "mean": _mean(scores), "sd": sd}
        rows.append(row if not rows else row | _t_test(scores, rows[0]["scores"]))
    # sacreBLEU signs the metric, not the translations: every system's signature is the same.
    signature = next(iter(scored.values()))[f"{metric}_signature"]
    return {"signature": signature, "groups": rows}


def _mean(scores: list[float]) -> float:
    return round(statistics.fmean(scores), 2)


def _t_test(scores: list[float], baseline: list[float]) -> dict[str, Any]:
    """The difference of the means to the baseline's and the two-sided p-value of the t-test between them."""
    from scipy.stats import ttest_ind

    test = "welch" if len(scores) > 1 and len(baseline) > 1 else "student"
    if len(set(scores)) == len(set(baseline)) == 1:
        # No spread on either side: t is 0/0 where the scores are equal (nothing differs; scipy would give NaN
        # and a warning) and infinite where they differ.
        p = float(scores[0] == baseline[0])
    else:
        p = round(float(ttest_ind(scores, baseline, equal_var=test == "student").pvalue), 4)
    return {"diff": round(_mean(scores) - _mean(baseline), 2), "test": test, "p": p}


def markdown(compared: dict[str, Any], testset: str) -> str:
    """compare_groups' result as a Markdown table a metric, with the metric's signature."""
    from transformer.config import METRICS
    from transformer.evaluation.report import markdown_table

    parts = []
    for metric, found in compared.items():
        name = METRICS.get(metric, metric)
        header = ["group", "systems", f"{name} mean ± sd", "scores", "− baseline", "p"]
        rows = [
            [
                r["group"],
                len(r["scores"]),
                r["mean"] if r["sd"] is None else f"{r['mean']} ± {r['sd']}",
                ", ".join(str(s) for s in r["scores"]),
                *([r["diff"], f"{r['p']} ({TESTS[r['test']]})"] if "diff" in r else ["baseline", ""]),
            ]
            for r in found["groups"]
        ]
        parts += [f"{testset}, {name}: `{found['signature']}`", "", *markdown_table(header, rows), ""]
    return "\n".join(parts)
