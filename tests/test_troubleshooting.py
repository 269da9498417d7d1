"""docs/troubleshooting.md has an entry for every message the project raises at a user, and names
every error class.

A message is found where it is raised: each `raise SomeError(...)` under transformer/ and stages/
whose message, its first argument written as a string (a str, an f-string, or a `+` of them), is
read from the code. Its leading fixed text is the message from its first letter (past the file or
key it opens with) to the first clause end (": ", "; ", ". ", " (") that leaves three words or
more, with each placeholder standing for any text: `{path}: checkpoint not found` gives
"checkpoint not found", `loss is {loss} at step {step} (epoch ...` gives "loss is <...> at step".
The page has an entry for the message when one of its code spans holds that text.

Not messages for a user, so left out:

- a bare `raise`, or `raise <name>`: a re-raise, whose message is the error's own;
- Python's programming errors (PROGRAMMING_ERRORS): a caller's bug, not a user's input;
- a message not written at its raise (`raise ValueError(why)`): it is built elsewhere, and the page
  lists it by hand;
- a message with no word of its own (`f"{source}, {target}: {e}"`): a frame around another
  message, which has its own entry.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from conftest import ROOT

from transformer.errors import ERRORS

PAGE = ROOT / "docs" / "troubleshooting.md"
SOURCES = ("transformer", "stages")
PROGRAMMING_ERRORS = {"AssertionError", "AttributeError", "NotImplementedError", "TypeError"}
HOLE = "\0"  # a placeholder's value, in a message's template
CLAUSE_END = re.compile(r"[:;.](?=\s)|\s\(")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # `x`, or ``x`` around a backtick
WORDS = 3


@dataclass(frozen=True)
class Raised:
    """A message raised at a user: where, by which class, and its leading fixed text."""

    where: str  # file:line
    error: str  # the class's name
    text: str  # the leading fixed text, HOLE for each placeholder

    def shown(self) -> str:
        return self.text.replace(HOLE, "<...>")


def template(node: ast.expr) -> str | None:
    """The message a str, an f-string or a `+` of them writes, HOLE for each value put in; None for
    any other expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = template(node.left), template(node.right)
        if left is not None or right is not None:
            return (left or HOLE) + (right or HOLE)
    return None


def _words(text: str) -> int:
    return len(re.findall(r"[A-Za-z]{2,}", text))


def leading_text(message: str) -> str | None:
    """From the first letter to the first clause end that leaves WORDS words or more (else the
    whole), less the placeholders and separators it ends with; None where no word is written."""
    text = re.sub(r"\s+", " ", message)
    start = re.search(r"[A-Za-z]", text)
    if start is None:
        return None
    text = text[start.start() :]
    cut = next((m.start() for m in CLAUSE_END.finditer(text) if _words(text[: m.start()]) >= WORDS), len(text))
    return text[:cut].rstrip(f" {HOLE}:;,.'\"(")


def _error_name(call: ast.Call) -> str:
    """The class a call makes: `DataError(...)`, `click.BadParameter(...)` and
    `MlflowException.invalid_parameter_value(...)` give DataError, BadParameter and MlflowException."""
    names = ast.unparse(call.func).split(".")
    return next((n for n in reversed(names) if n[:1].isupper()), names[-1])


def raised(source: str, name: str) -> list[Raised]:
    """The user messages a module raises, by the rule in this file's docstring."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
            continue
        error = _error_name(node.exc)
        if error in PROGRAMMING_ERRORS:
            continue
        message = next((t for t in map(template, node.exc.args) if t is not None), None)
        text = leading_text(message) if message is not None else None
        if text:
            found.append((node.lineno, Raised(f"{name}:{node.lineno}", error, text)))
    return [r for _, r in sorted(found, key=lambda pair: pair[0])]


def project_raised() -> list[Raised]:
    """The user messages of every module under SOURCES."""
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += raised(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    return found


def code_spans(markdown: str) -> list[str]:
    """The text of a page's code spans, each run of whitespace made one space (a span may wrap)."""
    return [re.sub(r"\s+", " ", m[2].strip()) for m in CODE_SPAN.finditer(markdown)]


def missing(found: list[Raised], spans: list[str]) -> list[str]:
    """`file:line: Error: text` of each message whose leading fixed text no code span holds."""
    out = []
    for r in found:
        pattern = re.compile(".*?".join(map(re.escape, r.text.split(HOLE))))
        if not any(pattern.search(span) for span in spans):
            out.append(f"{r.where}: {r.error}: {r.shown()}")
    return out


def test_every_message_the_project_raises_has_an_entry():
    found = project_raised()
    assert len(found) > 100  # the walk finds the project's raises
    gaps = missing(found, code_spans(PAGE.read_text(encoding="utf-8")))
    assert not gaps, "docs/troubleshooting.md has no entry for:\n" + "\n".join(gaps)


def test_every_error_class_is_on_the_page():
    spans = code_spans(PAGE.read_text(encoding="utf-8"))
    classes = {e.__name__ for e in ERRORS} | {r.error for r in project_raised()}
    absent = sorted(c for c in classes if not any(re.search(rf"\b{c}\b", span) for span in spans))
    assert not absent, f"docs/troubleshooting.md names no {absent}"


def test_the_rule_catches_what_it_is_for():
    source = """
def load(path, e, why):
    raise DataError(f"{path}: checkpoint not found")
    raise DataError(f"{path}: checkpoint is empty")
    raise TrainingError(f"loss is {e} at step {why} (epoch 1); stopped")
    raise ConfigError("a " + f"{path} message in parts")
    raise NotImplementedError("a subclass defines it")
    raise
    raise e
    raise ValueError(why)
    raise DataError(f"{path}, {why}: {e}")
"""
    found = raised(source, "m.py")
    assert [(r.where, r.error, r.shown()) for r in found] == [
        ("m.py:3", "DataError", "checkpoint not found"),
        ("m.py:4", "DataError", "checkpoint is empty"),
        ("m.py:5", "TrainingError", "loss is <...> at step"),
        ("m.py:6", "ConfigError", "a <...> message in parts"),
    ]
    page = "- `<file>: checkpoint not found`: a cause.\n- ``loss is nan at step 7 (epoch 1)``, `a x message in parts`\n"
    assert missing(found, code_spans(page)) == ["m.py:4: DataError: checkpoint is empty"]
