"""reports/reproduction.md: our scores beside the published ones and our own baselines, with what produced them.

The file holds one section per corpus, direction and recipe label (params `report.label`,
empty for the default recipes). A run rewrites its own section and keeps the others, so the
de→en, en→de and long en→de runs (and any other corpus) share one report."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from transformer.config import METRICS, Params
from transformer.evaluation.score import interval, values, with_interval
from transformer.io import DataError, read_json

ANCHORS = Path(__file__).with_name("anchors.yaml")
EXAMPLES = 5  # test sentences a section shows translated
KINDS = ("published", "baseline")  # a figure from the literature, or one of our own calibration runs
TITLE = """# Reproduction report

Written by the pipeline (`dvc repro`, stage `report`: stages/report.py); never edit it by hand.
Each corpus, direction and recipe label has a section, rewritten by the latest run of that
corpus, direction and label; its first table is the row the README's results table copies.
"""


def key(params: Params) -> str:
    """The section's name in the report: corpus, direction and, if set, the recipe label."""
    d = params.data
    return " ".join(filter(None, (d.corpus, f"{d.src_lang}-{d.tgt_lang}", params.report.label)))


def _direction(params: Params) -> str:
    d, label = params.data, params.report.label
    return f"{d.src_lang}→{d.tgt_lang}" + (f" ({label})" if label else "")


def load_anchors(corpus: str, src: str, tgt: str, path: Path = ANCHORS) -> list[dict[str, Any]]:
    """The figures to set a corpus and direction's scores beside; each says its `kind` (KINDS)."""
    import yaml

    anchors = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get(corpus, {}).get(f"{src}-{tgt}", [])
    for a in anchors:
        if a.get("kind") not in KINDS:
            raise DataError(
                f"{path}: {corpus} {src}-{tgt} {a.get('testset')}: kind must be one of {', '.join(KINDS)}, "
                f"got {a.get('kind')!r}"
            )
    return anchors


def load_timings(directory: Path, testsets: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """{stage: {wall_s, finished[, resumed_s]}} from the stages' --timing files, in the order they finished: the
    pipeline's order for a full run, with no list of stages to repeat dvc.yaml's. A decode@<testset> file of a
    test set no longer in decode.testsets is an earlier run's, not part of this pipeline: left out."""
    paths = directory.glob("*.json") if directory.is_dir() else []
    found = {p.stem: read_json(p) for p in paths if p.stem.partition("@")[2] in ("", *testsets)}
    return dict(sorted(found.items(), key=lambda kv: (kv[1].get("finished", ""), kv[0])))


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table's lines; a "|" inside a cell (sacreBLEU signatures have them) is escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def headline(
    params: Params, scores: dict[str, dict[str, Any]], anchors: list[dict[str, Any]], timings: dict[str, dict[str, Any]]
) -> list[str]:
    """The one-row summary: the anchors' test set (else the last one), every metric, the published
    figures and our baselines on it, the pipeline's time."""
    d = params.data
    testset = headline_testset(scores, anchors)
    s = scores[testset]
    beside = [
        ", ".join(
            f"{a['bleu']} {METRICS.get(a['metric'], a['metric'])}" + (f" ({a['label']})" if a.get("label") else "")
            for a in anchors
            if a["testset"] == testset and a["kind"] == kind
        )
        or "none"
        for kind in KINDS
    ]
    total = sum(t["wall_s"] for t in timings.values())
    cells = [with_interval(s[m], interval(s, m)) if m in s else "-" for m in METRICS]
    row = [d.corpus, _direction(params), testset, *cells, *beside, _minutes(total)]
    return markdown_table(["corpus", "direction", "test set", *METRICS.values(), *KINDS, "pipeline wall time"], [row])


def headline_testset(scores: dict[str, Any], anchors: list[dict[str, Any]]) -> str:
    """The test set a section leads with: the first the anchors name, else the last decoded."""
    named = [a["testset"] for a in anchors if a["testset"] in scores]
    return named[0] if named else list(scores)[-1]


def examples(sources: list[str], references: list[str], translations: list[str], count: int = EXAMPLES) -> list[str]:
    """A Markdown table of example_rows's sentences: the source, the reference, our translation and its
    sentence BLEU."""
    rows = [
        [row["line"], row["source"], row["reference"], row["translations"][0], row["bleu"][0]]
        for row in example_rows(sources, references, [translations], count)
    ]
    return markdown_table(["line", "source", "reference", "translation", "sentence BLEU"], rows)


