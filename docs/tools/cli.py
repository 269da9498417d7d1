"""The command reference (the site's cli.md), written from the click commands when the site is built,
so that it cannot drift from them: every `transformer` command and every pipeline stage script, each
with its usage line and every option and argument as its `--help` states them (docs/tools/hooks.py)."""

from __future__ import annotations

import html
import importlib.util
import inspect
import sys
from pathlib import Path

import click

STAGES = Path("stages")  # from the repository root, mkdocs.yml's folder
INTRO = """# Command reference

Every command the project installs and every stage script the pipeline runs, with every option, as
`--help` prints them; this page is written from the commands themselves each time the site is built.

- [`transformer`](#transformer): what you run on a trained model: translate, score, compare, export, promote, and
  the verdict on a run. Installed with the project (`pip install -e .`).
- [Pipeline stages](#pipeline-stages): the scripts `dvc repro` runs, one a stage (dvc.yaml gives each its paths;
  its hyperparameters come from params.yaml). Run one by hand as `python stages/<name>.py`.
"""


def page(root: Path = Path(".")) -> str:
    """The page's Markdown: the `transformer` group's commands in name order, then the stages'."""
    from transformer.cli import main

    parts = [INTRO, "## `transformer`\n", _help_text(main), ""]
    with click.Context(main, info_name="transformer") as group:
        for name in main.list_commands(group):
            parts += _command(main.get_command(group, name), f"transformer {name}", group)
    parts += ["## Pipeline stages\n", "In the order the pipeline runs them.\n"]
    for name in _pipeline_order(root):
        parts += _command(_stage_command(root / STAGES / f"{name}.py"), f"python stages/{name}.py", None)
    return "\n".join(parts)


def _command(command: click.Command, path: str, parent: click.Context | None) -> list[str]:
    with click.Context(command, info_name=path.rsplit(" ", 1)[-1], parent=parent) as ctx:
        usage = f"{path} {' '.join(command.collect_usage_pieces(ctx))}"
        lines = [f"### `{path}`\n", _help_text(command), "", f"```\n{usage}\n```\n"]
        # Arguments have no help of their own in click: the usage line names them and the text describes them.
        lines += [_option(param, ctx) for param in command.params if isinstance(param, click.Option)]
    return [*lines, ""]


def _option(option: click.Option, ctx: click.Context) -> str:
    """An option as a list item: its flags and value type in code, then its help as `--help` prints it."""
    flags, help_text = option.get_help_record(ctx)
    return f"- `{flags}`" + (f": {html.escape(help_text, quote=False)}" if help_text else "")


def _help_text(command: click.Command) -> str:
    """A command's help as Markdown text: click's no-rewrap marks dropped, `<name>` kept visible. A stage
    script's command has none of its own: its module's docstring says what the stage does."""
    text = command.help or sys.modules[command.callback.__module__].__doc__ or ""
    return html.escape(inspect.cleandoc(text).replace("\b\n", ""), quote=False)


def _pipeline_order(root: Path) -> list[str]:
    """The stage scripts in dvc.yaml's order, each once (decode runs once a test set)."""
    import yaml

    stages = yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    commands = [stage["do"]["cmd"] if "do" in stage else stage["cmd"] for stage in stages.values()]
    scripts = [word for cmd in commands for word in cmd.split() if word.startswith("stages/")]
    return list(dict.fromkeys(Path(script).stem for script in scripts))


def _stage_command(script: Path) -> click.Command:
    spec = importlib.util.spec_from_file_location(f"stages.{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.main
