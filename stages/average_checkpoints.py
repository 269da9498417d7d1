"""Stage average_checkpoints: the mean of average.last_k checkpoints (the last, or the best on val BLEU), as one model file."""

from pathlib import Path

import click

from transformer import checkpoints
from transformer.stage import PARAMS, stage
from transformer.config import load_params


@click.command()
@PARAMS
@click.option("--checkpoints", "ckpt_dir", required=True, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="averaged model file")
@click.option("--track/--no-track", default=True, show_default=True, help="log the model to the training's MLflow run")
@stage
def main(params_path: Path, ckpt_dir: Path, out: Path, track: bool) -> None:
    p = load_params(params_path).average
    model = checkpoints.average_checkpoints(ckpt_dir, p.last_k, p.select)
    checkpoints.save(out, model)
    click.echo(f"averaged {', '.join(model['averaged'])} into {out}", err=True)
    if track:
        from transformer.tracking import log_to_run

        log_to_run(model.get("mlflow_run_id"), {"model": [out]})


if __name__ == "__main__":
    main()
