"""The documentation site builds with every internal link checked (mkdocs --strict), and reads offline:
no page loads a script, a style or a font from the network, the math is MathML, the API page is
generated from the docstrings, every figure a page shows is in the site, no heading falls into a
table, and the tokenizer's joiner has a glyph."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import click
import pytest
from conftest import ROOT

from transformer.cli import main

pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    return out


def test_no_page_loads_anything_from_the_network(site):
    for page in site.rglob("*.html"):
        html = page.read_text()
        tags = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(?:https?:)?//[^"]+"', html)
        remote = [tag for tag in tags if 'rel="canonical"' not in tag]  # names the page's address, loads nothing
        assert not remote, f"{page.relative_to(site)} loads {remote[:3]}"
        # Material's script fetches a "source" component's stars and forks from GitHub's API.
        assert 'data-md-component="source"' not in html, f"{page.relative_to(site)} asks GitHub for its facts"


def test_the_home_page_shows_the_readmes_results_and_the_site_the_reproduction_report(site):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = readme.split("<!-- results -->")[1].split("<!-- /results -->")[0].splitlines()
    cells = [line.strip("|").split("|") for line in rows if line.startswith("| multi30k")]
    home = re.sub(r"<td [^>]*>", "<td>", re.sub(r"\s+", " ", (site / "index.html").read_text()))
    assert cells
    for row in cells:
        assert "<td>" + "</td> <td>".join(cell.strip() for cell in row) + "</td>" in home, row
    report = (site / "reproduction" / "index.html").read_text()
    assert "Reproduction report" in report and "sacreBLEU signature" in report


def test_the_math_is_mathml_and_every_figure_is_in_the_site(site):
    page = site / "annotated" / "index.html"
    html = page.read_text()
    assert html.count("<math") >= 5
    assert "arithmatex" not in html, "math left for a script to render"
    images = re.findall(r'<img[^>]+src="([^"]+)"', html)
    assert any("reports/figures/" in src for src in images) and any("figure-" in src for src in images)
    for src in images:
        assert (page.parent / src).resolve().is_file(), f"the annotated page shows a missing {src}"


def test_the_api_page_is_generated_from_the_docstrings(site):
    html = re.sub(r"<[^>]+>", "", (site / "reference" / "index.html").read_text())
    for name in ("Translator", "translate", "load", "save_model", "ctranslate2_translate"):
        assert name in html
    assert "Raw text in, raw text out." in html  # Translator.translate's docstring


def test_the_api_page_shows_special_tokens_and_the_tokenizer_and_translation_fields(site):
    """A docstring's `</s>` written bare is taken by the browser for a closing tag and vanishes."""
    html = (site / "reference" / "index.html").read_text()
    assert "</s>" not in html and "&lt;/s&gt;" in html
    text = re.sub(r"<[^>]+>", "", html)
    assert "spaCy's rule-based tokenizer" in text  # Tokenizer's docstring
    assert "the translation as raw text" in text.lower() and "score: float" in text  # Translation's fields


class _CellText(HTMLParser):
    """Collects what sits inside table cells: the headings opened there and the cells' text."""

    def __init__(self):
        super().__init__()
        self.depth, self.headings, self.texts = 0, [], []

    def handle_starttag(self, tag, attrs):
        if tag in ("td", "th"):
            self.depth += 1
            self.texts.append("")
        elif self.depth and re.fullmatch(r"h[1-6]", tag):
            self.headings.append(tag)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.texts[-1] += data


def test_no_heading_is_swallowed_by_a_table(site):
    """A Markdown table needs a blank line after it, or the next line (a heading too) becomes a row."""
    for page in site.rglob("*.html"):
        cells = _CellText()
        cells.feed(page.read_text())
        assert not cells.headings, f"{page.relative_to(site)}: a {cells.headings[0]} in a table cell"
        swallowed = [text for text in cells.texts if re.match(r"\s*#{1,6} ", text)]
        assert not swallowed, f"{page.relative_to(site)}: a heading read as a table row: {swallowed[0]!r}"


def test_no_code_in_a_table_shows_the_backslash_that_escapes_a_pipe_for_github(site):
    for page in site.rglob("*.html"):
        shown = re.findall(r"<td><code>[^<]*\\\|[^<]*</code>", page.read_text())
        assert not shown, f"{page.relative_to(site)}: {shown[0]}"


def _css(site: Path) -> str:
    return (site / "extra.css").read_text()


