"""A randomized kill soak of the toy pipeline: `dvc repro` SIGKILLed with every process it started at
random instants, rerun, killed again, until one run is left to finish; then everything it left is
compared with an uninterrupted run's.

Run from the repository root:

    python -m bench.soak --kills 100 --jobs 2 [--seed S] [--chain 3] [--work /tmp/transformer-soak] [--reference DIR]

It builds the test suite's toy project (bench/toy.py's project_copy with its SMALL settings) and,
unless --reference names one already run, runs it uninterrupted, --jobs copies side by side: the first
is the reference, and they must not differ. Then, round after round, --jobs at a time, a fresh copy is
run and killed one to --chain times, each kill at an instant drawn uniformly over the uninterrupted
runs' wall time (a kill that finds the run finished is not counted), and run once more to its end.
Each round's result must match the reference: the files tests/test_pipeline.py requires bit-identical
(data/raw, data/tokenized, data/vocab, the translations, the figures, the scores, model.pt but for the
run's record), the CTranslate2 export, dvc.lock but for the outputs that hold times, `dvc status`
clean, no temporary file, no stale lock and no process left, and the MLflow store's runs (names,
nesting, status, params, the metrics that do not measure time, each step's value once) and registered
versions. It prints the seed first: --seed replays every round's draws (the instants, not the
machine's timing), and a tally of the stages the kills fell in last. Exit status 1 if any round
differed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import click
import psutil

from bench.toy import (
    DVC,
    RUN_RECORD,
    SMALL,
    mlflow_client,
    project_copy,
    run,
    same_values,
    start_repro,
    tiny_params,
    tree,
)

SAME_TREES = ("data/raw", "data/tokenized", "data/vocab", "data/translations", "reports/figures", "data/export")
SAME_FILES = ("reports/scores.json",)
# Outputs that record times, or an MLflow run's id: their hashes in dvc.lock differ from run to run.
TIMED = (
    "data/timings",
    "data/checkpoints",
    "data/model",
    "reports/train/",
    "reports/decode/",
    "reports/evaluation.json",
    "reports/reproduction",
    "reports/scores.md",  # its model lines give the training's wall time; scores.json holds the scores
)
# Metrics that measure time or the machine: compared by name only.
MEASURED = ("system/", "tokens_per_s", "batch_wait_ms", "peak_rss_mb", "restarts", "decode_", "train_time")


def run_seconds(repo: Path) -> float:
    """A finished repro's wall time: from the toy project's commit, made just before it ran, to the
    last write of dvc.lock, which DVC updates after each stage."""
    committed = int(run(["git", "log", "-1", "--format=%ct"], repo).stdout)
    return (repo / "dvc.lock").stat().st_mtime - committed


def kill_tree(repro: subprocess.Popen) -> list[str]:
    """SIGKILLs `dvc repro`'s process group and every process it started, in any session (torchrun's
    workers have their own); returns the stages that were running."""
    tree = [repro.pid]
    try:
        found = psutil.Process(repro.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        found = []
    stages = sorted(
        {a.split("stages/")[1].removesuffix(".py") for p in found for a in _cmdline(p) if a.startswith("stages/")}
    )
    tree += [p.pid for p in found]
    os.killpg(repro.pid, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    repro.wait()
    psutil.wait_procs(found, timeout=30)
    return stages


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def kill_chain(repo: Path, kills: int, seconds: float, rng: random.Random) -> tuple[list[str], float | None]:
    """Runs `dvc repro` and SIGKILLs it `kills` times at uniform instants in [0, seconds]; a run that
    ends before its instant is not a kill, and ends the chain. Returns what each kill hit, as 'stage at
    t s', with ', <DVC's file> cut short' where it left one so, then recovered), and the wall time of a fresh
    project's run that ended before its kill, if one did."""
    hit = []
    while len(hit) < kills:
        instant = rng.uniform(0, seconds)
        repro, started = start_repro(repo), time.monotonic()
        while repro.poll() is None and time.monotonic() - started < instant:
            time.sleep(0.01)
        if repro.poll() is not None:
            if repro.returncode != 0:
                raise click.ClickException(f"{repo}: dvc repro failed ({repro.returncode}) before its kill")
            return hit, None if hit else time.monotonic() - started
        stages = kill_tree(repro)
        cut = [name for name, recover in (("dvc.lock", recover_lock), (RWLOCK, recover_rwlock)) if recover(repo)]
        hit.append(f"{'+'.join(stages) or 'dvc'} at {instant:.1f} s" + "".join(f", {name}{CUT}" for name in cut))
    return hit, None


