"""The pictures of docs/tracking.md: each one the page shows is a committed PNG, wide enough to read,
and docs/tools/screenshots.py makes exactly the pictures the page shows, so remaking them leaves none
stale and none missing."""

from __future__ import annotations

import importlib.util
import re
import struct
import sys

from conftest import ROOT

PAGE = ROOT / "docs" / "tracking.md"
SCRIPT = ROOT / "docs" / "tools" / "screenshots.py"
PNG = b"\x89PNG\r\n\x1a\n"


def shown(text: str) -> list[str]:
    """The pictures a page shows from docs/images/, by file name: Markdown images with their alt text."""
    return re.findall(r"!\[[^\]]+\]\(images/([^)\s]+)\)", text)  # an alt text may span lines


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header chunk; (0, 0) for a file that is not a PNG."""
    if not data.startswith(PNG) or data[12:16] != b"IHDR":
        return 0, 0
    return struct.unpack(">II", data[16:24])


def script_pictures() -> set[str]:
    spec = importlib.util.spec_from_file_location("_screenshots", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclass looks itself up
    spec.loader.exec_module(module)
    return {*module.PICTURES, module.PLOTS}


def test_every_picture_the_page_shows_is_a_png_at_least_1000_px_wide():
    names = shown(PAGE.read_text(encoding="utf-8"))
    assert names, "tracking.md shows no picture"
    for name in names:
        path = PAGE.parent / "images" / name
        assert path.is_file(), f"tracking.md shows a missing images/{name}"
        width, _ = png_size(path.read_bytes())
        assert width >= 1000, f"images/{name}: {width} px wide, not a PNG of at least 1000 px"


def test_the_screenshot_script_makes_exactly_the_pictures_the_page_shows():
    assert script_pictures() == set(shown(PAGE.read_text(encoding="utf-8")))


def test_a_picture_without_alt_text_or_not_a_png_is_caught():
    assert shown("![the runs](images/a.png) and ![](images/b.png)") == ["a.png"]
    assert png_size(PNG + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", 1400, 900)) == (1400, 900)
    assert png_size(b"GIF89a" + bytes(20)) == (0, 0)
