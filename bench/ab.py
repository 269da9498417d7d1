"""Training speed of this checkout against another, side by side in one process.

Run from the repository root, with the other checkout as a git revision or a directory:

    python -m bench.ab --against main [--rows plain-fp32,plain-bf16] [--updates 40] [--out reports/ab.json]

A refactor is held to "no slower", yet two whole runs of `bench.bench` on a shared machine differ
by more than that (the machine's own speed drifts between processes). So both checkouts' `bench`
and `transformer` packages are loaded into this process, and each training row of bench.bench
alternates single updates between them, A B B A, on the same batches and the same model size:
whatever slows the machine meets both sides alike. A row's speed ratio is the other side's total
time over this side's (above 1: this checkout is faster); the median of the per-update ratios is
reported beside it. Rows whose code both checkouts share (the baseline's, where bench/baseline.py
is unchanged) show the method's noise.

Rows it cannot compare are named with the reason. The compiled rows are among them: torch.compile's
traces refer to the modules they use by import name, so in one process the second checkout's trace
meets the first one's modules and fails on names only one of them has. Time them with bench.bench
in each checkout.
"""

from __future__ import annotations

import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import click

from bench import bench
from bench.common import ROOT, SIZES
from transformer.io import write_json
from transformer.kernels.memory import keep_freed_memory, training_memory

PACKAGES = ("bench", "transformer")  # what each checkout brings; every other module is shared
CHECKOUT = ("bench", "transformer", "params.yaml")  # what a revision is unpacked with


def ours(name: str) -> bool:
    return name.partition(".")[0] in PACKAGES


def loaded() -> dict[str, ModuleType]:
    return {name: module for name, module in sys.modules.items() if ours(name)}


@dataclass
class Checkout:
    root: Path
    modules: dict[str, ModuleType] = field(default_factory=dict)


def swap(modules: dict[str, ModuleType]) -> dict[str, ModuleType]:
    """Puts `modules` in sys.modules in place of the checkout's there, and returns those."""
    there = loaded()
    for name in there:
        del sys.modules[name]
    sys.modules.update(modules)
    return there


@contextmanager
def entered(checkout: Checkout) -> Iterator[ModuleType]:
    """The checkout's modules in sys.modules and its root first on the path, so that whatever its
    code imports while it runs is its own; yields its bench.bench. What it imported stays its own,
    and the modules there before are put back."""
    before = swap(checkout.modules)
    sys.path.insert(0, str(checkout.root))
    try:
        yield importlib.import_module("bench.bench")
    finally:
        sys.path.remove(str(checkout.root))
        checkout.modules = swap(before)


def load(root: Path) -> Checkout:
    """The checkout at `root`, its bench.bench imported afresh and held to come from it."""
    checkout = Checkout(root.resolve())
    with entered(checkout):
        pass
    strays = sorted(n for n, m in checkout.modules.items() if not Path(m.__file__).is_relative_to(checkout.root))
    if strays:
        raise click.ClickException(f"{root}: {', '.join(strays[:3])} imported from elsewhere")
    return checkout


