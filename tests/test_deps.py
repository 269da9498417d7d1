"""dvc.yaml lists, as each stage's deps, exactly the project files its script imports (transitively),
so editing any of them reruns the stage and nothing else does."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "transformer"


def imported_modules(path: Path) -> set[str]:
    """Every project module a file imports, at any depth of its code (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from transformer import checkpoints`
    return {m for m in found if m.split(".")[0] == PACKAGE and _file(m).exists()}


def _file(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def import_closure(script: Path) -> set[str]:
    """The project files (relative paths) that running `script` can import."""
    todo, seen = [script], set()
    while todo:
        path = todo.pop()
        for module in imported_modules(path):
            if module not in seen:
                seen.add(module)
                todo.append(_file(module))
    files = {_file(m).relative_to(ROOT).as_posix() for m in seen}
    return {f for f in files if not f.endswith("/__init__.py")}  # package markers: no behaviour to invalidate


def test_every_subpackage_marker_holds_only_its_docstring():
    """What lets import_closure leave the markers out: importing one runs nothing."""
    for marker in sorted(ROOT.joinpath(PACKAGE).glob("*/__init__.py")):
        body = ast.parse(marker.read_text(encoding="utf-8")).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{marker.relative_to(ROOT)} runs code"


def stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


def script_and_deps(stage: dict) -> tuple[str, set[str]]:
    stage = stage.get("do", stage)  # foreach stages keep their body under `do`
    script = re.search(r"stages/\w+\.py", stage["cmd"]).group(0)
    deps = {d for d in stage["deps"] if d.endswith(".py")}
    return script, deps


@pytest.mark.parametrize("name", sorted(stages()))
def test_stage_deps_are_its_scripts_import_closure(name):
    script, deps = script_and_deps(stages()[name])
    closure = import_closure(ROOT / script) | {script}
    missing, extra = sorted(closure - deps), sorted(deps - closure)
    assert not missing, f"dvc.yaml stage '{name}' imports but does not list as deps: {', '.join(missing)}"
    assert not extra, f"dvc.yaml stage '{name}' lists deps its script never imports: {', '.join(extra)}"


def test_no_stage_imports_the_user_command():
    for name, stage in stages().items():
        script, _ = script_and_deps(stage)
        assert f"{PACKAGE}/cli.py" not in import_closure(ROOT / script), f"stage '{name}' imports transformer/cli.py"


def test_closure_follows_function_level_and_from_package_imports(tmp_path):
    script = ROOT / "stages" / "average_checkpoints.py"
    closure = import_closure(script)
    assert "transformer/checkpoints.py" in closure  # `from transformer import checkpoints`
    assert "transformer/stage.py" in closure and "transformer/errors.py" in closure  # through stage.py
    assert "transformer/training/train.py" not in closure


def _placeholders(repo: Path) -> None:
    """Every stage's outputs and inputs as small files, so `dvc commit` can record the pipeline as
    run without running it: what `dvc status` then says depends on the deps alone."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        outs = [Path(str(o)) for s in dvc.index.stages for o in s.outs]
        deps = [Path(str(d)) for s in dvc.index.stages for d in s.deps]
    for path in outs:
        target = repo / path if path.suffix else repo / path / "placeholder"  # a directory output holds one file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    for path in deps:
        if not (repo / path).exists():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).touch()


def _changed_stages(repo: Path) -> set[str]:
    from conftest import BIN, run

    status = json.loads(run([str(BIN / "dvc"), "status", "--json"], repo).stdout or "{}")
    return {name.split(":")[-1] for name in status}


def _importers(module: str, testsets: list[str]) -> set[str]:
    """The stages whose scripts import `module`, by their import closure (decode once per test set)."""
    names = set()
    for name, stage in stages().items():
        script, _ = script_and_deps(stage)
        if module in import_closure(ROOT / script) | {script}:
            names.update([f"{name}@{t}" for t in testsets] if "foreach" in stage else [name])
    return names


@pytest.mark.slow
def test_editing_a_module_changes_exactly_the_stages_that_import_it(tmp_path):
    from conftest import BIN, project_copy, run, tiny_params

    params = tiny_params()
    testsets = params["decode"]["testsets"]
    repo = project_copy(tmp_path, params)
    _placeholders(repo)
    run([str(BIN / "dvc"), "commit", "--force", "--quiet"], repo)
    assert _changed_stages(repo) == set()
    modules = [
        "transformer/checkpoints.py",
        "transformer/data/download.py",
        "transformer/model/model.py",
        "transformer/errors.py",
    ]
    for module in modules:
        path = repo / module
        original = path.read_text(encoding="utf-8")
        path.write_text(original + "\n# an edit\n", encoding="utf-8")
        changed = _changed_stages(repo)
        path.write_text(original, encoding="utf-8")
        assert changed == _importers(module, testsets), f"editing {module}"
    assert _importers("transformer/data/download.py", testsets) == {"download"}
    downstream = {"average_checkpoints", *(f"decode@{t}" for t in testsets), "score", "figures", "report"}
    assert downstream <= _importers("transformer/checkpoints.py", testsets)


def test_train_stage_params_hold_the_checkpoint_identitys_sections():
    """A change DVC does not rerun train for must not be one that makes a resumed run start afresh."""
    from transformer.config import TRAIN_SECTIONS

    declared = {p.split(".")[0] for p in stages()["train"]["params"] if isinstance(p, str)}
    assert set(TRAIN_SECTIONS) <= declared, f"train's params lack {sorted(set(TRAIN_SECTIONS) - declared)}"
