"""Stage figures: attention maps of the first validation sentences, the learning-rate schedule, loss curves."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.stage import PARAMS, stage


@click.command()
@PARAMS
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path), help="the averaged model")
@click.option(
    "--source",
    required=True,
    type=click.Path(path_type=Path),
    help="tokenized source text; its first 3 non-empty sentences are translated greedily and drawn",
)
@click.option("--steps", required=True, type=click.Path(path_type=Path), help="train's per-update report (TSV)")
@click.option("--epochs", required=True, type=click.Path(path_type=Path), help="train's per-epoch report (TSV)")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="directory of PNG figures")
@click.option(
    "--track/--no-track", default=True, show_default=True, help="log the figures into the training's MLflow run"
)
@stage
def main(params_path: Path, model_path: Path, source: Path, steps: Path, epochs: Path, out: Path, track: bool) -> None:
    from transformer.evaluation.figures import draw_figures
    from transformer.model.model import load_model

    params = load_params(params_path)
    model, ckpt = load_model(model_path)
    t = params.train
    schedule = {"d_model": params.model.d_model, "factor": t.factor, "warmup": t.warmup, "cooldown": t.cooldown}
    paths = draw_figures(model, ckpt, source, steps, epochs, out, **schedule)
    click.echo(f"drew {len(paths)} figures into {out}", err=True)
    if track:
        from transformer.tracking import log_to_run

        log_to_run(ckpt.get("mlflow_run_id"), {"figures": paths})


if __name__ == "__main__":
    main()
