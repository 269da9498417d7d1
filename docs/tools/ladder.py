"""The ladder from the Annotated Transformer's recipe to this project's default (docs/ladder.yaml): step 0
is the preset, each later step the one before with one more change, and the last step the default. Each
step is a DVC experiment at the default's seed; the table compares each step with the one before it.

    python docs/tools/ladder.py run       # runs each step in the workspace: dvc exp run -n ladder-<k> -S ...
    python docs/tools/ladder.py table     # compares the steps on test2016 and keeps a few sentences as
                                           # each step translates them: reports/ladder.json, which the
                                           # annotated page shows

`run` goes from the last step to the first, in the workspace rather than DVC's queue, so that a step
that changes only the averaging or the search takes the finished training of the step after it from
the checkpoints the workspace keeps (`train.keep`) instead of training again; params.yaml is put back
after each step. `table` reads each step's translations from its experiment; given files instead (one a step,
in order), it compares those."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

import click
import yaml

from transformer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SPEC = Path("docs/ladder.yaml")
RESULTS = Path("reports/ladder.json")
TESTSET = "test2016"


def steps(root: Path = ROOT) -> list[dict[str, Any]]:
    """[{name, change, overrides: {"section.key": value}}] a step, the overrides those of the step's
    `-S` options: the preset's keys that no step up to it has set back to the default. Refuses, naming
    docs/ladder.yaml, a key the preset does not change, one set back twice, or a last step that is not
    the default."""
    from transformer.presets import delta

    spec = yaml.safe_load((root / SPEC).read_text(encoding="utf-8"))
    left = {
        f"{s}.{k}": v
        for s, keys in delta(spec["preset"], root).items()
        if s not in spec["names"]
        for k, v in keys.items()
    }
    found = []
    for k, step in enumerate(spec["steps"]):
        for key in step["to_default"]:
            if key not in left:
                raise ConfigError(
                    f"{SPEC}: step {k} sets {key} back, which the preset or an earlier step left at the default"
                )
            del left[key]
        found.append({"name": f"ladder-{k}", "change": step["change"], "overrides": dict(left)})
    if left:
        raise ConfigError(f"{SPEC}: the last step is not the default: {', '.join(left)} still differ")
    return found


def options(overrides: dict[str, Any]) -> list[str]:
    """`-S key=value` a key, each value as params.yaml writes it."""
    from transformer.config import yaml_value

    return [word for key, value in overrides.items() for word in ("-S", f"{key}={yaml_value(value)}")]


@click.group()
def main() -> None:
    """The ladder from the Annotated Transformer's recipe to the default."""


@main.command()
@click.argument("numbers", nargs=-1, type=int)
def run(numbers: tuple[int, ...]) -> None:
    """Runs the steps NUMBERS (all by default), last first, as DVC experiments in the workspace. Hours on
    a CPU: each step that trains takes as long as its recipe does."""
    params = Path("params.yaml")
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(params)]).returncode:
        raise click.UsageError(f"{params} differs from the last commit: commit or stash it, the steps start from it")
    found = steps()
    for k in sorted(numbers or range(len(found)), reverse=True):
        step, kept = found[k], params.read_bytes()
        try:
            subprocess.run(["dvc", "exp", "run", "-n", step["name"], *options(step["overrides"])], check=True)
        finally:
            params.write_bytes(kept)


@main.command()
@click.argument("systems", nargs=-1)
@click.option("--sources", default=f"data/raw/{TESTSET}.de", show_default=True, help="the test set's sources")
@click.option("--refs", default=f"data/raw/{TESTSET}.en", show_default=True, help="the test set's references")
@click.option("--lang", default="en", show_default=True, help="the target language")
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="the last step's model file  [default: its experiment's averaged model, from DVC's cache]",
)
def table(systems: tuple[str, ...], sources: str, refs: str, lang: str, model_path: Path | None) -> None:
    """Compares each step with the one before on the test set and writes reports/ladder.json, with a few
    of the test set's sentences as each step translates them, and the last step's source attention as
    it writes the first of them."""
    from transformer.config import CHOICES
    from transformer.evaluation.compare import compare, load_system, stage_output
    from transformer.evaluation.report import example_rows
    from transformer.io import check_aligned, read_lines, write_json

    found = steps()
    systems = systems or tuple(step["name"] for step in found)
    if len(systems) != len(found):
        raise click.UsageError(f"{len(found)} steps but {len(systems)} systems")
    loaded = [(step["name"], load_system(system, TESTSET)) for step, system in zip(found, systems)]
    source_lines, references = read_lines(sources), read_lines(refs)
    check_aligned([Path(sources), Path(refs)], [len(source_lines), len(references)], f"{TESTSET} test set")
    compared = compare(loaded, references, lang, CHOICES["score.metrics"], stepwise=True)
    examples = example_rows(source_lines, references, [lines for _, lines in loaded])
    with tempfile.TemporaryDirectory() as tmp:
        if model_path is None:  # the averaged model, where its stage writes it, as the last step left it
            model_path = fetched(stage_output("average_checkpoints", ROOT / "dvc.yaml"), found[-1]["name"], Path(tmp))
        attention = source_attention(model_path, examples[0]["source"]) | {"line": examples[0]["line"]}
    written = {"testset": TESTSET, "steps": found, "metrics": compared, "examples": examples, "attention": attention}
    write_json(RESULTS, written)
    click.echo(f"wrote {RESULTS}", err=True)


def fetched(path: str, experiment: str, into: Path, root: Path = ROOT) -> Path:
    """`path` as the DVC experiment `experiment` of the project at `root` left it, copied from DVC's cache
    into the folder `into`."""
    import shutil

    import dvc.api

    copy = into / Path(path).name
    with dvc.api.open(path, repo=str(root), rev=experiment, mode="rb") as stored, copy.open("wb") as out:
        shutil.copyfileobj(stored, out)
    return copy


def source_attention(model_path: Path, line: str) -> dict[str, Any]:
    """The model's last-layer source attention, the mean of its heads, as it writes its greedy
    translation of the raw source `line` (the figures stage's alignment map): the source's and the
    translation's tokens as the figures label them, and the weights, a row per written token."""
    from transformer.data.tokenize import Tokenizer
    from transformer.data.vocab import model_vocabs
    from transformer.evaluation.figures import attention_maps
    from transformer.model.model import load_model

    model, ckpt = load_model(model_path)
    params = ckpt["params"]
    tokenized = Tokenizer(params["data"]["src_lang"])(line)
    (maps,) = attention_maps(model, *model_vocabs(ckpt), [tokenized], params["decode"]["max_len_extra"])
    weights = [[round(w, 4) for w in row] for row in maps.alignment().tolist()]
    return {"source": maps.src, "outputs": maps.outputs, "weights": weights}


if __name__ == "__main__":
    main()
