"""MkDocs hooks (mkdocs.yml's `hooks`).

Math: pymdownx.arithmatex marks it, and it is written into the page as MathML when the site is built;
browsers draw MathML themselves, so the site needs no MathJax, no font and no network to show it.

Figures: the pipeline's committed figures live in reports/figures/, outside docs/; a page links them
as ../reports/figures/NAME.png (which is right on a repository browser too), and the site carries a
copy of each at reports/figures/NAME.png.

Wrapped code: the annotated model's code and output are read beside the text, so their long lines
wrap at the column (extra.css's .wrap-code) instead of scrolling out of sight."""

from __future__ import annotations

import html
import re
from pathlib import Path

from latex2mathml.converter import convert
from mkdocs.structure.files import File, Files, InclusionLevel

FIGURES = Path("reports/figures")  # from the repository root, mkdocs.yml's folder
WRAPPED_CODE = {"annotated.md"}
_MATH = re.compile(r'<(span|div) class="arithmatex">\s*\\([(\[])(.*?)\\[)\]]\s*</\1>', re.DOTALL)


def _mathml(match: re.Match) -> str:
    display = "block" if match.group(2) == "[" else "inline"
    return convert(html.unescape(match.group(3)), display=display)


def on_page_content(html_text: str, page, **_) -> str:
    html_text = _MATH.sub(_mathml, html_text)
    if page.file.src_uri in WRAPPED_CODE:
        html_text = f'<div class="wrap-code">\n{html_text}\n</div>'
    return html_text


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"])
    for figure in sorted((docs.parent / FIGURES).glob("*.png")):
        uri = (FIGURES / figure.name).as_posix()
        # Included outright: mkdocs would take a path starting with "." for a hidden file and leave it out.
        site = (config["docs_dir"], config["site_dir"], config["use_directory_urls"])
        files.append(File(f"../{uri}", *site, dest_uri=uri, inclusion=InclusionLevel.INCLUDED))
    return files
