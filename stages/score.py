"""Stage score: every decoded test set against its reference; metrics, a Markdown table, MLflow."""

from pathlib import Path

import click

from transformer.stage import PARAMS, stage
from transformer.config import load_params
from transformer.io import write_json, write_text


@click.command()
@PARAMS
@click.option("--translations", required=True, type=click.Path(path_type=Path), help="directory of <testset>.txt")
@click.option("--references", required=True, type=click.Path(path_type=Path), help="download's output directory")
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path), help="the model that translated")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="scores JSON (DVC metrics)")
@click.option("--signatures", "signatures_path", required=True, type=click.Path(path_type=Path), help="JSON sacreBLEU signature per test set and metric")
@click.option("--table", required=True, type=click.Path(path_type=Path), help="scores Markdown")
@click.option("--track/--no-track", default=True, show_default=True, help="log into the training's MLflow run")
@stage
def main(params_path: Path, translations: Path, references: Path, model_path: Path, out: Path, signatures_path: Path, table: Path, track: bool) -> None:
    from transformer import checkpoints
    from transformer.score import markdown_report, score_files, signatures, values
    from transformer.system import describe_model, hardware

    params = load_params(params_path)
    tgt = params.data.tgt_lang
    scores = {t: score_files(translations / f"{t}.txt", references / f"{t}.{tgt}", tgt, params.score.metrics)
              for t in params.decode.testsets}
    model = checkpoints.load(model_path)
    meta = describe_model(model) | {"hardware": hardware()}
    write_json(out, {t: values(s) for t, s in scores.items()})
    write_json(signatures_path, {t: signatures(s) for t, s in scores.items()})
    write_text(table, markdown_report(scores, meta))
    for t, s in scores.items():
        click.echo(f"{t}: " + ", ".join(f"{k} {v}" for k, v in values(s).items()), err=True)
    if track and model.get("mlflow_run_id"):
        from transformer.tracking import Tracker

        tracker = Tracker.attach(model["mlflow_run_id"])
        tracker.log_metrics({f"{t}_{k}": v for t, s in scores.items() for k, v in values(s).items()}, model["step"])
        for t in scores:
            tracker.log_artifact(translations / f"{t}.txt", "translations")
        tracker.log_artifact(table, "reports")
        tracker.end()


if __name__ == "__main__":
    main()
