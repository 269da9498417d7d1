"""Training speed and memory on glibc's malloc (freed blocks kept, as training tunes it there)
against mimalloc (what training preloads where it is installed), side by side in one run.

Run from the repository root (about 4 minutes on 2 cores with the defaults):

    python bench/allocators.py [--rows cexy] [--repeats 3] [--out reports/allocators.json]

A process's malloc is fixed when it starts, so each turn is a fresh `bench.py --quick --rows ...`,
the allocators taking turns, `--repeats` times each. It prints each training row's median target
tokens/s on either malloc, mimalloc's ratio to glibc's, and each process's peak resident set.
The environment is passed on, so MIMALLOC_* options apply to the mimalloc turns.
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
from transformer.memory import ALLOCATOR_ENV, mimalloc_library  # noqa: E402

ALLOCATORS = {"glibc": {ALLOCATOR_ENV: "glibc"}, "mimalloc": {}}


def bench_once(rows: str, env: dict[str, str], out: Path) -> dict:
    """One quick bench.py process over the training rows `rows`: its JSON report."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--quick", "--rows", rows, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summary(runs: dict[str, list[dict]]) -> list[dict]:
    """Per training row: the median tokens/s on each malloc and mimalloc's ratio to glibc's."""
    speeds: dict[str, dict[str, list[float]]] = {}
    for name, reports in runs.items():
        for report in reports:
            for row in report["train"]:
                speeds.setdefault(f"{row['key']}. {row['row']}", {}).setdefault(name, []).append(row["tokens_per_s"])
    table = []
    for row, by in speeds.items():
        medians = {name: statistics.median(v) for name, v in by.items()}
        table.append({"row": row, **medians, "ratio": round(medians["mimalloc"] / medians["glibc"], 3)})
    return table


@click.command()
@click.option("--rows", default="cexy", show_default=True, help="bench.py's training rows, by key")
@click.option("--repeats", default=3, show_default=True, help="turns of each malloc")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=ROOT / "reports" / "allocators.json")
def main(rows: str, repeats: int, out: Path) -> None:
    """glibc's malloc against mimalloc, bench.py's training rows in turns; see the module docstring."""
    if mimalloc_library() is None:
        raise click.ClickException("mimalloc is not installed (pip install cmeel-mimalloc, on Linux)")
    runs: dict[str, list[dict]] = {name: [] for name in ALLOCATORS}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(repeats):
            for name, extra in ALLOCATORS.items():
                env = {k: v for k, v in os.environ.items() if k != ALLOCATOR_ENV} | extra
                report = bench_once(rows, env, Path(tmp) / f"{name}{turn}.json")
                assert report["machine"]["allocator"] == name, report["machine"]["allocator"]
                runs[name].append(report)
    table = summary(runs)
    peaks = {name: max(r["machine"]["peak_rss_mb"] for r in reports) for name, reports in runs.items()}
    print(f"{'row':<36} {'glibc tok/s':>12} {'mimalloc tok/s':>15} {'ratio':>6}")
    for r in table:
        print(f"{r['row']:<36} {r['glibc']:>12,.0f} {r['mimalloc']:>15,.0f} {r['ratio']:>6.3f}")
    print("peak resident set of a bench process, MiB: " + ", ".join(f"{k} {v:,.0f}" for k, v in peaks.items()))
    write_json(out, {"machine": runs["glibc"][0]["machine"], "repeats": repeats, "rows": table, "peak_rss_mb": peaks})


if __name__ == "__main__":
    main()
