"""Scores translations with sacreBLEU: BLEU (13a, cased, detokenized), BLEU tok-lc, chrF2, TER."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from transformer.io import DataError, read_lines

# sacreBLEU's own resample count for its paired bootstrap; its seed is SACREBLEU_SEED's, else 12345.
# Both go into the signature (bs:, seed:), so an interval can be recomputed exactly.
BOOTSTRAP = 1000


def tok_lc(lines: list[str], lang: str) -> list[str]:
    """Lowercased, Moses-tokenized text: what multi-bleu.perl-style published figures score."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(line.lower(), return_str=True, escape=False) for line in lines]


def score_lines(
    hyps: list[str], refs: list[str], lang: str, metrics: tuple[str, ...], *, bootstrap: int = 0
) -> dict[str, Any]:
    """{metric: value, metric_signature: sacreBLEU signature} for one test set. With `bootstrap` resamples,
    also metric_ci95: [low, high], the 95% interval of sacreBLEU's bootstrap, which says how far another
    draw of test sentences could move the score."""
    out: dict[str, Any] = {}
    for name in metrics:
        metric, h, r = make_metric(name), prepared(name, hyps, lang), prepared(name, refs, lang)
        result = metric.corpus_score(h, [r])
        finite = math.isfinite(result.score)
        out[name] = round(result.score, 2) if finite else None  # JSON metrics: null, never NaN
        if bootstrap:
            out[f"{name}_ci95"] = percentiles(resample(metric, h, r, bootstrap)) if finite else None
        out[f"{name}_signature"] = signature(name, metric.get_signature())
    return out


def make_metric(name: str):
    """The sacreBLEU metric object of a score.metrics name."""
    import sacrebleu

    if name == "bleu_tok_lc":
        # force: the text is tokenized on purpose; without it sacreBLEU warns "forgot to detokenize"
        return sacrebleu.BLEU(tokenize="none", force=True)
    return {"bleu": sacrebleu.BLEU, "chrf": sacrebleu.CHRF, "ter": sacrebleu.TER}[name]()


def prepared(name: str, lines: list[str], lang: str) -> list[str]:
    """The text as the metric reads it: BLEU tok-lc scores lowercased, Moses-tokenized text."""
    return tok_lc(lines, lang) if name == "bleu_tok_lc" else lines


def signature(name: str, sacrebleu_signature) -> str:
    """A sacreBLEU signature (a metric's, once it has scored, or a paired test's), marked where we tokenized the
    text ourselves."""
    return str(sacrebleu_signature) + ("|lc+moses" if name == "bleu_tok_lc" else "")


def resample(metric, hyps: list[str], refs: list[str], n: int) -> list[float]:
    """The metric on n of sacreBLEU's own bootstrap resamples of the test set. The resamples depend only on
    the seed (SACREBLEU_SEED, else 12345) and the number of sentences, so two systems of one test set are
    resampled alike: their differences are paired. Records bs: and seed: in the signature, as
    corpus_score(n_bootstrap=) does."""
    from sacrebleu.significance import _bootstrap_resample

    metric.n_bootstrap = n
    metric.seed, scores = _bootstrap_resample(metric._extract_corpus_statistics(hyps, [refs]), metric, n)
    return [float(x.score) for x in scores]


def percentiles(resampled: list[float]) -> list[float]:
    """The 2.5th and 97.5th percentiles, at the ranks sacreBLEU's estimate_ci takes. corpus_score(n_bootstrap=)
    keeps only their mean and half-width, whose sum can pass the metric's range on a small test set;
    the percentiles never do."""
    ranked, n = sorted(resampled), len(resampled)
    return [round(ranked[n // 40], 2), round(ranked[n - n // 40 - 1], 2)]


def values(scores: dict[str, Any]) -> dict[str, Any]:
    """The metric values of score_lines' result (or of scores.json's test set), without signatures or intervals."""
    return {k: v for k, v in scores.items() if not k.endswith(("_signature", "_ci95"))}


def metrics_json(scores: dict[str, Any]) -> dict[str, Any]:
    """What scores.json holds for a test set: each value, and its interval beside it as a [low, high] list,
    which `dvc metrics show` and `dvc metrics diff` leave out, so they show the values as they always did."""
    return {k: v for k, v in scores.items() if not k.endswith("_signature")}


def interval(scores: dict[str, Any], metric: str) -> list[float] | None:
    """The metric's 95% interval [low, high] in score_lines' result or scores.json, None where it has none."""
    return scores.get(f"{metric}_ci95")


def with_interval(value: Any, ci95: list[float] | None) -> str:
    """A score as tables show it: the value, and where it has an interval, ± the interval's half-width."""
    return f"{value} ± {(ci95[1] - ci95[0]) / 2:.1f}" if ci95 and value is not None else str(value)


def flat_metrics(scored: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{testset: scores.json's test set} as MLflow metrics: <testset>_<metric> for each value and, where it has
    an interval, <testset>_<metric>_ci_low and _ci_high, since an MLflow metric is one number."""
    out = {}
    for t, s in scored.items():
        for m, x in values(s).items():
            out[f"{t}_{m}"] = x
            if ci95 := interval(s, m):
                out[f"{t}_{m}_ci_low"], out[f"{t}_{m}_ci_high"] = ci95
    return out


def signatures(scores: dict[str, Any]) -> dict[str, str]:
    """{metric: sacreBLEU signature} of score_lines' result."""
    return {k.removesuffix("_signature"): v for k, v in scores.items() if k.endswith("_signature")}


def score_files(hyp_path: Path, ref_path: Path, lang: str, metrics: tuple[str, ...]) -> dict[str, Any]:
    hyps, refs = read_lines(hyp_path), read_lines(ref_path)
    if len(hyps) != len(refs):
        raise DataError(f"{hyp_path}: has {len(hyps)} lines but the reference {ref_path} has {len(refs)}")
    return score_lines(hyps, refs, lang, metrics, bootstrap=BOOTSTRAP)


def markdown_report(scores: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """A table per test set and metric, with signatures and what produced the numbers."""
    import pandas as pd

    rows = [
        {
            "test set": testset,
            "metric": m,
            "score": with_interval(s[m], interval(s, m)),
            "signature": s[f"{m}_signature"].replace("|", "\\|"),
        }
        for testset, s in scores.items()
        for m in values(s)
    ]
    table = pd.DataFrame(rows).to_markdown(index=False) if rows else "(no scores)"
    lines = ["# Scores", "", table, ""] + [f"- {k}: {v}" for k, v in meta.items()]
    return "\n".join(lines) + "\n"
