"""Presets: a recipe written as what it changes from the default.

params.yaml is the default recipe and the one place its values are written. A preset,
params/<name>.yaml, holds only the keys it changes, each on its own line with a comment
saying why. `make preset P=<name>` writes params.yaml as the default with those lines in
place of the default's, marked on its first line with the preset's name; the strict loader
checks the result. Switching also swaps the run records: the recipe being left keeps its
dvc.lock and its uncached reports under params/runs/<name>/, and the recipe switched to gets
its own back from there, so `dvc status`, `dvc metrics show` and `dvc plots show` speak of
the recipe in params.yaml.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from transformer.config import SECTIONS, params_from_dict
from transformer.errors import ConfigError
from transformer.io import write_text

DEFAULT = "multi30k_de_en"  # the preset that changes nothing: params.yaml's own recipe
MARK = "# preset: "
RUNS = Path("params/runs")
SECTION = re.compile(r"([a-z_]+):\s*(#.*)?$")
KEY = re.compile(r"  ([A-Za-z_][A-Za-z0-9_]*):")  # keys may hold digits (ddp_bf16_grads)


def preset_path(name: str, root: Path = Path(".")) -> Path:
    return root / "params" / f"{name}.yaml"


def names(root: Path = Path(".")) -> list[str]:
    return sorted(p.stem for p in (root / "params").glob("*.yaml"))


def delta(name: str, root: Path = Path(".")) -> dict[str, dict[str, Any]]:
    """The keys a preset changes, {section: {key: value}}; an unknown name or a malformed file
    raises ConfigError naming it."""
    path = preset_path(name, root)
    if not path.is_file():
        raise ConfigError(f"{path}: no such preset (presets: {', '.join(names(root))})")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{path}: expected sections of keys, as in params.yaml")
    for section in raw:
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section '{section}' (known: {', '.join(SECTIONS)})")
    return raw


def build(default: str, name: str, root: Path = Path(".")) -> str:
    """params.yaml's text for a preset: the default's text (without a preset mark) with the
    preset's own lines in place of the keys it changes, and the preset's opening comment."""
    if name == DEFAULT:
        delta(name, root)  # it must exist and hold nothing
        return default
    changes = delta(name, root)
    lines = _key_lines(preset_path(name, root).read_text(encoding="utf-8"))
    out, section, seen = [], None, set()
    for line in _body(default):
        if match := SECTION.match(line):
            section = match.group(1)
        elif (match := KEY.match(line)) and match.group(1) in changes.get(section, {}):
            line = lines[section, match.group(1)]
            seen.add((section, match.group(1)))
        out.append(line)
    missing = sorted(f"{s}.{k}" for s, keys in changes.items() for k in keys if (s, k) not in seen)
    if missing:
        raise ConfigError(f"{preset_path(name, root)}: unknown key{'s' * (len(missing) > 1)} {', '.join(missing)}")
    header = [f"{MARK}{name} (built by make preset; make preset P={DEFAULT} goes back to the default)"]
    header += [line for line in _header(preset_path(name, root).read_text(encoding="utf-8"))]
    text = "\n".join(header + out) + "\n"
    _check(text, default, changes, preset_path(name, root))
    return text


def recipe(name: str, root: Path = Path(".")) -> dict[str, dict[str, Any]]:
    """A preset's whole recipe, as params.yaml would hold it after `make preset P=<name>`."""
    return yaml.safe_load(build(default_text(root), name, root))


def _check(text: str, default: str, changes: dict, source: Path) -> None:
    """The built file must load as the default with the changes applied, and pass the loader."""
    built, expected = yaml.safe_load(text), yaml.safe_load(default)
    for section, keys in changes.items():
        expected[section].update(keys)
    if built != expected:  # a preset line that is not one `key: value` line
        raise ConfigError(f"{source}: its lines do not rebuild params.yaml (each key: one `key: value` line)")
    params_from_dict(built, source=str(source))


def _header(text: str) -> list[str]:
    return [line for line in _lines_before_first_section(text) if line.startswith("#")]


def _body(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if SECTION.match(line))
    return lines[start:]


