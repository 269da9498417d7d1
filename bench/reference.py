"""Makes the finished run in this checkout its recipe's committed reference (`make reference`): copies its
headline test set's translations into reports/reference/<section>/ with a record of what made them (params,
scores, host class, commit) and the fingerprint of today's code's numerics on this class, a clean toy run's
(bench.toy.fingerprint). The report stage then judges every later run of the recipe against it, and the
test suite, on this class, fails once today's code would no longer make it.

Run it on the machine that made the run, with the pipeline up to date (`dvc status` clean); then
`dvc repro` writes the report's verdict ("identical") and both are committed."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import click

from bench.toy import DVC, clean_run, fingerprint
from transformer import checkpoints
from transformer.config import load_params
from transformer.evaluation import verdict
from transformer.evaluation.system import numerics_class
from transformer.io import read_json
from transformer.tracking import git_commit


@click.command()
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(path_type=Path))
def main(params_path: Path) -> None:
    stale = subprocess.run([DVC, "status", "--quiet"], capture_output=True, text=True)
    if stale.returncode != 0:
        sys.exit("error: the pipeline is not up to date (`dvc status`); run `dvc repro` first")
    params = load_params(params_path)
    model = checkpoints.load("data/model/model.pt")
    click.echo("fingerprinting this class's numerics: a clean toy run (a minute or two)", err=True)
    with tempfile.TemporaryDirectory() as tmp:
        toy = fingerprint(clean_run(Path(tmp)))
    out = verdict.reference_dir(params)
    written = verdict.record(
        params,
        read_json("reports/scores.json"),
        Path("data/translations"),
        Path("data/raw"),
        out,
        host_class=model.get("host_class"),
        commit=git_commit(),
        fingerprint={"numerics_class": numerics_class(), "toy": toy},
    )
    click.echo(f"{out}: {written['section']}, {written['testset']}, made on {written['host_class']}", err=True)


if __name__ == "__main__":
    main()
