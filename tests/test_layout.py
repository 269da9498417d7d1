"""The package reads in small pieces: what a reader meets in transformer/ is held to the sizes that keep it readable."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUNCTION_LINES = 50
CLASS_LINES = 150
POSITIONAL = 6


def _nodes():
    for path in sorted((ROOT / "transformer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            yield path.relative_to(ROOT).as_posix(), node


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{path}:{node.lineno} {node.name} ({_lines(node)} lines)"
        for path, node in _nodes()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _lines(node) > FUNCTION_LINES
    ]
    assert not long, long


def test_no_class_is_longer_than_a_few_screens():
    long = [
        f"{path}:{node.lineno} {node.name} ({_lines(node)} lines)"
        for path, node in _nodes()
        if isinstance(node, ast.ClassDef) and _lines(node) > CLASS_LINES
    ]
    assert not long, long


def test_no_call_passes_more_than_six_arguments_by_position():
    many = [
        f"{path}:{node.lineno} {ast.unparse(node.func)} ({len(node.args)} positional)"
        for path, node in _nodes()
        if isinstance(node, ast.Call) and len(node.args) > POSITIONAL
    ]
    assert not many, many


def test_the_package_has_a_folder_a_part_and_few_entries_at_the_top():
    top = sorted(p.name for p in (ROOT / "transformer").iterdir() if p.name != "__pycache__")
    for part in ("data", "model", "kernels", "training", "decoding", "evaluation", "serving"):
        assert (ROOT / "transformer" / part / "__init__.py").exists(), part
    assert len(top) <= 18, top
