"""Stage average_checkpoints: the mean of average.last_k checkpoints (the last, or the best on val BLEU), as one
model file; with train.members > 1, one such mean per member, in the same file."""

from pathlib import Path

import click

from transformer import checkpoints
from transformer.config import load_params
from transformer.stage import PARAMS, stage


@click.command()
@PARAMS
@click.option("--checkpoints", "ckpt_dir", required=True, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="averaged model file")
@click.option("--track/--no-track", default=True, show_default=True, help="log the model to the training's MLflow run")
@stage
def main(params_path: Path, ckpt_dir: Path, out: Path, track: bool) -> None:
    params = load_params(params_path)
    p = params.average
    model = checkpoints.average_members(ckpt_dir, params.train.member_seeds(), p.last_k, p.select)
    checkpoints.save(out, model)
    for seed, member in zip(params.train.member_seeds(), [model] + model.get("members", [])):
        of = f" of seed {seed}" if params.train.members > 1 else ""
        click.echo(f"averaged {', '.join(member['averaged'])}{of} into {out}", err=True)
    if track:
        from transformer.tracking import log_to_run

        log_to_run(model.get("mlflow_run_id"), {"model": [out]})


if __name__ == "__main__":
    main()
