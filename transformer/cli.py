"""What every stage shares: one clear error line and a non-zero exit for bad input; the `transformer` command."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import click

from transformer.config import ConfigError
from transformer.io import DataError

PARAMS = click.option("--params", "params_path", default="params.yaml", show_default=True,
                      type=click.Path(path_type=Path), help="params file")


def stage(fn):
    """Turns the project's errors into `error: <message>` and exit status 1, never a traceback."""
    from transformer.tracking import TrackingError
    from transformer.train import TrainingError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except (ConfigError, DataError, TrackingError, TrainingError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        click.echo(f"{Path(sys.argv[0]).stem}: done in {time.perf_counter() - start:.1f} s", err=True)
        return result

    return wrapper


@click.group()
def main() -> None:
    """The reproducible Transformer."""


@main.command()
@click.option("--model", "model_path", default="data/model/model.pt", show_default=True, type=click.Path(path_type=Path),
              help="a model file (averaged by the pipeline, or any checkpoint)")
@click.option("--input", "input_file", type=click.File("r", encoding="utf-8"), default="-", help="raw text, one sentence a line (default: stdin)")
@click.option("--beam", type=int, help="beam size (default: the model's decode params)")
@click.option("--alpha", type=float, help="length penalty (default: the model's decode params)")
@stage
def translate(model_path: Path, input_file, beam: int | None, alpha: float | None) -> None:
    """Translates raw text, one sentence per line, to stdout."""
    from transformer.translate import Translator

    translator = Translator(model_path)
    decode = translator.params["decode"]
    lines = [line.rstrip("\n") for line in input_file]
    for line in translator.translate(lines, beam=beam or decode["beam"], alpha=decode["alpha"] if alpha is None else alpha,
                                     max_len_extra=decode["max_len_extra"], batch_tokens=decode["batch_tokens"]):
        click.echo(line)