CUT = " cut short"
RWLOCK = ".dvc/tmp/rwlock"


def recover_lock(repo: Path) -> bool:
    """DVC rewrites dvc.lock in place after each stage, so a kill inside that write leaves it cut
    short, and every later DVC command stops on it. Where it is, does what docs/reliability.md tells
    a user to: dvc.lock back from git where it is committed, else removed (the next `dvc repro` takes
    the finished stages from DVC's run cache). Returns whether it was cut short."""
    import voluptuous
    import yaml
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA

    lock = repo / "dvc.lock"
    if not lock.exists():  # killed before its first stage ended
        return False
    try:
        COMPILED_LOCKFILE_SCHEMA(yaml.safe_load(lock.read_text(encoding="utf-8")))
    except (yaml.YAMLError, voluptuous.Invalid):
        if run(["git", "ls-files", "--error-unmatch", "dvc.lock"], repo, check=False).returncode == 0:
            run(["git", "checkout", "--", "dvc.lock"], repo)
        else:
            lock.unlink()
        return True
    return False


def recover_rwlock(repo: Path) -> bool:
    """DVC also rewrites its registry of path locks, .dvc/tmp/rwlock, in place as a stage starts and
    ends; cut short, every later DVC command stops on it ('JSON structure is corrupted'). Where it is,
    removes it, as docs/reliability.md tells a user to. Returns whether it was cut short."""
    rwlock = repo / RWLOCK
    try:
        json.loads(rwlock.read_text(encoding="utf-8"))  # DVC reads an empty one as corrupt too
    except FileNotFoundError:
        return False
    except json.JSONDecodeError:
        rwlock.unlink()
        return True
    return False


def file_differences(repo: Path, reference: Path) -> list[str]:
    import torch

    found = [name for name in SAME_TREES if tree(repo / name) != tree(reference / name)]
    found += [name for name in SAME_FILES if (repo / name).read_bytes() != (reference / name).read_bytes()]
    mine, theirs = (torch.load(r / "data/model/model.pt", weights_only=True) for r in (repo, reference))
    if mine.keys() != theirs.keys():
        found.append("model.pt's keys")
    found += [f"model.pt '{k}'" for k in sorted(set(theirs) - set(RUN_RECORD)) if not same_values(mine[k], theirs[k])]
    return found


