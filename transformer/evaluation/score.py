"""Scores translations with sacreBLEU: BLEU (13a, cased, detokenized), BLEU tok-lc, chrF2, TER."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from transformer.io import DataError, read_lines


def tok_lc(lines: list[str], lang: str) -> list[str]:
    """Lowercased, Moses-tokenized text: what multi-bleu.perl-style published figures score."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(line.lower(), return_str=True, escape=False) for line in lines]


def score_lines(hyps: list[str], refs: list[str], lang: str, metrics: tuple[str, ...]) -> dict[str, Any]:
    """{metric: value, metric_signature: sacreBLEU signature} for one test set."""
    import sacrebleu

    out: dict[str, Any] = {}
    for name in metrics:
        if name == "bleu_tok_lc":
            # force: the text is tokenized on purpose; without it sacreBLEU warns "forgot to detokenize"
            metric, h, r = sacrebleu.BLEU(tokenize="none", force=True), tok_lc(hyps, lang), tok_lc(refs, lang)
        else:
            metric = {"bleu": sacrebleu.BLEU, "chrf": sacrebleu.CHRF, "ter": sacrebleu.TER}[name]()
            h, r = hyps, refs
        result = metric.corpus_score(h, [r])
        out[name] = round(result.score, 2) if math.isfinite(result.score) else None  # JSON metrics: null, never NaN
        out[f"{name}_signature"] = str(metric.get_signature()) + ("|lc+moses" if name == "bleu_tok_lc" else "")
    return out


def values(scores: dict[str, Any]) -> dict[str, Any]:
    """The metric values of score_lines' result, without their signatures."""
    return {k: v for k, v in scores.items() if not k.endswith("_signature")}


def signatures(scores: dict[str, Any]) -> dict[str, str]:
    """{metric: sacreBLEU signature} of score_lines' result."""
    return {k.removesuffix("_signature"): v for k, v in scores.items() if k.endswith("_signature")}


def score_files(hyp_path: Path, ref_path: Path, lang: str, metrics: tuple[str, ...]) -> dict[str, Any]:
    hyps, refs = read_lines(hyp_path), read_lines(ref_path)
    if len(hyps) != len(refs):
        raise DataError(f"{hyp_path}: has {len(hyps)} lines but the reference {ref_path} has {len(refs)}")
    return score_lines(hyps, refs, lang, metrics)


def markdown_report(scores: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """A table per test set and metric, with signatures and what produced the numbers."""
    import pandas as pd

    rows = [
        {"test set": testset, "metric": m, "score": s[m], "signature": s[f"{m}_signature"].replace("|", "\\|")}
        for testset, s in scores.items()
        for m in values(s)
    ]
    table = pd.DataFrame(rows).to_markdown(index=False) if rows else "(no scores)"
    lines = ["# Scores", "", table, ""] + [f"- {k}: {v}" for k, v in meta.items()]
    return "\n".join(lines) + "\n"
