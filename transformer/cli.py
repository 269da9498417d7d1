"""The `transformer` command: what a user runs on a trained model. No stage imports it."""

from __future__ import annotations

from pathlib import Path

import click

from transformer.stage import stage


@click.group()
def main() -> None:
    """The reproducible Transformer."""


@main.command()
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path),
              help="a model file (the average_checkpoints stage's output, or any checkpoint)")
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