def _lines_before_first_section(text: str) -> list[str]:
    lines = text.splitlines()
    return lines[: next((i for i, line in enumerate(lines) if SECTION.match(line)), len(lines))]


def _key_lines(text: str) -> dict[tuple[str, str], str]:
    found, section = {}, None
    for line in text.splitlines():
        if match := SECTION.match(line):
            section = match.group(1)
        elif match := KEY.match(line):
            found[section, match.group(1)] = line
    return found


def current(text: str) -> str:
    """The preset a params.yaml text was built from: its mark, else the default."""
    first = text.split("\n", 1)[0]
    return first[len(MARK) :].split(" ", 1)[0] if first.startswith(MARK) else DEFAULT


def default_text(root: Path = Path(".")) -> str:
    """The default recipe: params.yaml where it carries no preset mark, else git's HEAD copy."""
    text = (root / "params.yaml").read_text(encoding="utf-8")
    if not text.startswith(MARK):
        return text
    try:
        head = subprocess.run(
            ["git", "show", "HEAD:params.yaml"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        raise ConfigError(
            f"params.yaml was built from preset '{current(text)}' and git has no default params.yaml "
            f"at HEAD to build another from"
        ) from None
    if head.startswith(MARK):
        raise ConfigError(
            f"params.yaml at git's HEAD is preset '{current(head)}', not the default: "
            f"check out a commit whose params.yaml is the default recipe"
        )
    return head


def record_files(root: Path = Path(".")) -> list[Path]:
    """What a run of this recipe leaves outside DVC's cache, relative to root: dvc.lock and the
    uncached outputs (metrics, plots, reports) except the persistent ones, which hold every
    recipe's part (reports/reproduction.md)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        outs = [o for stage in repo.index.stages for o in stage.outs if not o.use_cache and not o.persist]
        files = [Path(o.fs_path).relative_to(root.resolve()) for o in outs]
    return [Path("dvc.lock"), *sorted(files)]


def switch(name: str, root: Path = Path("."), force: bool = False) -> list[str]:
    """Writes params.yaml for preset `name` and swaps the run records; returns what it did, a line each."""
    root = root.resolve()
    text = (root / "params.yaml").read_text(encoding="utf-8")
    default = default_text(root)
    leaving = current(text)
    if not force and text != build(default, leaving, root):
        raise ConfigError(
            f"params.yaml has changes that preset '{leaving}' does not make (edited, or set by "
            f"`dvc exp run -S`): commit or revert them first, or rerun with FORCE=1 to drop them"
        )
    new = build(default, name, root)
    done = []
    if name != leaving:
        done += _swap(leaving, name, root)
    write_text(root / "params.yaml", new)
    done.append(f"params.yaml: preset {name}" + (" (the default)" if name == DEFAULT else ""))
    return done


def _swap(leaving: str, name: str, root: Path) -> list[str]:
    """Moves the records of the recipe being left under params/runs/<leaving>/ (replacing what
    an earlier switch kept there) and brings back those of `name`, where it has any."""
    done = []
    files = [f for f in record_files(root) if (root / f).exists()]
    if files:
        kept = root / RUNS / leaving
        staging = kept.with_name(f".{leaving}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        for f in files:
            (staging / f).parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (root / f).is_dir() else shutil.copy2)(root / f, staging / f)
        shutil.rmtree(kept, ignore_errors=True)  # an older record of the same recipe: this one is newer
        staging.rename(kept)
        for f in files:
            (shutil.rmtree if (root / f).is_dir() else Path.unlink)(root / f)
        done.append(f"kept {leaving}'s run record ({len(files)} files and directories) in {RUNS / leaving}")
    back = root / RUNS / name
    if back.is_dir():
        for f in sorted(back.rglob("*")):
            if f.is_file():
                target = root / f.relative_to(back)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
        done.append(f"brought back {name}'s run record from {RUNS / name}")
    return done


@click.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Drop changes params.yaml has beyond its preset.")
def main(name: str, force: bool) -> None:
    """Switch params.yaml to preset NAME (a file in params/)."""
    try:
        for line in switch(name, force=force):
            click.echo(line)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
