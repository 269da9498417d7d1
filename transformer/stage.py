"""What every stage script shares: the --params and --timing options, one clear error line and a
non-zero exit for bad input. Small on purpose: every stage imports it, so it imports only the
bottom of the package (errors, io)."""

from __future__ import annotations

import datetime
import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from transformer.errors import ERRORS, ConfigError
from transformer.io import write_json

PARAMS = click.option(
    "--params",
    "params_path",
    default="params.yaml",
    show_default=True,
    type=click.Path(path_type=Path),
    help="params file",
)


TIMING = click.option(
    "--timing",
    type=click.Path(path_type=Path),
    default=None,
    help="write this command's wall time here (JSON), for the reproduction report",
)


def process_age() -> float | None:
    """Seconds since this process started (Linux), so a stage's time includes Python's start-up and imports."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


WORKERS_ENV = "TRANSFORMER_WORKERS"


def workers() -> int:
    """Processes or threads a data stage may use: $TRANSFORMER_WORKERS, else the cores this process may
    run on. They change how soon the outputs come, never their bytes, so they are no param: as one, a
    machine with other cores would make DVC rerun the stage and every stage after it."""
    value = os.environ.get(WORKERS_ENV)
    if value is None:
        return len(os.sched_getaffinity(0))
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"${WORKERS_ENV}: expected a whole number of workers, 1 or more, got '{value}'")
    return int(value)


@dataclass(frozen=True)
class Resumed:
    """What a stage returns when it continued work that earlier, interrupted invocations saved (a
    training resumed from its checkpoints): their wall time, which its --timing adds to its own, so
    that the stage's time is that of all the work its outputs hold, not of the last piece alone."""

    earlier_s: float


def stage(fn):
    """Turns the project's errors and failed reads or writes (OSError) into `error: <message>` and
    exit status 1, never a traceback, and adds --timing."""

    @functools.wraps(fn)
    def wrapper(*args, timing: Path | None = None, **kwargs):
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except ERRORS as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except OSError as e:  # a full disk, a read-only or missing directory: the system's fault, not ours
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"error: {where}{e.strerror or e}", err=True)
            sys.exit(1)
        wall = time.perf_counter() - start
        earlier = result.earlier_s if isinstance(result, Resumed) else 0.0
        carried = f" (and {earlier:.1f} s in earlier invocations, resumed)" if earlier else ""
        click.echo(f"{Path(sys.argv[0]).stem}: done in {wall:.1f} s{carried}", err=True)
        if timing and os.environ.get("RANK", "0") == "0":  # under torchrun, the first process speaks
            finished = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            record = {"wall_s": round((process_age() or wall) + earlier, 1), "finished": finished}
            write_json(timing, record | ({"resumed_s": round(earlier, 1)} if earlier else {}))
        return result

    return TIMING(wrapper)
