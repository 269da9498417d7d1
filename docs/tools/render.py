"""Runs a percent-format script (`# %%` code cells, `# %% [markdown]` text cells) top to bottom and
writes it as a Markdown page: each cell's code, what it printed, and the figures it drew as PNGs. A
code cell marked `# %% [folded] TITLE` shows its code folded under TITLE, for code beside the point
of the page (drawing a diagram), which a reader opens only if curious.
A printout of a repository file's lines under the header `# FILE, lines A-B` (the page's `show`) is
written as that file's source: a link to those lines on the repository (mkdocs.yml's `repo_url`)
above them as Python. The link names the last commit that changed the file, so it shows these lines
however the file changes later; a shown file must therefore be committed before the page is rendered.

    python docs/tools/render.py                      # docs/annotated.py -> docs/annotated.md, docs/annotated/
    python docs/tools/render.py --out /tmp/page.md   # the same run, written elsewhere

Cells run in one namespace from the repository root, as `python docs/annotated.py` would run them;
a cell that raises stops the run with the cell's number and a non-zero exit."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = re.compile(r"^# %%(.*)$")
LISTING = re.compile(r"^# (?P<path>(?:[\w-]+/)*[\w-]+\.py), lines (?P<first>\d+)-(?P<last>\d+)$")


@dataclass(frozen=True)
class Cell:
    kind: str  # "code" or "markdown"
    text: str
    folded: str = ""  # a code cell's title, when its code is shown folded under it


def cells(source: str) -> list[Cell]:
    """The cells of a percent-format script; text before the first marker is dropped (a module docstring)."""
    found: list[Cell] = []
    kind, folded, lines = None, "", []
    for line in [*source.splitlines(), "# %% end"]:
        header = HEADER.match(line)
        if not header:
            lines.append(line)
            continue
        if kind is not None:
            body = "\n".join(lines).strip("\n")
            if kind == "markdown":
                body = "\n".join(re.sub(r"^# ?", "", x) for x in body.splitlines())
            if body.strip():
                found.append(Cell(kind, body, folded))
        kind, lines = ("markdown" if "[markdown]" in header.group(1) else "code"), []
        folded = header.group(1).partition("[folded]")[2].strip()
    return found


class CellError(RuntimeError):
    pass


def run(source: Path, out: Path) -> int:
    """Runs `source` and writes `out` with the figures in a folder named after it; returns the figures written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = out.parent / out.stem
    figures.mkdir(parents=True, exist_ok=True)
    for old in figures.glob("*.png"):
        old.unlink()
    namespace = {"__name__": "__main__", "__file__": str(source)}
    repository = f"{_repo_url()}/blob"
    page = [f"<!-- Written by docs/tools/render.py from {_shown(source)}: edit that file, not this one. -->", ""]
    drawn = 0
    for n, cell in enumerate(cells(source.read_text()), 1):
        if cell.kind == "markdown":
            page += [cell.text, ""]
            continue
        if cell.folded:  # Material's collapsed admonition (pymdownx.details), its body indented
            code = "\n".join(f"    {line}".rstrip() for line in ["```python", *cell.text.splitlines(), "```"])
            page += [f'??? note "{cell.folded}"', "", code, ""]
        else:
            page += ["```python", cell.text, "```", ""]
        printed = _execute(cell.text, n, source, namespace)
        try:
            page += _printout(printed, repository)
        except ValueError as e:
            raise CellError(f"{_shown(source)}: cell {n} printed {e}") from e
        for number in plt.get_fignums():
            drawn += 1
            name, figure = f"{figures.name}/figure-{drawn}.png", plt.figure(number)
            figure.savefig(out.parent / name, dpi=96, bbox_inches="tight", metadata={"Software": None})
            titles = "; ".join(ax.get_title() for ax in figure.axes if ax.get_title())
            page += [f"![Figure {drawn}: {titles}]({name})", ""]
        plt.close("all")
    out.write_text("\n".join(page).rstrip("\n") + "\n")
    return drawn


def _execute(code: str, n: int, source: Path, namespace: dict) -> str:
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, f"{source.name}, cell {n}", "exec"), namespace)
    except Exception as e:
        raise CellError(f"{_shown(source)}: cell {n} failed:\n{traceback.format_exc()}") from e
    return buffer.getvalue()


def _printout(printed: str, repository: str) -> list[str]:
    """A cell's printout as Markdown: text blocks, and each listing of a file's lines as a link to them
    on the repository above them as Python. A listing must hold the file's lines as they are."""
    page, text, lines, i = [], [], printed.splitlines(), 0
    while i < len(lines):
        header = LISTING.match(lines[i])
        if not header:
            text.append(lines[i])
            i += 1
            continue
        path, first, last = header["path"], int(header["first"]), int(header["last"])
        listed, i = lines[i + 1 : i + 2 + last - first], i + 2 + last - first
        if not (ROOT / path).is_file() or listed != (ROOT / path).read_text().splitlines()[first - 1 : last]:
            raise ValueError(f"a listing of {path}, lines {first}-{last}, that is not the file's")
        link = f"[`{path}`, lines {first}–{last}]({repository}/{_pinned(path)}/{path}#L{first}-L{last})"
        page += [*_text(text), link, "", "```python", *listed, "```", ""]
        text = []
    return page + _text(text)


def _text(lines: list[str]) -> list[str]:
    """Printed lines as a text block, without the blank lines around them; none if all are blank."""
    body = "\n".join(lines).strip("\n")
    return ["```text", body, "```", ""] if body.strip() else []


def _pinned(path: str) -> str:
    """The commit a listing of `path` links: the last that changed the file, which holds its lines as they are."""
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], cwd=ROOT).returncode:
        raise ValueError(f"a listing of {path}, which has changes not committed: commit them, then render")
    found = subprocess.run(["git", "log", "-1", "--format=%H", "--", path], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip()


def _repo_url() -> str:
    import yaml

    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())["repo_url"].rstrip("/")


def _shown(path: Path) -> str:
    return os.path.relpath(path, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT / "docs" / "annotated.py")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "annotated.md")
    args = parser.parse_args()
    source, out = args.source.resolve(), args.out.resolve()
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    try:
        drawn = run(source, out)
    except CellError as e:
        sys.exit(str(e))
    print(f"{_shown(out)}: {len(cells(source.read_text()))} cells, {drawn} figures")


if __name__ == "__main__":
    main()
