"""Directory outputs are swapped in whole, and a writer killed at any point leaves the previous
output whole: in place, or set aside where the next writer puts it back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

from transformer.io import atomic_dir

_WRITER = """
import os, signal, sys, time
from pathlib import Path
import transformer.io as io

out, when = Path(sys.argv[1]), sys.argv[2]
real = os.replace
renames = []

def replace(src, dst):
    real(src, dst)
    renames.append(dst)
    if when == "between" and len(renames) == 1:  # the old output renamed aside, the new one not yet in
        os.kill(os.getpid(), signal.SIGKILL)

io.os.replace = replace
with io.atomic_dir(out) as tmp:
    (tmp / "a.txt").write_text("second run, part one\\n")
    if when == "writing":
        os.kill(os.getpid(), signal.SIGKILL)
    (tmp / "b.txt").write_text("second run, part two\\n")
"""


def _first_run(out: Path) -> dict[str, str]:
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("first run\n")
        (tmp / "c.txt").write_text("first run too\n")
    return _contents(out)


def _contents(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


def _killed_second_run(out: Path, when: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_WRITER), str(out), when], cwd=ROOT)
    assert done.returncode == -9


def test_a_second_run_killed_while_writing_leaves_the_first_runs_output_in_place(tmp_path):
    out = tmp_path / "out"
    first = _first_run(out)
    _killed_second_run(out, "writing")
    assert _contents(out) == first


def test_a_second_run_killed_between_its_renames_leaves_the_first_output_for_the_next_writer(tmp_path):
    out = tmp_path / "out"
    first = _first_run(out)
    _killed_second_run(out, "between")
    assert not out.exists()  # aside, not lost: the next writer puts it back before it begins
    (aside,) = tmp_path.glob(".out.*.old")
    assert _contents(aside) == first
    with pytest.raises(RuntimeError), atomic_dir(out):
        assert _contents(out) == first
        raise RuntimeError("a third run that fails")
    assert _contents(out) == first and not list(tmp_path.glob(".out.*"))


def test_a_finished_write_replaces_the_output_whole_and_leaves_nothing_aside(tmp_path):
    out = tmp_path / "out"
    _first_run(out)
    with atomic_dir(out) as tmp:
        (tmp / "b.txt").write_text("new\n")
    assert _contents(out) == {"b.txt": "new\n"} and not list(tmp_path.glob(".out.*"))
