"""Stage score: every decoded test set against its reference; metrics, a Markdown table, and an MLflow
run of this evaluation nested under the training's, whose id the report stage logs its section into."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.io import write_json, write_text
from transformer.stage import PARAMS, stage


@click.command()
@PARAMS
@click.option("--translations", required=True, type=click.Path(path_type=Path), help="directory of <testset>.txt")
@click.option("--references", required=True, type=click.Path(path_type=Path), help="download's output directory")
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path), help="the model that translated")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="scores JSON (DVC metrics)")
@click.option(
    "--signatures",
    "signatures_path",
    required=True,
    type=click.Path(path_type=Path),
    help="JSON sacreBLEU signature per test set and metric",
)
@click.option("--table", required=True, type=click.Path(path_type=Path), help="scores Markdown")
@click.option(
    "--evaluation",
    required=True,
    type=click.Path(path_type=Path),
    help='JSON {"mlflow_run_id": this evaluation\'s run, null when untracked}',
)
@click.option(
    "--track/--no-track",
    default=True,
    show_default=True,
    help="log an MLflow run of its own, nested under the training's",
)
@stage
def main(
    params_path: Path,
    translations: Path,
    references: Path,
    model_path: Path,
    out: Path,
    signatures_path: Path,
    table: Path,
    evaluation: Path,
    track: bool,
) -> None:
    from transformer import checkpoints
    from transformer.evaluation.score import (
        interval,
        markdown_report,
        metrics_json,
        score_files,
        signatures,
        with_interval,
    )
    from transformer.evaluation.system import describe_model, host_class

    params = load_params(params_path)
    tgt = params.data.tgt_lang
    scores = {
        t: score_files(translations / f"{t}.txt", references / f"{t}.{tgt}", tgt, params.score.metrics)
        for t in params.decode.testsets
    }
    model = checkpoints.load(model_path)
    meta = describe_model(model) | {"decoded and scored on": host_class()}
    scored = {t: metrics_json(s) for t, s in scores.items()}
    write_json(out, scored)
    write_json(signatures_path, {t: signatures(s) for t, s in scores.items()})
    write_text(table, markdown_report(scores, meta))
    for t, s in scores.items():
        click.echo(
            f"{t}: " + ", ".join(f"{m} {with_interval(s[m], interval(s, m))}" for m in params.score.metrics),
            err=True,
        )
    tracked = track and model.get("mlflow_run_id")
    note = evaluation.with_name(f".{evaluation.name}.run")  # the evaluation's run id while it is logged
    run_id = _log_evaluation(params, model, scored, translations, references, table, note=note) if tracked else None
    write_json(evaluation, {"mlflow_run_id": run_id})
    note.unlink(missing_ok=True)


def _log_evaluation(
    params, model: dict, scored: dict[str, dict[str, float]], translations: Path, references: Path, table: Path, *, note
) -> str:
    """This evaluation's own MLflow run, under the training's: decode (and averaging) params, scores, corpus files.
    Returns its id."""
    from transformer.config import flatten
    from transformer.evaluation.score import flat_metrics
    from transformer.tracking import experiment_name, log_evaluation

    d = params.data
    contexts = {"train": "training", d.valid: "validation"} | {t: "evaluation" for t in scored}
    inputs = {
        f"{d.corpus}/{split}.{lang}": (references / f"{split}.{lang}", context)
        for split, context in contexts.items()
        for lang in (d.src_lang, d.tgt_lang)
    }
    run_params = {k: v for k, v in flatten(params).items() if k.startswith(("decode.", "average."))}
    what = f"evaluate beam={params.decode.beam} alpha={params.decode.alpha}"
    return log_evaluation(
        model["mlflow_run_id"],
        experiment_name(d.corpus, d.src_lang, d.tgt_lang),
        what,
        run_params,
        flat_metrics(scored),
        model["step"],
        inputs,
        {"translations": [translations / f"{t}.txt" for t in scored], "reports": [table]},
        note=note,
    )


if __name__ == "__main__":
    main()
