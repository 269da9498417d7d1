"""MkDocs hooks (mkdocs.yml's `hooks`).

Math: pymdownx.arithmatex marks it, and it is written into the page as MathML when the site is built;
browsers draw MathML themselves, so the site needs no MathJax, no font and no network to show it.

The reproduction report and the results: reports/reproduction.md, which the pipeline writes, is
the site's reproduction.md, and a page that holds the README's results markers shows the README's
results table between them; neither is copied into docs/. A pipe that a table's code span escapes
for GitHub (the report's sacreBLEU signatures) is shown without its backslash.

Figures: the pipeline's committed figures live in reports/figures/, outside docs/; a page links them
as ../reports/figures/NAME.png (which is right on a repository browser too), and the site carries a
copy of each at reports/figures/NAME.png.

Wrapped code: code and output are read beside the text, so on every page their long lines wrap at
the column (extra.css's .wrap-code) instead of scrolling out of sight, on a phone as on a desktop.

Tables on a phone: each cell carries its column's header (data-label), so that on a narrow screen
extra.css can stack a row's cells, each under its header, instead of scrolling the row's scores off
the screen.

The command reference: cli.md is written from the click commands each time the site is built
(docs/tools/cli.py), so an option a command gains is on the page at once.

The joiner: the tokenizer's mark ￭ (U+FFED) is missing from most Latin fonts, which draw a box in
its place, so the site carries a font of that one glyph, drawn here, that extra.css puts first in
the text and code font stacks."""

from __future__ import annotations

import html
import io
import re
import sys
from pathlib import Path

from latex2mathml.converter import convert
from mkdocs.structure.files import File, Files, InclusionLevel

FIGURES = Path("reports/figures")  # from the repository root, mkdocs.yml's folder
REPORT = Path("reports/reproduction.md")
README = Path("README.md")
RESULTS = ("<!-- results -->", "<!-- /results -->")  # around the README's results table
JOINER_FONT = "joiner.ttf"  # extra.css's @font-face names it
_TABLE = re.compile(r"<table>.*?</table>", re.DOTALL)
_MATH = re.compile(r'<(span|div) class="arithmatex">\s*\\([(\[])(.*?)\\[)\]]\s*</\1>', re.DOTALL)


def _mathml(match: re.Match) -> str:
    display = "block" if match.group(2) == "[" else "inline"
    return convert(html.unescape(match.group(3)), display=display)


def on_page_content(html_text: str, page, **_) -> str:
    html_text = _TABLE.sub(_labelled_cells, _MATH.sub(_mathml, html_text))
    return f'<div class="wrap-code">\n{html_text}\n</div>'


def _labelled_cells(table: re.Match) -> str:
    """A table whose every body cell names its column's header in data-label."""
    head, _, body = table.group(0).partition("</thead>")
    labels = [html.escape(re.sub(r"<[^>]+>", "", cell).strip()) for cell in re.findall(r"<th[^>]*>(.*?)</th>", head)]
    rows = body.split("<tr>")
    for i, row in enumerate(rows[1:], start=1):
        cells = row.split("<td")
        rows[i] = cells[0] + "".join(
            f'<td data-label="{label}"{rest}' for label, rest in zip(labels + [""] * len(cells), cells[1:])
        )
    return head + "</thead>" + "<tr>".join(rows)


def on_page_markdown(markdown: str, config, **_) -> str:
    return _table_code_pipes(_results(markdown, config))


def _table_code_pipes(markdown: str) -> str:
    """A `|` in a table's code span, escaped as GitHub needs it (`a\\|b`), without the backslash
    Python-Markdown would show there (it splits no cell inside a code span)."""
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("|") and "\\|" in line and line.count("`") % 2 == 0:
            parts = line.split("`")
            parts[1::2] = [code.replace("\\|", "|") for code in parts[1::2]]
            lines[i] = "`".join(parts)
    return "\n".join(lines)


def _results(markdown: str, config) -> str:
    begin, end = RESULTS
    if begin not in markdown:
        return markdown
    readme = (Path(config["docs_dir"]).parent / README).read_text(encoding="utf-8")
    table = readme.split(begin)[1].split(end)[0]
    before, rest = markdown.split(begin, 1)
    return before + begin + table + end + rest.split(end, 1)[1]


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"])
    files.append(File.generated(config, "reproduction.md", abs_src_path=str((docs.parent / REPORT).resolve())))
    for figure in sorted((docs.parent / FIGURES).glob("*.png")):
        uri = (FIGURES / figure.name).as_posix()
        # Included outright: mkdocs would take a path starting with "." for a hidden file and leave it out.
        site = (config["docs_dir"], config["site_dir"], config["use_directory_urls"])
        files.append(File(f"../{uri}", *site, dest_uri=uri, inclusion=InclusionLevel.INCLUDED))
    files.append(File.generated(config, JOINER_FONT, content=_joiner_font()))
    files.append(File.generated(config, "cli.md", content=_cli_page(docs.parent)))
    return files


def _cli_page(root: Path) -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from cli import page
    finally:
        sys.path.pop(0)
    return page(root)


def _joiner_font() -> bytes:
    """A TrueType font of one glyph, the joiner ￭: a square at the height of a lowercase letter,
    in a cell as wide as a monospace font's, so code keeps its columns."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    from transformer.data.tokenize import JOINER

    square = TTGlyphPen(None)
    square.moveTo((120, 120))
    for corner in [(120, 480), (480, 480), (480, 120)]:
        square.lineTo(corner)
    square.closePath()
    font = FontBuilder(1000, isTTF=True)
    font.setupGlyphOrder([".notdef", "joiner"])
    font.setupCharacterMap({ord(JOINER): "joiner"})
    font.setupGlyf({".notdef": TTGlyphPen(None).glyph(), "joiner": square.glyph()})
    font.setupHorizontalMetrics({".notdef": (600, 0), "joiner": (600, 120)})
    font.setupHorizontalHeader(ascent=800, descent=-200)
    font.setupNameTable({"familyName": "Joiner", "styleName": "Regular"})
    font.setupOS2(sTypoAscender=800, sTypoDescender=-200, usWinAscent=800, usWinDescent=200)
    font.setupPost()
    out = io.BytesIO()
    font.save(out)
    return out.getvalue()
