"""Runs a percent-format script (`# %%` code cells, `# %% [markdown]` text cells) top to bottom and
writes it as a Markdown page: each cell's code, what it printed, and the figures it drew as PNGs.

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
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = re.compile(r"^# %%(.*)$")


@dataclass(frozen=True)
class Cell:
    kind: str  # "code" or "markdown"
    text: str


def cells(source: str) -> list[Cell]:
    """The cells of a percent-format script; text before the first marker is dropped (a module docstring)."""
    found: list[Cell] = []
    kind, lines = None, []
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
                found.append(Cell(kind, body))
        kind, lines = ("markdown" if "[markdown]" in header.group(1) else "code"), []
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
    page = [f"<!-- Written by docs/tools/render.py from {_shown(source)}: edit that file, not this one. -->", ""]
    drawn = 0
    for n, cell in enumerate(cells(source.read_text()), 1):
        if cell.kind == "markdown":
            page += [cell.text, ""]
            continue
        page += ["```python", cell.text, "```", ""]
        printed = _execute(cell.text, n, source, namespace)
        if printed.strip():
            page += ["```text", printed.rstrip("\n"), "```", ""]
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
