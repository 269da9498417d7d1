"""The annotated model's page (docs/annotated.md) is docs/annotated.py run top to bottom: the script
runs without a failing cell and draws every figure, and the committed page is that script's."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / "docs" / "tools"))
from render import Cell, CellError, _printout, cells, run  # noqa: E402

SOURCE, PAGE = ROOT / "docs" / "annotated.py", ROOT / "docs" / "annotated.md"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")
# A file's lines as render.py writes them: a link to them on the repository, then the lines as Python.
LISTING = re.compile(
    r"^\[`(?P<path>[^`]+)`, lines (?P<first>\d+)–(?P<last>\d+)\]\((?P<url>[^)]+)\)\n\n```python\n(?P<code>.*?)\n```$",
    flags=re.M | re.S,
)


def figures(page: Path) -> list[str]:
    """The figures a page shows that its run drew (not the pipeline's, under ../reports/)."""
    return [link for link in IMAGE.findall(page.read_text()) if not link.startswith("../")]


def code_blocks(page: Path) -> list[str]:
    """The cells' code a page shows (not the package's source it prints)."""
    found = re.findall(r"^( *)```python\n(.*?)\n\1```", LISTING.sub("", page.read_text()), flags=re.S | re.M)
    return [textwrap.dedent(block) if indent else block for indent, block in found]  # a folded cell's is indented


@pytest.mark.slow
def test_the_script_runs_every_cell_and_draws_every_figure(tmp_path):
    out = tmp_path / "annotated.md"
    run = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "tools" / "render.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    drawn = figures(out)
    assert len(drawn) == len(figures(PAGE)) > 0, "the run drew other figures than the committed page shows"
    for name in drawn:
        assert (tmp_path / name).stat().st_size > 1000, f"{name}: missing or empty"
    text = out.read_text()
    # Another host class rounds differently and trains another copier: it may miss a sequence or two.
    copied = int(re.search(r"greedy: (\d+) of 200 new sequences copied exactly", text).group(1))
    assert copied >= 196, f"the copy task did not learn to copy: {copied} of 200"
    assert code_blocks(out) == [c.text for c in cells(SOURCE.read_text()) if c.kind == "code"]


def test_the_committed_page_is_the_scripts_with_every_figure():
    assert code_blocks(PAGE) == [c.text for c in cells(SOURCE.read_text()) if c.kind == "code"], (
        "docs/annotated.md is not docs/annotated.py's: run python docs/tools/render.py"
    )
    text = PAGE.read_text()
    for cell in cells(SOURCE.read_text()):
        if cell.kind == "markdown":
            assert cell.text in text, f"docs/annotated.md lacks the text: {cell.text[:60]}"
    for link in IMAGE.findall(text):
        assert (PAGE.parent / link).resolve().is_file(), f"docs/annotated.md shows a missing figure {link}"


def test_the_page_imports_the_package_instead_of_defining_layers():
    """Every class and function the model, training and decoding use comes from the package."""
    code = "\n".join(c.text for c in cells(SOURCE.read_text()) if c.kind == "code")
    assert not re.search(r"^\s*class ", code, flags=re.M), "the page defines a class of its own"
    assert not re.search(r"nn\.(Linear|Embedding|LayerNorm|Module)\b|softmax\(.*sqrt", code)
    assert "from transformer." in code


def test_cells_splits_code_and_text():
    source = "'doc'\n# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\n\n# %%\nprint(x)\n"
    assert cells(source) == [Cell("markdown", "# Title\n\ntext"), Cell("code", "x = 1"), Cell("code", "print(x)")]


def test_a_folded_cell_runs_and_shows_its_code_folded_under_its_title(tmp_path):
    source = tmp_path / "page.py"
    source.write_text("# %% [folded] How it is drawn\nfor i in range(2):\n    print(i)\n\n# %%\nx = 1\n")
    assert cells(source.read_text())[0] == Cell("code", "for i in range(2):\n    print(i)", "How it is drawn")
    run(source, tmp_path / "page.md")
    page = (tmp_path / "page.md").read_text()
    assert '??? note "How it is drawn"\n\n    ```python\n    for i in range(2):\n        print(i)\n    ```' in page
    assert "```text\n0\n1\n```" in page  # what it printed, unfolded
    assert code_blocks(tmp_path / "page.md") == ["for i in range(2):\n    print(i)", "x = 1"]


def test_a_failing_cell_stops_the_run_and_is_named(tmp_path):
    source = tmp_path / "page.py"
    source.write_text("# %%\nprint('fine')\n\n# %%\n1 / 0\n")
    with pytest.raises(CellError, match=r"cell 2 failed(.|\n)*ZeroDivisionError"):
        run(source, tmp_path / "page.md")
    assert not (tmp_path / "page.md").exists()


def test_a_printed_listing_becomes_a_link_to_its_lines_above_them_as_python():
    lines = (ROOT / "transformer" / "training" / "schedule.py").read_text().splitlines()
    printed = "\n".join(["before", "# transformer/training/schedule.py, lines 2-3", *lines[1:3], "", "after"])
    page = "\n".join(_printout(printed, "https://example.org/repo/blob"))
    listing = LISTING.search(page)
    assert listing and listing["code"] == "\n".join(lines[1:3])
    changed = _git("log", "-1", "--format=%H", "--", "transformer/training/schedule.py").strip()
    assert listing["url"] == f"https://example.org/repo/blob/{changed}/transformer/training/schedule.py#L2-L3"
    assert page.index("before") < listing.start() and listing.end() < page.index("after")


def test_a_listing_that_is_not_the_files_lines_is_refused():
    printed = "# transformer/training/schedule.py, lines 2-3\nnot the file's\nlines\n"
    with pytest.raises(ValueError, match="not the file's"):
        _printout(printed, "https://example.org/repo/blob/main")


def shown_parts() -> dict[str, object]:
    """Every part of the model, its training and its decoding that the page must print, by the name
    the page's `show(...)` gives it."""
    from transformer.decoding import search
    from transformer.model.attention import Mask, MultiHeadAttention
    from transformer.model.embeddings import Embeddings, PositionalEncoding
    from transformer.model.layers import DecoderLayer, EncoderLayer, FeedForward, Residual
    from transformer.model.model import Transformer, make_model
    from transformer.training.loss import Loss, smoothed_cross_entropy
    from transformer.training.schedule import rate

    parts = [Embeddings, PositionalEncoding, MultiHeadAttention.attend, MultiHeadAttention.forward]
    parts += [MultiHeadAttention.heads, Mask, FeedForward, Residual.forward, EncoderLayer.forward]
    parts += [DecoderLayer.forward, make_model, Transformer.forward, rate, smoothed_cross_entropy, Loss.forward]
    parts += [Loss.rdrop, search.greedy, search.one_path, search.beam_search]
    named = {part.__qualname__: part for part in parts}
    return named | {f"search.{name}": getattr(search, name) for name in ("_beam", "_finish_eos", "_finish_long")}


@pytest.mark.parametrize("name", shown_parts())
def test_the_page_prints_each_part_from_the_package_as_it_is_today_under_a_link_to_its_lines(name):
    """A part's source is printed by show() at build time, never copied into the script; the committed
    page holds it as the package writes it now, under a link to its file and lines on the repository."""
    part = inspect.unwrap(shown_parts()[name])
    code = "\n".join(c.text for c in cells(SOURCE.read_text()) if c.kind == "code")
    assert f"show({name})" in code, f"docs/annotated.py does not show {name}"
    lines, first = inspect.getsourcelines(part)
    copied = [line.strip() for line in lines if len(line.strip()) > 30 and line.strip() in code]
    assert not copied, f"docs/annotated.py copies {name}'s source instead of printing it: {copied[0]!r}"
    listings = {listing["code"]: listing for listing in LISTING.finditer(PAGE.read_text())}
    listing = listings.get("".join(lines).rstrip("\n"))
    assert listing, f"docs/annotated.md shows no {name} or an old one: run python docs/tools/render.py"
    path = Path(inspect.getsourcefile(part)).relative_to(ROOT).as_posix()
    last = first + len(lines) - 1
    repository = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["repo_url"].rstrip("/")
    assert (listing["path"], int(listing["first"]), int(listing["last"])) == (path, first, last)
    link = re.fullmatch(
        rf"{re.escape(repository)}/blob/(?P<commit>[0-9a-f]{{40}})/{path}#L{first}-L{last}", listing["url"]
    )
    assert link, f"{name}'s link is not pinned to a commit's lines: {listing['url']}"
    if _in_history(link["commit"]):  # a shallow clone may lack it; the lines are then checked against today's file
        pinned = _git("show", f"{link['commit']}:{path}").splitlines()[first - 1 : last]
        assert pinned == lines_of(listing), f"{name}'s link names a commit whose lines differ from the listing"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _in_history(commit: str) -> bool:
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    return found.returncode == 0 or _git("rev-parse", "--is-shallow-repository").strip() != "true"


def lines_of(listing: re.Match) -> list[str]:
    return listing["code"].splitlines()


def test_the_page_prints_the_ladders_scores_of_the_annotated_transformers_recipe_and_the_default():
    shown = re.search(
        r"test2016 BLEU: annotated_transformer (\d+\.\d+) \[.*?\]\n\s+default (\d+\.\d+) \[.*?\]", PAGE.read_text()
    )
    assert shown, "docs/annotated.md prints no test2016 scores of the two recipes"
    ends = json.loads((ROOT / "reports/ladder.json").read_text())["metrics"]["bleu"]["systems"]
    assert [float(s) for s in shown.groups()] == [ends[0]["score"], ends[-1]["score"]], "the page and the ladder differ"
