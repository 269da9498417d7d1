"""Stage train: launched by torchrun; resumes from its last checkpoint when params are unchanged;
trains train.members models, one after the other."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.kernels.memory import training_memory
from transformer.stage import PARAMS, Resumed, stage


@click.command()
@PARAMS
@click.option("--vocab", required=True, type=click.Path(path_type=Path), help="build_vocab's output directory")
@click.option(
    "--tokenized",
    type=click.Path(path_type=Path),
    help="the tokenize stage's directory; its train text is segmented afresh each epoch when train.bpe_dropout > 0",
)
@click.option("--checkpoints", "ckpt_dir", required=True, type=click.Path(path_type=Path))
@click.option(
    "--steps", required=True, type=click.Path(path_type=Path), help="per-update report: loss, lr, tokens/s (TSV)"
)
@click.option(
    "--epochs", required=True, type=click.Path(path_type=Path), help="per-epoch report: train and validation loss (TSV)"
)
@click.option("--summary", required=True, type=click.Path(path_type=Path), help="the run's metrics (JSON)")
@click.option(
    "--references",
    required=True,
    type=click.Path(path_type=Path),
    help="raw reference translations of the validation split, for val BLEU",
)
@click.option("--track/--no-track", default=True, show_default=True, help="log to MLflow")
@stage
def main(
    params_path: Path,
    vocab: Path,
    tokenized: Path | None,
    ckpt_dir: Path,
    steps: Path,
    epochs: Path,
    summary: Path,
    references: Path,
    track: bool,
) -> Resumed:
    from transformer import tracking
    from transformer.training.train import Outputs, train

    params = load_params(params_path)
    if track:
        tracking.prepare_store(tracking.tracking_uri())  # before any training work
    outputs = Outputs(ckpt_dir, steps, epochs, summary)
    tracker_factory = tracking.open_run if track else None
    results = train(params, vocab, outputs, tracker_factory, tokenized=tokenized, references=references)
    for seed, result in zip(params.train.member_seeds(), results):
        click.echo(f"trained (seed {seed}): {result}", err=True)
    return Resumed(sum(r["resumed_s"] for r in results))  # what earlier invocations spent on the work resumed


if __name__ == "__main__":
    training_memory()  # before any work: oneDNN's kernel cache limited, training's blocks on mimalloc
    main()
