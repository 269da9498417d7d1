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


def test_a_dvc_lock_cut_short_by_a_kill_is_taken_back_from_git_or_removed(tmp_path):
    """The recovery docs/reliability.md gives for a kill inside DVC's write of dvc.lock, as the soak applies it."""
    from bench.soak import recover_lock

    whole = "schema: '2.0'\nstages:\n  download:\n    cmd: python stages/download.py\n    outs:\n"
    whole += (
        "    - path: data/raw\n      hash: md5\n      md5: 0123456789abcdef0123456789abcdef.dir\n      size: 5637\n"
    )
    cut = whole[: whole.index("5637")]  # as a kill after DVC's first buffered write leaves it: 'size:' with no value
    lock = tmp_path / "dvc.lock"
    run(["git", "init", "-q"], tmp_path)
    assert not recover_lock(tmp_path) and not lock.exists()  # none yet: nothing to do
    lock.write_text(whole)
    assert not recover_lock(tmp_path) and lock.read_text() == whole  # a whole one is left alone
    lock.write_text(cut)
    assert recover_lock(tmp_path) and not lock.exists()  # never committed: removed
    lock.write_text(whole)
    run(["git", "add", "dvc.lock"], tmp_path)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "lock"], tmp_path)
    lock.write_text(cut)
    assert recover_lock(tmp_path) and lock.read_text() == whole  # committed: taken back from git


def test_dvcs_path_lock_registry_cut_short_by_a_kill_is_removed(tmp_path):
    """A kill as DVC rewrites .dvc/tmp/rwlock leaves it empty or cut; DVC then refuses every command."""
    from bench.soak import RWLOCK, recover_rwlock

    rwlock = tmp_path / RWLOCK
    assert not recover_rwlock(tmp_path)  # none: nothing to do
    rwlock.parent.mkdir(parents=True)
    whole = '{"read": {}, "write": {}}'
    rwlock.write_text(whole)
    assert not recover_rwlock(tmp_path) and rwlock.read_text() == whole
    for cut in ("", whole[:12]):
        rwlock.write_text(cut)
        assert recover_rwlock(tmp_path) and not rwlock.exists()
