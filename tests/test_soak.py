"""The kill soak, short: a module of its own, so that it runs beside test_pipeline's repros, not after them."""

from __future__ import annotations

import os
import random
import sys

import pytest
from conftest import ROOT, run


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a few toy runs, each killed or finished
def test_repro_killed_at_random_instants_ends_as_an_uninterrupted_run(tmp_path):
    """bench/soak.py, short: two kills of `dvc repro` and its processes at random instants, a run left to
    finish, everything compared with an uninterrupted run the soak makes first; two at a time, as the
    bench run goes, so the two uninterrupted runs it starts with are compared with each other too.
    A new seed each time; SOAK_SEED=<seed> replays one."""
    seed = os.environ.get("SOAK_SEED") or str(random.randrange(2**32))
    soak = [sys.executable, "-m", "bench.soak", "--kills", "2", "--chain", "2", "--jobs", "2", "--seed", seed]
    result = run([*soak, "--work", str(tmp_path)], ROOT, check=False, timeout=3600)
    assert result.returncode == 0, f"SOAK_SEED={seed}:\n{result.stdout[-2000:]}\n{result.stderr[-5000:]}"
    assert "soak: 2 kills in" in result.stderr, result.stderr[-3000:]
