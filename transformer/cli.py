"""What every stage shares: one clear error line and a non-zero exit for bad input; the `transformer` command."""

from __future__ import annotations

import datetime
import functools
import os
import sys
import time
from pathlib import Path

import click

from transformer.config import ConfigError
from transformer.io import DataError, write_json

PARAMS = click.option("--params", "params_path", default="params.yaml", show_default=True,
                      type=click.Path(path_type=Path), help="params file")


TIMING = click.option("--timing", type=click.Path(path_type=Path), default=None,
                      help="write this command's wall time here (JSON), for the reproduction report")


def process_age() -> float | None:
    """Seconds since this process started (Linux), so a stage's time includes Python's start-up and imports."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def stage(fn):
    """Turns the project's errors into `error: <message>` and exit status 1, never a traceback,
    and adds --timing."""
    from transformer.tracking import TrackingError
    from transformer.train import TrainingError

    @functools.wraps(fn)
    def wrapper(*args, timing: Path | None = None, **kwargs):
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except (ConfigError, DataError, TrackingError, TrainingError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        wall = time.perf_counter() - start
        click.echo(f"{Path(sys.argv[0]).stem}: done in {wall:.1f} s", err=True)
        if timing and os.environ.get("RANK", "0") == "0":  # under torchrun, the first process speaks
            finished = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            write_json(timing, {"wall_s": round(process_age() or wall, 1), "finished": finished})
        return result

    return TIMING(wrapper)


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