def example_rows(
    sources: list[str], references: list[str], systems: list[list[str]], count: int = EXAMPLES
) -> list[dict[str, Any]]:
    """`count` of a test set's sentences, spread evenly over it, the same lines every run so that two
    recipes show the same sentences: each line's number (from 1), source and reference, and each
    system's translation with its sentence BLEU (sacreBLEU's, with the effective order a single
    sentence needs: a rough guide to one sentence, where corpus BLEU is the score)."""
    from sacrebleu.metrics import BLEU

    bleu = BLEU(effective_order=True)
    picked = sorted({i * len(references) // count for i in range(count)})
    return [
        {
            "line": i + 1,
            "source": sources[i],
            "reference": references[i],
            "translations": [lines[i] for lines in systems],
            "bleu": [round(bleu.sentence_score(lines[i], [references[i]]).score, 1) for lines in systems],
        }
        for i in picked
    ]


def comparison(scores: dict[str, dict[str, Any]], anchors: list[dict[str, Any]], kind: str) -> list[str]:
    """Our score beside each anchor of `kind`, in the anchor's metric; where our scores have 95% intervals,
    whether the anchor's figure lies inside ours, which says how far the test set's sampling alone reaches,
    not whether the two systems differ."""
    rows, where = [], []
    for a in (a for a in anchors if a["kind"] == kind):
        ours = scores.get(a["testset"], {}).get(a["metric"])
        diff = f"{ours - a['bleu']:+.2f}" if isinstance(ours, (int, float)) else "-"
        rows.append(
            [
                a["testset"],
                METRICS.get(a["metric"], a["metric"]),
                a["bleu"],
                ours if ours is not None else "-",
                diff,
                a["how"],
                a["source"],
            ]
        )
        where.append(_inside(a["bleu"], interval(scores.get(a["testset"], {}), a["metric"]), kind))
    if not rows:
        return [f"No {kind} figure is on record for this corpus and direction (transformer/evaluation/anchors.yaml)."]
    header = ["test set", "metric", kind, "ours", f"ours − {kind}", f"how the {kind} figure was obtained", "source"]
    if any(w != "-" for w in where):  # without intervals the table stays as it was
        header.insert(5, f"the {kind} figure and our 95% interval")
        rows = [[*row[:5], w, *row[5:]] for row, w in zip(rows, where)]
    return markdown_table(header, rows)


def _inside(figure: float, ci95: list[float] | None, kind: str) -> str:
    if not ci95:
        return "-"
    low, high = ci95
    span = f"our 95% interval [{low}, {high}]"
    if figure < low:
        return f"outside: the {kind} figure is below {span}"
    if figure > high:
        return f"outside: the {kind} figure is above {span}"
    return f"inside {span}"


def score_table(scores: dict[str, dict[str, Any]], signatures: dict[str, dict[str, str]]) -> list[str]:
    rows = [
        [t, METRICS.get(m, m), with_interval(v, interval(s, m)), f"`{signatures.get(t, {}).get(m, '-')}`"]
        for t, s in scores.items()
        for m, v in values(s).items()
    ]
    return markdown_table(["test set", "metric", "score", "sacreBLEU signature"], rows)


def recipe(params: Params, model: dict[str, Any]) -> list[str]:
    """The params that decide the score, and the model's size."""
    p, t = params, params.train
    vocab = f"joint BPE {p.vocab.size}" if p.vocab.kind == "bpe" else f"word, min_freq {p.vocab.min_freq}"
    rows = [
        [
            "model",
            f"{model['model']}, dropout {p.model.dropout}, "
            f"{'tied' if p.model.tie_embeddings else 'separate'} embeddings",
        ],
        ["parameters", model["parameters"]],
        ["vocabulary", vocab],
        ["batches", f"{t.max_tokens} tokens × nproc {t.nproc} × nnodes {t.nnodes} × accum {t.accum}"],
        [
            "schedule",
            f"{t.epochs} epochs ({model['updates']} updates), factor {t.factor}, warmup {t.warmup}"
            + (f", cooldown over the last {t.cooldown:.0%}" if t.cooldown else ""),
        ],
        [
            "regularization",
            f"label smoothing {t.label_smoothing}, dropout {p.model.dropout}"
            + (f", attention dropout {p.model.attn_dropout}" if p.model.attn_dropout else "")
            + (f", feed-forward dropout {p.model.ff_dropout}" if p.model.ff_dropout else "")
            + (f", source word dropout {p.model.word_dropout}" if p.model.word_dropout else "")
            + (f", BPE-dropout {t.bpe_dropout}" if t.bpe_dropout else "")
            + (f", weight decay {t.weight_decay}" if t.weight_decay else "")
            + (f", R-Drop α {t.rdrop}" if t.rdrop else "")
            + (f" on {t.rdrop_share:.0%} of each batch's sentences" if t.rdrop and t.rdrop_share < 1 else "")
            + (f" over the last {1 - t.rdrop_from:.0%} of the updates" if t.rdrop and t.rdrop_from else "")
            + (" on one encoder pass" if t.rdrop and t.rdrop_shared_encoder else ""),
        ],
        ["precision, seed", f"{t.precision}, seed {t.seed}"],
        *(
            [
                [
                    "ensemble",
                    f"{t.members} models, seeds {', '.join(map(str, t.member_seeds()))}: their next-token "
                    f"probabilities averaged in beam search",
                ]
            ]
            if t.members > 1
            else []
        ),
        ["averaged", _averaged(p.average.last_k, p.average.select)],
        ["decoding", f"beam {p.decode.beam}, α {p.decode.alpha}, max length source + {p.decode.max_len_extra}"],
        ["training time", model["training time"]],
    ]
    return markdown_table(["", ""], rows)


def _averaged(k: int, select: str) -> str:
    if select == "best":
        return (
            f"the {k} checkpoints with the highest val BLEU"
            if k > 1
            else "no: the checkpoint with the highest val BLEU"
        )
    return f"last {k} checkpoints" if k > 1 else "no: the last checkpoint alone"


def timing_table(timings: dict[str, dict[str, Any]]) -> list[str]:
    """Each stage's wall time; a stage that resumed work (train) counts its earlier invocations' too,
    and says how much."""
    rows = []
    for name, t in timings.items():
        resumed = f" ({_minutes(t['resumed_s'])} of it before a resume)" if t.get("resumed_s") else ""
        rows.append([name, _minutes(t["wall_s"]) + resumed, t["finished"]])
    rows.append(["**total**", f"**{_minutes(sum(t['wall_s'] for t in timings.values()))}**", ""])
    return markdown_table(["stage", "wall time", "finished (UTC)"], rows)


def section(
    params: Params,
    scores: dict[str, dict[str, Any]],
    signatures: dict[str, dict[str, str]],
    model: dict[str, Any],
    timings: dict[str, dict[str, Any]],
    anchors: list[dict[str, Any]],
    host: str,
    commit: str | None,
    shown: tuple[str, list[str]] = ("", []),
    verdict: str = "",
) -> str:
    """The section of one run: `host` is the class it was decoded and scored on (system.host_class), `shown`
    a test set's name and the lines of `examples` from it, `verdict` the paragraph comparing the run with
    the committed reference (verdict.paragraph)."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    parts = [
        f"## {params.data.corpus} {_direction(params)}",
        "",
        *headline(params, scores, anchors, timings),
        "",
        *([verdict, ""] if verdict else []),
        "Beside the published figures, each in the metric it was published with:",
        "",
        *comparison(scores, anchors, "published"),
        "",
        *_baselines(scores, anchors),
        "All scores:",
        "",
        *score_table(scores, signatures),
        "",
        "Recipe:",
        "",
        *recipe(params, model),
        "",
        *([f"Translations of a few {shown[0]} sentences:", "", *shown[1], ""] if shown[1] else []),
        "Wall time per stage (each stage's process, start-up included; DVC's own bookkeeping between stages is not):",
        "",
        *timing_table(timings),
        "",
        f"Host class: {_host_line(model.get('trained on', 'unknown'), host)}. "
        f"Code: git commit {commit or 'unknown'}. Written {now}.",
    ]
    return "\n".join(parts) + "\n"


def _baselines(scores: dict[str, dict[str, Any]], anchors: list[dict[str, Any]]) -> list[str]:
    if not any(a["kind"] == "baseline" for a in anchors):
        return []
    return [
        "Beside our own baselines (other models trained by us, not published figures):",
        "",
        *comparison(scores, anchors, "baseline"),
        "",
    ]


def _host_line(trained: str, decoded: str) -> str:
    return trained if trained == decoded else f"trained on {trained}; decoded and scored on {decoded}"


def merge(existing: str, key: str, body: str) -> str:
    """The report with `key`'s section replaced by `body` (added if new); sections sorted by key."""
    sections = {}
    for chunk in existing.split("<!-- begin ")[1:]:
        name, rest = chunk.split(" -->\n", 1)
        sections[name] = rest.split(f"<!-- end {name} -->", 1)[0]
    sections[key] = body
    return TITLE + "".join(f"\n<!-- begin {k} -->\n{v}<!-- end {k} -->\n" for k, v in sorted(sections.items()))