def test_every_pages_code_and_output_wrap_at_the_column(site):
    """Lines wider than the column wrap (extra.css) rather than scroll out of sight, on every page."""
    rule = re.search(r"\.wrap-code pre > code\s*\{([^}]*)\}", _css(site))
    assert rule and "white-space: pre-wrap" in rule.group(1) and "overflow-wrap: anywhere" in rule.group(1)
    for page in site.rglob("*.html"):
        html = page.read_text()
        if '<div class="md-content"' not in html:
            continue  # a redirect or the search's page: no content of ours
        assert re.search(r'<link[^>]+href="[^"]*extra\.css"', html), f"{page.relative_to(site)} lacks extra.css"
        content = html[html.index('<div class="wrap-code">') :] if '<div class="wrap-code">' in html else ""
        assert content.count("<pre") == html.count("<pre"), f"{page.relative_to(site)}: code outside the wrapped part"


def test_on_a_phone_a_tables_cells_stack_each_under_its_header(site):
    """At 400 px a ten-column table shows two or three columns and scrolls the rest off the screen: each
    body cell carries its header, which extra.css shows beside the cell once the row is stacked."""
    css = _css(site)
    phone = css[css.index("@media screen and (max-width: 44.9375em)") :]
    assert "display: block" in phone and "content: attr(data-label)" in phone
    tables = 0
    for page in site.rglob("*.html"):
        for table in re.findall(r"<table>.*?</table>", page.read_text(), re.DOTALL):
            tables += 1
            head, body = table.split("</thead>")
            labels = [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<th[^>]*>(.*?)</th>", head)]
            for row in re.findall(r"<tr>(.*?)</tr>", body, re.DOTALL):
                cells = re.findall(r'<td data-label="([^"]*)"', row)
                assert [unescape(c) for c in cells] == labels[: len(cells)] and row.count("<td") == len(cells), (
                    f"{page.relative_to(site)}: a row's cells do not name their headers: {row[:200]}"
                )
    assert tables > 20


def test_no_page_links_a_server_on_the_readers_own_machine(site):
    """`make docs` serves the site on a loopback address: named on a page, never a link that leads nowhere."""
    for page in site.rglob("*.html"):
        assert not re.search(r'href="https?://(127\.0\.0\.1|localhost)', page.read_text()), page.relative_to(site)


def test_the_joiner_has_a_glyph_in_the_sites_own_font(site):
    """Most Latin fonts lack ￭ (U+FFED) and draw a box: the site's font stack starts with one that has it."""
    from fontTools.ttLib import TTFont

    from transformer.data.tokenize import JOINER

    css = (site / "extra.css").read_text()
    face = re.search(r"@font-face\s*\{([^}]*)\}", css).group(1)
    font = re.search(r'src: url\("([^"]+)"\)', face).group(1)
    assert f"unicode-range: U+{ord(JOINER):04X}" in face
    assert ord(JOINER) in TTFont(site / font).getBestCmap()
    family = re.search(r'font-family: ("[^"]+")', face).group(1)
    assert f"--md-text-font: {family}" in css and f"--md-code-font: {family}" in css


def _cli():
    """docs/tools/cli.py, which writes the command reference."""
    sys.path.insert(0, str(ROOT / "docs/tools"))
    try:
        import cli
    finally:
        sys.path.pop(0)
    return cli


def _commands() -> dict[str, click.Command]:
    """Every command the reference documents, by the heading it has there."""
    group = click.Context(main, info_name="transformer")
    commands = {f"transformer {name}": main.get_command(group, name) for name in main.list_commands(group)}
    for name in _cli()._pipeline_order(ROOT):
        commands[f"python stages/{name}.py"] = _cli()._stage_command(ROOT / "stages" / f"{name}.py")
    return commands


def test_the_command_reference_shows_every_option_of_every_command(site):
    text = unescape(re.sub(r"<[^>]+>", "", (site / "cli" / "index.html").read_text()))
    text = re.sub(r"\s+", " ", text)
    commands = _commands()
    assert len(commands) >= 17  # seven `transformer` commands, ten stage scripts
    for title, command in commands.items():
        section = text.split(f"{title}¶", 1)[1].split("¶", 1)[0]  # up to the next heading's permalink
        for option in (param for param in command.params if isinstance(param, click.Option)):
            assert option.opts[0] in section, f"the command reference lacks {title} {option.opts[0]}"
            if option.help:
                assert " ".join(option.help.split()[:4]) in section, f"{title} {option.opts[0]} without its help"


def test_an_option_a_command_gains_is_on_the_reference(monkeypatch):
    translate = main.commands["translate"]
    new = click.Option(["--brevity-weight"], type=float, help="how much shorter output is preferred")
    monkeypatch.setattr(translate, "params", [*translate.params, new])
    section = _cli().page(ROOT).split("### `transformer translate`")[1].split("###")[0]
    assert "- `--brevity-weight FLOAT`: how much shorter output is preferred" in section
