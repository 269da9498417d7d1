"""Training speed and memory on glibc's malloc (freed blocks kept, as training tunes it there)
against mimalloc (what training preloads where it is installed), and against mimalloc with
oneDNN's kernel cache limited as training limits it, side by side in one run.

Run from the repository root (about 6 minutes on 2 cores with the defaults):

    python bench/allocators.py [--rows cexy] [--repeats 3] [--out reports/allocators.json]

A process's malloc and oneDNN's cache are fixed when it starts, so each turn is a fresh
`bench.py --quick --rows ...`, the arms taking turns, `--repeats` times each: glibc and mimalloc
with oneDNN's default cache (1,024 kernels), then training's settings (transformer.kernels.memory:
mimalloc, the cache limited). It prints each training row's median target tokens/s in each arm,
each arm's ratio to glibc's, and each arm's peak resident set of a bench process.
The environment is passed on, so MIMALLOC_* options apply to the mimalloc arms.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from transformer.io import write_json  # noqa: E402
from transformer.kernels.memory import (  # noqa: E402
    ALLOCATOR_ENV,
    KERNEL_CACHE,
    KERNEL_CACHE_ENV,
    ONEDNN_KERNEL_CACHE,
    mimalloc_library,
)

ONEDNN_DEFAULT = {KERNEL_CACHE_ENV: str(ONEDNN_KERNEL_CACHE)}
ARMS = {  # name -> the environment it sets; the first is what the others are compared with
    "glibc": {ALLOCATOR_ENV: "glibc"} | ONEDNN_DEFAULT,
    "mimalloc": ONEDNN_DEFAULT,
    "training": {},  # training's own: mimalloc, oneDNN's cache as transformer.kernels.memory limits it
}


def bench_once(rows: str, env: dict[str, str], out: Path) -> dict:
    """One quick bench.py process over the training rows `rows`: its JSON report."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--quick", "--rows", rows, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summary(runs: dict[str, list[dict]]) -> list[dict]:
    """Per training row: the median tokens/s in each arm, and each later arm's ratio to the first's."""
    speeds: dict[str, dict[str, list[float]]] = {}
    for name, reports in runs.items():
        for report in reports:
            for row in report["train"]:
                speeds.setdefault(f"{row['key']}. {row['row']}", {}).setdefault(name, []).append(row["tokens_per_s"])
    table = []
    for row, by in speeds.items():
        medians = {name: statistics.median(by[name]) for name in runs}
        first, *others = runs
        ratios = {f"{name}/{first}": round(medians[name] / medians[first], 3) for name in others}
        table.append({"row": row, **medians, **ratios})
    return table


@click.command()
@click.option("--rows", default="cexy", show_default=True, help="bench.py's training rows, by key")
@click.option("--repeats", default=3, show_default=True, help="turns of each arm")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=ROOT / "reports" / "allocators.json")
def main(rows: str, repeats: int, out: Path) -> None:
    """glibc's malloc, mimalloc and training's settings, bench.py's training rows in turns; see the module docstring."""
    if mimalloc_library() is None:
        raise click.ClickException("mimalloc is not installed (pip install cmeel-mimalloc, on Linux)")
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(repeats):
            for name, extra in ARMS.items():
                env = {k: v for k, v in os.environ.items() if k not in (ALLOCATOR_ENV, KERNEL_CACHE_ENV)} | extra
                report = bench_once(rows, env, Path(tmp) / f"{name}{turn}.json")
                ran = report["machine"]
                assert ran["allocator"] == ("glibc" if ALLOCATOR_ENV in extra else "mimalloc"), ran["allocator"]
                assert ran["kernel_cache"] == int(extra.get(KERNEL_CACHE_ENV, KERNEL_CACHE)), ran["kernel_cache"]
                runs[name].append(report)
    table = summary(runs)
    peaks = {name: max(r["machine"]["peak_rss_mb"] for r in reports) for name, reports in runs.items()}
    columns = [key for key in table[0] if key != "row"]
    print(f"{'row':<36}" + "".join(f" {key:>18}" for key in columns) + "   (tok/s, ratios)")
    for r in table:
        cells = (f" {r[key]:>18,.3f}" if "/" in key else f" {r[key]:>18,.0f}" for key in columns)
        print(f"{r['row']:<36}" + "".join(cells))
    print("peak resident set of a bench process, MiB: " + ", ".join(f"{k} {v:,.0f}" for k, v in peaks.items()))
    write_json(out, {"machine": runs["glibc"][0]["machine"], "repeats": repeats, "rows": table, "peak_rss_mb": peaks})


if __name__ == "__main__":
    main()
