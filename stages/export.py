"""Stage export: the averaged model for use elsewhere, as a CTranslate2 model directory and, when
the training was tracked, as an MLflow pyfunc model in its run, registered under export.registered_name."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.stage import PARAMS, stage


@click.command()
@PARAMS
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path), help="averaged model file")
@click.option(
    "--vocab",
    required=True,
    type=click.Path(path_type=Path),
    help="build_vocab's output directory (its vocab.pt goes into the MLflow model)",
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="CTranslate2 model directory")
@click.option(
    "--track/--no-track",
    default=True,
    show_default=True,
    help="log and register the MLflow model in the training's run",
)
@stage
def main(params_path: Path, model_path: Path, vocab: Path, out: Path, track: bool) -> None:
    from transformer import checkpoints
    from transformer.serving.export import write_ctranslate2

    p = load_params(params_path).export
    model = checkpoints.load(model_path)
    write_ctranslate2(model, out, p.quantization)
    click.echo(f"{model_path}: CTranslate2 model ({p.quantization}) in {out}", err=True)
    if model.get("members"):
        click.echo(
            f"{model_path}: an ensemble of {len(model['members']) + 1} models; CTranslate2 searches with one, so "
            f"{out} holds the first member's alone (seed {model['params']['train']['seed']}); the MLflow model "
            f"and transformer translate use them all",
            err=True,
        )
    run_id = model.get("mlflow_run_id")
    if track and run_id:
        from transformer.serving.serving import log_model
        from transformer.tracking import run_in_store, store_errors

        if run_in_store(run_id, f"the MLflow model (registered name '{p.registered_name}')"):
            with store_errors():
                uri = log_model(model_path, vocab / "vocab.pt", run_id, p.registered_name)
            click.echo(f"{model_path}: MLflow model {uri}, registered as '{p.registered_name}'", err=True)


if __name__ == "__main__":
    main()
