"""The `transformer` command: what a user runs on a trained model. No stage imports it."""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import click

from transformer.config import CHOICES
from transformer.stage import stage


@click.group()
def main() -> None:
    """The reproducible Transformer."""


def _model_files(what_an_ensemble_does: str):
    """The --model option of the commands that use a trained model, one file or an ensemble of several."""
    return click.option(
        "--model",
        "model_paths",
        required=True,
        multiple=True,
        type=click.Path(path_type=Path),
        help="a model file (the average_checkpoints stage's output, or any checkpoint); "
        f"given more than once, {what_an_ensemble_does}",
    )


@main.command()
@_model_files("the models translate as an ensemble")
@click.option(
    "--input",
    "input_file",
    type=click.File("rb"),
    default="-",
    help="raw UTF-8 text, one sentence a line (default: stdin)",
)
@click.option("--beam", type=click.IntRange(min=1), help="beam size; 1 is greedy (default: the model's decode params)")
@click.option("--alpha", type=click.FloatRange(min=0), help="length penalty (default: the model's decode params)")
@click.option(
    "--nbest",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="hypotheses per sentence (at most --beam; with --sample, draws); > 1 writes JSON lines",
)
@click.option("--scores", is_flag=True, help="write JSON lines with each hypothesis's score")
@click.option("--sample", is_flag=True, help="draw translations from the model instead of searching")
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="--sample: keep the k most probable tokens (0: all)",
)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="--sample: keep the smallest set of tokens holding this much probability",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="--sample: divides the log-probabilities (< 1: sharper)",
)
@click.option("--seed", type=int, help="--sample: random seed; the same input and seed give the same output")
@stage
def translate(
    model_paths: tuple[Path, ...],
    input_file,
    beam: int | None,
    alpha: float | None,
    nbest: int,
    scores: bool,
    sample: bool,
    top_k: int,
    top_p: float,
    temperature: float,
    seed: int | None,
) -> None:
    """Translates raw text, one sentence per line, to stdout: one line per sentence, or with
    --nbest > 1 or --scores one JSON object per hypothesis:
    {"line": <input line, from 1>, "rank": <from 1>, "score": <log P(translation | source)>, "translation": ...}."""
    from transformer.decoding.translate import LongSourceWarning, Translator
    from transformer.io import decode_lines

    name = getattr(input_file, "name", "<stdin>")
    lines = decode_lines(input_file.read(), name)
    translator = Translator.load(model_paths)
    if not sample and nbest > (beam or translator.params["decode"]["beam"]):
        raise click.BadParameter(f"{nbest} exceeds the beam size; raise --beam", param_hint="--nbest")
    given = {"beam": beam, "alpha": alpha}  # an option left out keeps the model's decode param
    search = translator.search(
        **{name: value for name, value in given.items() if value is not None},
        nbest=nbest,
        sample=sample,
        top_k=top_k,
        top_p=top_p,
        temperature=temperature,
        seed=seed,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = translator.translate(lines, search, return_scores=True)
    for w in caught:
        if issubclass(w.category, LongSourceWarning):
            click.echo(f"warning: {name}: {w.message}", err=True)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if nbest == 1 and not scores:
        click.echo("".join(text + "\n" for text, _ in found), nl=False)
        return
    for i, hyps in enumerate([[h] for h in found] if nbest == 1 else found, start=1):
        for rank, (text, score) in enumerate(hyps, start=1):
            click.echo(
                json.dumps({"line": i, "rank": rank, "score": round(score, 4), "translation": text}, ensure_ascii=False)
            )


def _scoring(command):
    """The options that say how translations are scored, shared by score and compare."""
    command = click.option(
        "--metric",
        "metrics",
        multiple=True,
        type=click.Choice(CHOICES["score.metrics"]),
        default=CHOICES["score.metrics"],
        show_default=True,
        help="given once per metric",
    )(command)
    return click.option(
        "--lang", required=True, help="the target language (BLEU tok-lc tokenizes with its Moses rules)"
    )(command)


@main.command()
@click.option(
    "--hyps", required=True, type=click.Path(path_type=Path), help="translations, one detokenized sentence a line"
)
@click.option("--refs", required=True, type=click.Path(path_type=Path), help="references, line for line")
@_scoring
@stage
def score(hyps: Path, refs: Path, lang: str, metrics: tuple[str, ...]) -> None:
    """Scores translations as the score stage does and prints one JSON object: {<metric>: value,
    <metric>_ci95: [low, high] (its 95% bootstrap interval), <metric>_signature: sacreBLEU's signature}."""
    from transformer.evaluation.score import score_files

    click.echo(json.dumps(score_files(hyps, refs, lang, metrics), indent=1))


@main.command()
@click.argument("systems", nargs=-1, required=True)
@click.option(
    "--refs",
    required=True,
    type=click.Path(path_type=Path),
    help="references, line for line; its name without the language suffix names the test set",
)
@_scoring
@click.option(
    "--stepwise", is_flag=True, help="compare each system with the one before it, not with the first (a ladder)"
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
@stage
def compare(
    systems: tuple[str, ...], refs: Path, lang: str, metrics: tuple[str, ...], stepwise: bool, as_json: bool
) -> None:
    """Compares SYSTEMS on one test set, the first the baseline. Each is a translation file, or a git revision
    or DVC experiment whose decode@<testset> output DVC reads. Prints each score with its 95% interval, the
    difference to the baseline with its interval, and the p-values of sacreBLEU's paired approximate
    randomization and paired bootstrap tests, with the signature.

    Systems joined by commas (exp-a1,exp-a2,exp-a3: one recipe's seeds) form a group, and an existing file
    is one system whatever its name. Given a group, every argument is a group (a system alone, one of one):
    prints each group's mean and standard deviation over its systems, and the p-value of a t-test against the
    first group (Welch's; Student's where one side is a single system).

    With --stepwise, each system's difference and p-values are against the system before it: a ladder of
    changes, each step the one before plus one more."""
    from transformer.evaluation import compare as paired
    from transformer.evaluation import groups
    from transformer.io import read_lines

    testset = refs.name.split(".")[0]
    found_members = [groups.members(s) for s in systems]
    if any(len(m) > 1 for m in found_members):
        if stepwise:
            raise click.UsageError("--stepwise compares single systems, not groups of seeds")
        loaded = [(s, [(m, paired.load_system(m, testset)) for m in ms]) for s, ms in zip(systems, found_members)]
        found, table = groups.compare_groups(loaded, read_lines(refs), lang, metrics), groups.markdown
    else:
        loaded = [(s, paired.load_system(s, testset)) for s in systems]
        found = paired.compare(loaded, read_lines(refs), lang, metrics, stepwise=stepwise)
        table = functools.partial(paired.markdown, stepwise=stepwise)
    against = "previous" if stepwise else "first"
    shown = {"testset": testset, "against": against, "metrics": found}
    click.echo(json.dumps(shown, indent=1) if as_json else table(found, testset))


@main.command("score-model")
@_model_files("the ensemble scores")
@click.option("--source", required=True, type=click.Path(path_type=Path), help="raw source text, one sentence a line")
@click.option("--target", required=True, type=click.Path(path_type=Path), help="raw translations, line for line")
@stage
def score_model(model_paths: tuple[Path, ...], source: Path, target: Path) -> None:
    """Forced decoding: prints each target line's log P(target | source) under the model, one a line, the
    score `translate --scores` gives a translation the search finds; then, on stderr, the total, the tokens
    it sums over (subwords and each line's </s>) and the mean per token."""
    from transformer.decoding.translate import Translator
    from transformer.io import DataError, read_lines

    sources, targets = read_lines(source), read_lines(target)
    if len(sources) != len(targets):
        raise DataError(f"{target}: has {len(targets)} lines but the source {source} has {len(sources)}")
    try:
        scored = Translator.load(model_paths).score(sources, targets)
    except DataError as e:
        raise DataError(f"{source}, {target}: {e}") from None
    click.echo("".join(f"{s.score:.4f}\n" for s in scored), nl=False)
    total, tokens = sum(s.score for s in scored), sum(s.tokens for s in scored)
    mean = f"{total / tokens:.4f}" if tokens else "-"
    click.echo(f"total {total:.4f} over {tokens} tokens, {mean} per token", err=True)


@main.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["ctranslate2", "hf"]),
    default="ctranslate2",
    show_default=True,
    help="hf: a directory Hugging Face transformers loads; the model only, the tokenizer is not exported yet",
)
@click.option(
    "--model", "model_path", default="data/model/model.pt", show_default=True, type=click.Path(path_type=Path)
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="model directory to write")
@click.option(
    "--quantization",
    type=click.Choice(CHOICES["export.quantization"]),
    default="none",
    show_default=True,
    help="weight type (ctranslate2); none keeps float32",
)
@stage
def export(fmt: str, model_path: Path, out: Path, quantization: str) -> None:
    """Exports a model file to an inference engine's format (CTranslate2) or to Hugging Face
    transformers (hf: the model only; the tokenizer is not exported yet)."""
    if fmt == "hf":
        from transformer.errors import DataError
        from transformer.serving.hf import export_hf

        if quantization != "none":
            raise DataError(f"--quantization {quantization} is for ctranslate2; hf writes float32")
        export_hf(model_path, out)
        click.echo(f"{model_path}: {fmt} model (float32, no tokenizer) in {out}", err=True)
        return
    from transformer.serving.export import export_ctranslate2

    export_ctranslate2(model_path, out, quantization)
    click.echo(f"{model_path}: {fmt} model ({quantization}) in {out}", err=True)


@main.command()
@click.argument("version", type=click.IntRange(min=1))
@click.option("--alias", default="champion", show_default=True, help="the alias to point at VERSION")
@click.option(
    "--params",
    "params_path",
    default="params.yaml",
    show_default=True,
    type=click.Path(path_type=Path),
    help="its export.registered_name names the registered model",
)
@stage
def promote(version: int, alias: str, params_path: Path) -> None:
    """Points models:/<export.registered_name>@<alias> at a registered VERSION of the model."""
    from transformer.config import load_params
    from transformer.serving.serving import promote as set_alias

    name = load_params(params_path).export.registered_name
    set_alias(name, version, alias)
    click.echo(f"models:/{name}@{alias} -> version {version}", err=True)


@main.command()
@click.option(
    "--file",
    "path",
    default="reports/verdict.json",
    show_default=True,
    type=click.Path(path_type=Path),
    help="the report stage's verdict",
)
@stage
def verdict(path: Path) -> None:
    """Prints whether the last `dvc repro` reproduced the committed reference of its recipe: identical,
    reproduced (no significant difference), differs, or why it was not compared."""
    from transformer.io import read_json

    click.echo(read_json(path)["line"])