def lock_differences(repo: Path, reference: Path) -> list[str]:
    """dvc.lock's stages, commands, params and hashes, but those of TIMED outputs and files under them."""
    import yaml

    def entries(root: Path) -> dict[str, object]:
        lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
        flat = {}
        for stage, entry in lock.items():
            flat[f"{stage} cmd"] = entry["cmd"]
            flat[f"{stage} params"] = entry.get("params")
            for kind in ("deps", "outs"):
                for item in entry.get(kind, []):
                    if not item["path"].startswith(TIMED):
                        flat[f"{stage} {kind} {item['path']}"] = item.get("md5")
        return flat

    mine, theirs = entries(repo), entries(reference)
    return [f"dvc.lock: {k}" for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


def leftovers(repo: Path) -> list[str]:
    """Temporary files, stale locks and live processes a finished repro must not leave."""
    found = [
        str(p.relative_to(repo))
        for p in repo.rglob("*")
        if p.name.endswith((".tmp", ".old")) and ".git" not in p.parts and ".dvc" not in p.parts
    ]
    found += _held_locks(repo / RWLOCK)
    status = run([DVC, "status"], repo).stdout
    if "Data and pipelines are up to date" not in status:
        found.append(f"dvc status: {status.strip()}")
    for process in psutil.process_iter():
        try:
            if Path(process.cwd()).is_relative_to(repo):
                found.append(f"a process left: {' '.join(process.cmdline())}")
        except psutil.Error:
            pass
    return found


def _held_locks(rwlock: Path) -> list[str]:
    """DVC's path locks that would stop a later command: any write lock, and a read lock of a live
    process. A killed `dvc repro` leaves its read locks on the stage's deps; DVC drops such an entry,
    a dead process's, when a command would wait on it."""
    lock = json.loads(rwlock.read_text() or "{}") if rwlock.exists() else {}
    held = [f"DVC write lock on {path}" for path in lock.get("write", {})]
    for path, infos in lock.get("read", {}).items():
        held += [f"DVC read lock on {path} ({i['cmd']})" for i in infos if psutil.pid_exists(i["pid"])]
    return held


def mlflow_summary(repo: Path) -> dict[str, object]:
    """The store's runs by name ('train', 'evaluate ...', nested under 'train' or not), their status,
    params and metrics (MEASURED by name only), and the registered versions."""
    client = mlflow_client(repo)
    runs, names = {}, {}
    for experiment in client.search_experiments():
        for r in client.search_runs([experiment.experiment_id]):
            names[r.info.run_id] = r.info.run_name
    for run_id, name in names.items():
        r = client.get_run(run_id)
        parent = names.get(r.data.tags.get("mlflow.parentRunId"))
        metrics = {k: "measured" if k.startswith(MEASURED) else _history(client, run_id, k) for k in r.data.metrics}
        entry = {"parent": parent, "status": r.info.status, "params": r.data.params, "metrics": metrics}
        runs.setdefault(f"{name} under {parent}", []).append(entry)
    versions = [(v.name, v.version) for v in client.search_model_versions()]
    return {"runs": runs, "versions": sorted(versions)}


def _history(client, run_id: str, key: str) -> dict[int, object]:
    """step -> value; a step logged twice with two values is kept as both (a rerun that logged again)."""
    steps: dict[int, set] = {}
    for m in client.get_metric_history(run_id, key):
        steps.setdefault(m.step, set()).add(m.value)
    return {s: (v.pop() if len(v) == 1 else sorted(v)) for s, v in sorted(steps.items())}


def mlflow_differences(repo: Path, reference: Path) -> list[str]:
    mine, theirs = mlflow_summary(repo), mlflow_summary(reference)
    found = []
    for name in sorted(set(mine["runs"]) | set(theirs["runs"])):
        a, b = mine["runs"].get(name, []), theirs["runs"].get(name, [])
        if len(a) != len(b):
            found.append(f"MLflow: {len(a)} runs '{name}', the reference {len(b)}")
        elif a != b:
            keys = [k for k in ("status", "params", "metrics") if a[0][k] != b[0][k]]
            details = [m for m in a[0]["metrics"] if a[0]["metrics"][m] != b[0]["metrics"].get(m)][:5]
            found.append(f"MLflow: run '{name}' differs in {', '.join(keys)} {details}")
    if mine["versions"] != theirs["versions"]:
        found.append(f"MLflow: registered versions {mine['versions']}, the reference {theirs['versions']}")
    return found


def soak_round(work: Path, reference: Path, kills: int, seconds: float, rng: random.Random) -> tuple:
    """One fresh project, killed `kills` times (fewer where a run finishes first), then run to its end:
    what the kills hit, how the result differs from the reference, and kill_chain's wall time of a run
    that finished unkilled."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    repo = project_copy(work, tiny_params(**SMALL))
    try:
        hit, unkilled_s = kill_chain(repo, kills, seconds, rng)
    except click.ClickException as error:
        return [], [error.message], None
    last = run([DVC, "repro"], repo, check=False, timeout=3600)
    if last.returncode != 0:
        return hit, [f"the last dvc repro failed ({last.returncode}): {last.stderr[-2000:]}"], unkilled_s
    return hit, differences(repo, reference), unkilled_s


def differences(repo: Path, reference: Path) -> list[str]:
    """Everything in which a finished run differs from the reference, or left behind."""
    found = file_differences(repo, reference) + lock_differences(repo, reference)
    return found + leftovers(repo) + mlflow_differences(repo, reference)


def reference_run(work: Path) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    repo = project_copy(work, tiny_params(**SMALL))
    run([DVC, "repro"], repo, timeout=3600)
    return repo


def references(work: Path, jobs: int) -> tuple[Path, float, list[str]]:
    """`jobs` uninterrupted runs side by side, under the load the rounds will run under: the first is
    the reference, their mean wall time what kill instants are drawn over, and they must not differ."""
    with ThreadPoolExecutor(jobs) as pool:
        repos = list(pool.map(reference_run, [work / f"reference-{i + 1}" for i in range(jobs)]))
    seconds = statistics.mean(run_seconds(repo) for repo in repos)
    problems = [f"{repo.parent.name}: {p}" for repo in repos[1:] for p in differences(repo, repos[0])]
    return repos[0], seconds, problems


def round_rng(seed: int, number: int) -> random.Random:
    """Each round draws from a generator of its own, so that a seed replays every round's draws however
    the rounds running side by side interleave."""
    return random.Random(f"{seed}/{number}")


def stage_of(hit: str) -> str:
    """'train at 12.3 s' -> 'train'; a kill between stages, with only DVC running, is 'dvc'."""
    return hit.split(" at ")[0]


@dataclass
class Soak:
    """Rounds, `jobs` at a time, until `kills` kills have found a run to kill; what they hit, by stage."""

    kills: int
    seed: int
    chain: int
    work: Path
    reference: Path
    seconds: float  # what kill instants are drawn over
    keep: bool
    done: int = 0
    rounds: int = 0
    failed: int = 0
    cut_files: int = 0
    stages: Counter = field(default_factory=Counter)
    running: dict = field(default_factory=dict)  # future -> (round number, kills planned, started)

    def run(self, jobs: int) -> None:
        with ThreadPoolExecutor(jobs) as pool:
            while self.done < self.kills or self.running:
                while len(self.running) < jobs and self._wanted() > 0:
                    self._start(pool)
                for future in wait(self.running, return_when=FIRST_COMPLETED).done:
                    self._finish(future)

    def _wanted(self) -> int:
        return self.kills - self.done - sum(planned for _, planned, _ in self.running.values())

    def _start(self, pool: ThreadPoolExecutor) -> None:
        number = self.rounds + len(self.running) + 1
        rng = round_rng(self.seed, number)
        planned = min(rng.randint(1, self.chain), self._wanted())
        future = pool.submit(soak_round, self.work / f"round-{number}", self.reference, planned, self.seconds, rng)
        self.running[future] = (number, planned, time.monotonic())

    def _finish(self, future: Future) -> None:
        number, _, started = self.running.pop(future)
        hit, problems, unkilled_s = future.result()
        self.done, self.rounds, self.failed = self.done + len(hit), self.rounds + 1, self.failed + bool(problems)
        self.stages.update(stage_of(h) for h in hit)
        self.cut_files += sum(CUT in h for h in hit)
        minutes = (time.monotonic() - started) / 60
        click.echo(
            f"round {number} ({minutes:.1f} min): killed in {', '.join(hit) or 'nothing (it finished first)'}", err=True
        )
        if unkilled_s:  # the machine runs faster than it ran the reference: draw over what a run takes now
            self.seconds = unkilled_s
            click.echo(f"  a whole run took {unkilled_s:.0f} s: later kills are drawn over that", err=True)
        for problem in problems:
            click.echo(f"  differs: {problem}", err=True)
        if not problems and not self.keep:
            shutil.rmtree(self.work / f"round-{number}")


@click.command()
@click.option("--kills", default=5, show_default=True, help="kills that find a run to kill, over every round")
@click.option("--seed", type=int, help="replays a soak's draws; a new one by default, printed")
@click.option("--chain", default=3, show_default=True, help="at most this many kills a round before its last run")
@click.option("--jobs", default=1, show_default=True, help="rounds run side by side (a toy run keeps one core busy)")
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/transformer-soak"), show_default=True)
@click.option("--reference", type=click.Path(path_type=Path), help="an uninterrupted toy repro's directory to reuse")
@click.option("--keep/--no-keep", default=False, help="keep every round's project, not only those that differ")
def main(kills: int, seed: int | None, chain: int, jobs: int, work: Path, reference: Path | None, keep: bool) -> None:
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big")
    click.echo(f"soak: seed {seed} (--seed {seed} replays it)", err=True)
    started = time.monotonic()
    if reference:
        seconds, problems = run_seconds(reference), []
    else:
        reference, seconds, problems = references(work, jobs)
    for problem in problems:
        click.echo(f"  uninterrupted runs differ: {problem}", err=True)
    click.echo(f"soak: an uninterrupted run takes {seconds:.0f} s, {jobs} at a time", err=True)
    soak = Soak(kills=kills, seed=seed, chain=chain, work=work, reference=reference, seconds=seconds, keep=keep)
    soak.run(jobs)
    click.echo(f"soak: kills by stage: {', '.join(f'{s} {n}' for s, n in soak.stages.most_common())}", err=True)
    minutes, failed = (time.monotonic() - started) / 60, soak.failed + bool(problems)
    cut = f", {soak.cut_files} of them inside DVC's writes of its own files (recovered)" if soak.cut_files else ""
    summary = f"{soak.done} kills{cut} in {soak.rounds} rounds, {failed} differing, {minutes:.0f} min (seed {seed})"
    click.echo(f"soak: {summary}", err=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
