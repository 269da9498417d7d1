"""Every shell command in the README and docs/ names real things: Makefile targets and presets,
DVC stages, subcommands and options, params keys, and our scripts' and CLI's options. The
commands themselves run elsewhere in the suite (`dvc repro`, experiments, translate, serve)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
import tomllib
from pathlib import Path

import click
import pytest
import yaml
from conftest import ROOT

from transformer import presets

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_TOOLS = {
    ".",
    "source",
    "echo",
    "curl",
    "git",
    "cd",
    "cat",
    "ls",
    "head",
    "tail",
    "export",
    "pip",
    "sha256sum",
    "mkdir",
    "cp",
    "rm",
}
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
STAGES = set(yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"])


def shell_commands(page: Path) -> list[str]:
    """The commands of a page's ```sh blocks: continuation lines joined, comments and blank lines dropped."""
    text = page.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def simple_commands(line: str) -> list[list[str]]:
    """A command line's simple commands (split at |, &&, ;), each without its leading
    VAR=value assignments and its redirections."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts, current, skip = [], [], False
    for token in lexer:
        if token in ("|", "&&", ";", "||"):
            parts.append(current)
            current = []
        elif token in (">", ">>", "<", "2>"):
            skip = True
        elif skip:
            skip = False
        elif not current and re.fullmatch(r"[A-Z_]+=.*", token):
            continue
        else:
            current.append(token)
    return [p for p in parts + [current] if p]


def _click_options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)}


def _script_command(path: Path) -> click.Command:
    spec = importlib.util.spec_from_file_location(f"_doc_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (command,) = {v for v in vars(module).values() if isinstance(v, click.Command)}
    return command


def _check_options(what: str, args: list[str], known: set[str]) -> None:
    used = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    assert used <= known, f"{what}: no option {sorted(used - known)}"


def _check_param(assignment: str) -> None:
    key = assignment.split("=", 1)[0].split(":")[-1]
    section, _, name = key.partition(".")
    assert name in PARAMS.get(section, {}), f"no param {key}"


def _check_python(code: str) -> None:
    """Code that compiles and imports only what the package has."""
    import ast

    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "transformer":
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            assert not missing, f"{node.module} has no {missing}"


def check(argv: list[str]) -> None:
    program = Path(argv[0]).name or argv[0]
    if program == "make":
        makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
        for arg in argv[1:]:
            if arg.startswith("P="):
                assert arg[2:] in presets.names(ROOT), f"no preset {arg[2:]}"
            elif "=" not in arg:
                assert re.search(rf"^{re.escape(arg)}:", makefile, flags=re.M), f"no make target {arg}"
    elif program == "dvc":
        from dvc.cli import DvcParserError
        from dvc.cli.parser import get_main_parser

        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                args = get_main_parser().parse_args(argv[1:])
        except (SystemExit, DvcParserError):
            pytest.fail(f"dvc does not take: {shlex.join(argv)}")
        for assignment in getattr(args, "set_param", None) or []:
            _check_param(assignment)
        if args.func.__name__ in ("CmdRepro", "CmdExperimentsRun"):
            unknown = {t.split("@")[0] for t in args.targets} - STAGES
            assert not unknown, f"no stage {sorted(unknown)}"
    elif program == "transformer":
        from transformer.cli import main

        assert argv[1] in main.commands, f"transformer has no command {argv[1]}"
        _check_options(f"transformer {argv[1]}", argv[2:], _click_options(main.commands[argv[1]]))
    elif program == "mlflow":
        from mlflow.cli import cli

        group, rest = cli, argv[1:]
        while isinstance(group, click.Group):
            assert rest and rest[0] in group.commands, f"mlflow has no command {shlex.join(argv[:3])}"
            group, rest = group.commands[rest[0]], rest[1:]
        _check_options("mlflow", rest, _click_options(group))
    elif program in ("python", "torchrun"):
        scripts = [a for a in argv if a.endswith(".py")]
        if argv[1:3] == ["-m", "pytest"] or "pytest" in argv:
            return
        if argv[1:2] == ["-c"]:
            _check_python(argv[2])
            return
        if argv[1:2] == ["-m"]:
            assert importlib.util.find_spec(argv[2]), f"no module {argv[2]}"
            if argv[2].startswith("bench."):  # our scripts, run as modules: their options too
                _check_options(argv[2], argv[3:], _click_options(importlib.import_module(argv[2]).main))
            return
        (script,) = scripts
        assert (ROOT / script).is_file(), f"no script {script}"
        if script.startswith("stages/"):
            after = argv[argv.index(script) + 1 :]
            _check_options(script, after, _click_options(_script_command(ROOT / script)))
    else:
        assert program in SHELL_TOOLS, f"a command of an unknown program: {shlex.join(argv)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shell_command_names_real_targets_stages_options_and_params(page):
    commands = shell_commands(page)
    for line in commands:
        for argv in simple_commands(line):
            try:
                check(argv)
            except AssertionError as e:
                raise AssertionError(f"{page.name}: `{line}`: {e}") from None


def test_the_checker_catches_what_it_is_for():
    for bad in (
        "make reprod",
        "make preset P=multi30k_en_dee",
        "dvc exp run -S train.warmpu=4000",
        "dvc repro trian",
        "dvc exp show --only-changd",
        ".venv/bin/transformer translate --modle m.pt",
        "python stages/train.py --vocab data/vocab --referencess x",
        "dcv repro",
        "python -c 'from transformer.training.train import no_such_helper'",
        "python -m bench.bench --quik",
        "python -m bench.no_such_script",
    ):
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            for argv in simple_commands(bad):
                check(argv)


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.splitlines()
    assert len(lines) <= 300
    assert any("make repro" in line for line in lines[:40]) and any("make test" in line for line in lines[:40])
    outside = readme.split("<!-- results -->")[0] + readme.split("<!-- /results -->")[1]
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", outside), "a date outside the results block"
    assert not re.search(r"\b[0-9a-f]{7,40}\b", outside), "a commit hash outside the results block"
    assert not re.search(r"GFLOP", outside), "a bench peak outside the results block"
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README links no {page.name}"


DATE = r"\b20\d\d-\d\d-\d\d\b"
COMMIT = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"  # hex with a letter and a digit
ISSUE = r"(?<![\w/&])#\d+\b"
HOST_TABLE = ("<!-- host classes -->", "<!-- /host classes -->")  # speed.md's: a class's bench peaks


def docs_page_problems(text: str) -> list[str]:
    """What a page of docs/ must not hold: dates (but for the experiments table's date column), commit
    ids, issue numbers, and bench peaks outside speed.md's table of host classes."""
    if HOST_TABLE[0] in text:
        text = text.split(HOST_TABLE[0])[0] + text.split(HOST_TABLE[1])[1]
    text = re.sub(rf"^\| {DATE}[^|]*\|", "|", text, flags=re.M)  # the experiments table's date column
    text = re.sub(r"/blob/[0-9a-f]{40}/", "/blob/", text)  # a source link's address pins the lines it shows
    checks = {"a date": DATE, "a commit id": COMMIT, "an issue number": ISSUE, "a bench peak": r"GFLOP"}
    return [f"{what}: {m[0]!r}" for what, pattern in checks.items() for m in [re.search(pattern, text)] if m]


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_docs_page_names_no_date_commit_issue_or_bench_peak_outside_the_host_table(page):
    assert docs_page_problems(page.read_text(encoding="utf-8")) == [], page.name


def test_the_docs_rule_catches_what_it_is_for():
    assert docs_page_problems("| 2026-11-21 | a trial | kept |\n") == []  # the experiments table's date column
    assert docs_page_problems("1000001 characters; a 0.80 fill") == []
    assert docs_page_problems(f"[`a.py`, lines 1–2](https://github.com/o/r/blob/{'ab12' * 10}/a.py#L1-L2)") == []
    for bad in ("measured on 2026-11-21", "the code at 6c41217", "after #81's work", "peaks 333 GFLOP/s"):
        assert docs_page_problems(bad), bad
    assert docs_page_problems("<!-- host classes -->\n| x | 333 GFLOP/s |\n<!-- /host classes -->\n") == []


EXPERIMENTS_HEADER = "| recipe of | trial | recipe | seeds | Δ val BLEU | kept |"
UNDATED_GROUP = "## Trials whose date was not recorded"
UNDATED_HEADER = "| trial | recipe | seeds | Δ val BLEU | kept |"  # EXPERIMENTS_HEADER less the date


def experiments_problems(text: str) -> list[str]:
    """What the experiments page's tables must keep: every table under a heading of its group; in a dated
    group the one header and a date (YYYY-MM-DD) in every row's first cell, oldest first; the trials whose
    date was not recorded apart, under UNDATED_GROUP, in tables without the date column."""
    problems, group, heading, header, last = [], None, None, None, ""
    for line in text.splitlines():
        if line.startswith(("## ", "### ")):
            group = line if line.startswith("## ") else group
            heading, header, last = line, None, ""
        elif not line.startswith("|"):
            header = None  # a table ends at its first line that is not a row
        elif header is None:
            header = line
            expected = UNDATED_HEADER if group == UNDATED_GROUP else EXPERIMENTS_HEADER
            if line != expected:
                problems.append(f"{heading}: another header: {line}")
            if heading is None:
                problems.append("a table under no group's heading")
        elif not line.startswith("|---"):
            first = line.split("|")[1].strip()
            if header == UNDATED_HEADER:
                if re.search(DATE, first):
                    problems.append(f"a dated trial among those whose date was not recorded: {line}")
            elif not re.fullmatch(r"20\d\d-\d\d-\d\d", first):
                problems.append(f"{heading}: a date cell that is not a date: {first!r}")
            elif first < last:
                problems.append(f"{heading}: {first} after {last}")
            else:
                last = first
    return problems


def test_the_experiments_are_grouped_under_headings_with_one_date_format_oldest_first():
    text = (ROOT / "docs" / "experiments.md").read_text(encoding="utf-8")
    assert text.count(EXPERIMENTS_HEADER) >= 2, "the experiments are not grouped into tables"
    assert experiments_problems(text) == []


def test_the_experiments_rule_catches_what_it_is_for():
    table = f"## A group\n\n{EXPERIMENTS_HEADER}\n|---|---|---|---|---|---|\n"
    apart = f"{UNDATED_GROUP}\n\n### A group\n\n{UNDATED_HEADER}\n|---|---|---|---|---|\n"
    good = table + "| 2026-11-21 | a | b | 1 | +0.1 | kept |\n\n" + apart + "| c | d | 1 | 0 | kept |\n"
    assert experiments_problems(good) == []
    for bad in (
        table + "| 2026-11-22 | a | b | 1 | +0.1 | kept |\n| 2026-11-21 | c | d | 1 | 0 | kept |\n",
        table + "| 2026-11-22 morning | a | b | 1 | +0.1 | kept |\n",
        table + "|  | a | b | 1 | +0.1 | kept |\n",
        table + "| undated | a | b | 1 | +0.1 | kept |\n",
        f"{EXPERIMENTS_HEADER}\n| 2026-11-21 | a | b | 1 | +0.1 | kept |\n",
        f"## A group\n\n{UNDATED_HEADER}\n| c | d | 1 | 0 | kept |\n",
        apart + "| 2026-11-21 a | d | 1 | 0 | kept |\n",
        f"{UNDATED_GROUP}\n\n{EXPERIMENTS_HEADER}\n| 2026-11-21 | a | b | 1 | +0.1 | kept |\n",
    ):
        assert experiments_problems(bad), bad


@pytest.mark.slow
def test_the_multi_node_commands_of_the_scale_page_train_two_nodes_on_loopback(tmp_path):
    """docs/scale.md's commands for node 0 and node 1, with node0 and its port made local: two
    directories that share no disk, node 0 under DVC, node 1 running the stage's command."""
    import shutil
    import subprocess

    from conftest import BIN, free_port, project_copy, run, tiny_params, tool_env

    lines = shell_commands(ROOT / "docs" / "scale.md")
    port = str(free_port())

    def local(prefix: str) -> tuple[dict[str, str], list[str]]:
        (line,) = [line for line in lines if line.startswith(prefix)]
        words = shlex.split(line.replace("node0", "127.0.0.1").replace("29500", port))
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
        argv = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
        return env, [str(BIN / argv[0]), *argv[1:]]

    (tmp_path / "node0").mkdir()
    repo = project_copy(tmp_path / "node0", tiny_params(**{"train.nnodes": 2, "train.epochs": 1}))
    run([str(BIN / "dvc"), "repro", "build_vocab"], repo)
    other = tmp_path / "node1"
    for name in ("stages", "transformer", "data/vocab", "data/tokenized"):
        shutil.copytree(repo / name, other / name)
    shutil.copy(repo / "params.yaml", other / "params.yaml")
    (env1, argv1), (env0, argv0) = local("PET_NODE_RANK=1"), local("PET_NODE_RANK=0")
    node1 = subprocess.Popen(argv1, cwd=other, env=tool_env(**env1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        run(argv0, repo, env=env0, timeout=600)
        out, _ = node1.communicate(timeout=300)
    finally:
        node1.kill()
    assert node1.returncode == 0, out.decode()[-3000:]
    assert json.loads((repo / "reports/train/train.json").read_text())["steps"] > 0
    assert not (other / "data/checkpoints").exists()  # rank 0 alone writes


def test_the_pages_give_the_committed_runs_time_and_memory():
    """The time and memory the pages give are the committed reference run's: its pipeline wall time, from
    the report's section of the default recipe, and its training's peak, from reports/train/train.json."""
    from transformer.config import load_params
    from transformer.evaluation.report import key

    section = (
        (ROOT / "reports/reproduction.md")
        .read_text(encoding="utf-8")
        .split(f"<!-- begin {key(load_params(ROOT / 'params.yaml'))} -->")[1]
    )
    minutes = round(float(re.search(r"\| \*\*total\*\* \| \*\*([\d.]+) min\*\* \|", section)[1]))
    peak = json.loads((ROOT / "reports/train/train.json").read_text(encoding="utf-8"))["peak_rss_mb"]["rank_0"]
    said = f"in about {minutes} minutes, its training in {peak / 1024:.1f} GiB of memory"
    for page in (ROOT / "README.md", ROOT / "docs/index.md"):
        assert said in re.sub(r"\s+", " ", page.read_text(encoding="utf-8")), (page.name, said)


def test_the_licence_the_citation_and_the_changelog_name_one_licence_and_one_version():
    """A company reads the licence in pyproject's metadata, a citer the version in CITATION.cff, a user the
    changelog: each must say what the others do."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert project["license"] == citation["license"] == "Apache-2.0"
    assert "Apache License\n" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert citation["version"] == project["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"\n## {project['version']}" in changelog and "\n## Unreleased" in changelog
