"""Training updates with packing.Linear's rows bucketed (training's way) against the rows as they
come, each arm in a process of its own, taking turns.

Run from the repository root (about 4 minutes on 2 cores with the defaults and real data):

    python bench/row_buckets.py [--vocab-dir data/vocab] [--rdrop 10 --share 0.5] [--turns 2]

Where a CPU runs a matmul in bf16, oneDNN builds a kernel for each shape it meets and keeps it in a
cache of the process (transformer/kernels/memory.py), and token batches bring new row counts with every
update; so each arm is a fresh process (set up as training's: transformer.kernels.memory.training_memory),
which runs --warmup untimed updates of the corpus's token batches, then times --updates more, each
batch new. The default recipe's model and loss (bench.py's update), in bf16 where the CPU has it.
It prints each arm's milliseconds an update and target tokens/s per turn, their medians, and the
bucketed arm's speed over the other's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from transformer.kernels import packing  # noqa: E402
from transformer.kernels.memory import training_memory  # noqa: E402
from transformer.training.distributed import use_bf16  # noqa: E402

ARMS = ("unbucketed", "bucketed")  # the second is compared with the first


def time_updates(vocab_dir: Path | None, rdrop: float, share: float, warmup: int, updates: int) -> dict:
    """ms an update and target tokens/s of `updates` updates after `warmup`, each on a batch of its own."""
    bf16 = use_bf16("auto", torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        data = bench.load_data(vocab_dir, Path(tmp))
        batches = bench.training_batches(data.corpus, warmup + updates)["token batches"]
    step = bench.ours_step(data, bench.SIZES["small"], bf16, rdrop=rdrop, share=share)
    for batch in batches[:warmup]:
        step(batch)
    timed = batches[warmup:]
    start = time.perf_counter()
    for batch in timed:
        step(batch)
    seconds = time.perf_counter() - start
    return {"ms_per_update": 1e3 * seconds / len(timed), "tokens_per_s": sum(b.ntokens for b in timed) / seconds}


def summary(runs: dict[str, list[dict]]) -> dict:
    """Each arm's median ms an update and tokens/s, and the second arm's tokens/s over the first's."""
    medians = {
        arm: {key: statistics.median(run[key] for run in turns) for key in ("ms_per_update", "tokens_per_s")}
        for arm, turns in runs.items()
    }
    first, second = runs
    return medians | {"speedup": round(medians[second]["tokens_per_s"] / medians[first]["tokens_per_s"], 3)}


@click.command()
@bench.VOCAB_DIR
@bench.rdrop_options(0.0)
@click.option("--warmup", type=click.IntRange(min=0), default=30, show_default=True, help="Untimed updates first.")
@click.option("--updates", type=click.IntRange(min=1), default=40, show_default=True, help="Updates timed.")
@click.option("--turns", type=click.IntRange(min=1), default=2, show_default=True, help="Processes of each arm.")
@click.option("--arm", type=click.Choice(ARMS), default=None, help="Run this arm here (what each turn's process does).")
def main(
    vocab_dir: Path | None, rdrop: float, share: float, warmup: int, updates: int, turns: int, arm: str | None
) -> None:
    """Prints the two arms' speeds; see the module docstring."""
    args = ["--rdrop", str(rdrop), "--share", str(share), "--warmup", str(warmup), "--updates", str(updates)]
    args += ["--vocab-dir", str(vocab_dir)] if vocab_dir else []
    if arm is not None:
        bucket = packing.row_bucket
        if arm == "unbucketed":
            packing.row_bucket = lambda rows: rows
        try:
            print(json.dumps(time_updates(vocab_dir, rdrop, share, warmup, updates)))
        finally:
            packing.row_bucket = bucket
        return
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    for turn in range(1, turns + 1):
        for name in ARMS:
            done = subprocess.run(
                [sys.executable, __file__, "--arm", name, *args], capture_output=True, text=True, check=True
            )
            runs[name].append(json.loads(done.stdout.splitlines()[-1]))
            print(_line(f"turn {turn} {name}", runs[name][-1]))
    table = summary(runs)
    for name in ARMS:
        print(_line(f"median {name}", table[name]))
    print(f"bucketed / unbucketed: {table['speedup']:.3f}x the tokens/s")


def _line(label: str, run: dict) -> str:
    return f"{label:<20} {run['ms_per_update']:7,.0f} ms an update {run['tokens_per_s']:9,.0f} tok/s"


if __name__ == "__main__":
    training_memory()  # as training sets up its process: mimalloc, oneDNN's kernel cache
    main()