def unpack(revision: str, into: Path) -> Path:
    """A git revision of this repository's packages and params.yaml (CHECKOUT), unpacked under `into`."""
    done = subprocess.run(["git", "archive", revision, *CHECKOUT], cwd=ROOT, capture_output=True)
    if done.returncode:
        raise click.ClickException(f"git archive {revision}: {done.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(into, filter="data")
    return into


def same_batches(a: dict[str, list], b: dict[str, list]) -> bool:
    def tensors(batches: dict[str, list]) -> list:
        return [(x.src, x.tgt_in, x.tgt_out) for key in sorted(batches) for x in batches[key]]

    return a.keys() == b.keys() and all(
        all(s.equal(t) for s, t in zip(x, y, strict=True)) for x, y in zip(tensors(a), tensors(b), strict=True)
    )


def timed(sides: dict[str, Checkout], steps: dict, batches: dict, warmup: int, updates: int) -> dict[str, list[float]]:
    """Seconds of each side's updates, alternated A B B A, the same batch for both sides each time."""
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(warmup + updates):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for side in order:
            batch = batches[side][i % len(batches[side])]
            with entered(sides[side]):
                start = time.perf_counter()
                steps[side](batch)
                if i >= warmup:
                    seconds[side].append(time.perf_counter() - start)
    return seconds


def spec_of(module: ModuleType, name: str) -> Any:
    """The row `name` of a checkout's bench.bench (its own TrainRow class)."""
    return next(r for r in module.TRAIN_ROWS if r.name == name)


def row(name: str, sides: dict[str, Checkout], data: dict, size: str, warmup: int, updates: int) -> dict[str, Any]:
    steps, batches = {}, {}
    for side, checkout in sides.items():
        with entered(checkout) as module:
            spec = spec_of(module, name)
            steps[side] = module.row_step(spec, data[side][0], SIZES[size])  # this checkout's sizes
            batches[side] = data[side][1][spec.batches]
    keep_freed_memory(spec_of(bench, name).keeps_freed_memory)  # as this checkout's bench.bench runs the row
    seconds = timed(sides, steps, batches, warmup, updates)
    this, other = seconds["this"], seconds["other"]
    result = {
        "row": name,
        "updates": updates,
        "ms_this": round(1000 * statistics.median(this), 2),
        "ms_other": round(1000 * statistics.median(other), 2),
        "speed_ratio": round(sum(other) / sum(this), 3),
        "median_ratio": round(statistics.median(o / t for o, t in zip(other, this, strict=True)), 3),
    }
    print(f"  {name:<20} {result['speed_ratio']:.3f}× (median update {result['median_ratio']:.3f}×)", file=sys.stderr)
    return result


def rows_to_run(sides: dict[str, Checkout], names: tuple[str, ...] | None) -> tuple[list[str], dict[str, str]]:
    """bench.bench's rows (those of `names` where given) that can be compared here, in its order, and
    why each other one is left out."""
    with entered(sides["other"]) as module:
        theirs = set(module.ROW_NAMES)
    dtypes = bench.dtypes_here()
    runs, left = [], {}
    for r in bench.TRAIN_ROWS:
        if names and r.name not in names:
            continue
        if r.name not in theirs:
            left[r.name] = "the other checkout has no such row"
        elif r.compile:
            left[r.name] = "compiled: one process holds one checkout's traces; run bench.bench in each"
        elif why := bench.left_out_here(r, dtypes):
            left[r.name] = why
        else:
            runs.append(r.name)
    return runs, left


def side_data(sides: dict[str, Checkout], count: int, tmp: Path) -> dict[str, tuple]:
    """Each checkout's synthetic corpus and training batches, refused where the two differ."""
    data = {}
    for side, checkout in sides.items():
        with entered(checkout) as module:
            (tmp / side).mkdir()
            corpus = module.load_data(None, tmp / side)
            data[side] = (corpus, module.training_batches(corpus.corpus, count))
    if not same_batches(data["this"][1], data["other"][1]):
        raise click.ClickException("the two checkouts batch the corpus differently: their updates are not comparable")
    return data


@click.command()
@click.option("--against", required=True, help="The other checkout: a git revision of this repository, or a directory.")
@click.option(
    "--rows", "names", default=None, callback=bench.row_names, help="Only these training rows, comma-separated."
)
@click.option("--updates", type=click.IntRange(2), default=40, show_default=True, help="Timed updates a side per row.")
@click.option("--warmup", type=click.IntRange(0), default=2, show_default=True, help="Untimed updates a side per row.")
@click.option("--size", type=click.Choice(list(SIZES)), default="small", show_default=True)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=ROOT / "reports" / "ab.json", show_default=True
)
def main(against: str, names: tuple[str, ...] | None, updates: int, warmup: int, size: str, out: Path) -> None:
    """Training speed of this checkout against another, update for update; see the module docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(against) if Path(against).is_dir() else unpack(against, Path(tmp) / "checkout")
        sides = {"this": Checkout(ROOT, loaded()), "other": load(root)}
        runs, left = rows_to_run(sides, names)
        for name, why in left.items():
            print(f"  {name:<20} left out: {why}", file=sys.stderr)
        if not runs:
            raise click.ClickException("no row to compare: every row asked for is left out")
        data = side_data(sides, min(warmup + updates, bench.MAX_BATCHES), Path(tmp))
        results = [row(name, sides, data, size, warmup, updates) for name in runs]
    print(f"{'row':<22} {'ms this':>8} {'ms other':>9} {'speed ratio':>12} {'median':>7}")
    for r in results:
        ms = f"{r['ms_this']:>8.1f} {r['ms_other']:>9.1f}"
        print(f"{r['row']:<22} {ms} {r['speed_ratio']:>11.3f}× {r['median_ratio']:>6.3f}×")
    report = {"machine": bench.machine(), "against": against, "size": size, "warmup": warmup}
    write_json(out, report | {"rows": results, "left_out": left})


if __name__ == "__main__":
    training_memory()  # the kernel cache and malloc training runs with, for both checkouts
    main()
