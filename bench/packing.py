"""Where packing pays: training tokens/s with every side padded against every side packed
(transformer.kernels.packing), by the share of a batch's positions that hold real tokens.

Run from the repository root (about 3 minutes on 2 cores):

    python bench/packing.py [--size small] [--steps 6]

Each batch holds 3,000 positions per side (train.max_tokens), 100 sentences padded to 30,
source and target at the same fill, random ids of a joint vocabulary of 8,000. The two
ways alternate fill by fill, each after warm-up, in one process; the update is bench.py's
(Adam, label smoothing 0.1, dropout 0.1), fp32 and bf16. The crossover sets
transformer.kernels.packing.PACK_BELOW.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import transformer.kernels.packing  # noqa: E402
from transformer.data.batching import Batch  # noqa: E402
from transformer.data.vocab import BOS, EOS, PAD  # noqa: E402

ROWS, LENGTH, VOCAB = 100, 30, 8000
FILLS = (0.45, 0.6, 0.75, 0.85, 0.9, 0.95, 1.0)
WAYS = {"padded": 0.0, "packed": 2.0}  # PACK_BELOW: never, always


def lengths(fill: float, g: torch.Generator) -> torch.Tensor:
    """ROWS lengths in [1, LENGTH], the longest LENGTH, averaging about fill * LENGTH."""
    low = max(2 * fill - 1, 0.0)
    high = min(2 * fill, 1.0)
    n = (LENGTH * (low + (high - low) * torch.rand(ROWS, generator=g))).round().clamp(1, LENGTH).long()
    n[0] = LENGTH
    return n


def padded_batch(fill: float, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def side(n: torch.Tensor) -> torch.Tensor:
        """Random ids ending in </s>, right-padded."""
        ids = torch.randint(4, VOCAB, (ROWS, LENGTH), generator=g)
        ids[torch.arange(ROWS), n - 1] = EOS
        return ids.masked_fill(torch.arange(LENGTH) >= n[:, None], PAD)

    src_n, tgt_n = lengths(fill, g), lengths(fill, g)
    tgt = side(tgt_n)
    tgt_in = torch.cat([torch.full((ROWS, 1), BOS), tgt[:, :-1]], 1).masked_fill(tgt == PAD, PAD)
    return Batch(side(src_n), tgt_in, tgt, int(tgt_n.sum()))


def tokens_per_s(step, batches: list[Batch], warmup: int) -> float:
    """bench.py's timing, over every batch after the warm-up."""
    clock, timed = bench.time_training(step, batches, warmup, seconds=float("inf"))
    return sum(b.ntokens for b in timed) / clock.seconds


@click.command()
@click.option("--size", type=click.Choice(sorted(bench.SIZES)), default="small", show_default=True)
@click.option("--steps", type=int, default=6, show_default=True, help="Timed updates per fill and way.")
def main(size: str, steps: int) -> None:
    """Prints target tokens/s padded and packed at each fill; see the module docstring."""
    data = bench.Data(None, VOCAB, VOCAB, True, "synthetic")
    print(f"{'dtype':<5} {'fill':>5} {'padded tok/s':>13} {'packed tok/s':>13} {'packed/padded':>14}")
    for dtype in ("fp32", "bf16"):
        for fill in FILLS:
            batches = [padded_batch(fill, seed) for seed in range(steps + 2)]
            speed = {}
            for way, threshold in WAYS.items():
                transformer.kernels.packing.PACK_BELOW = threshold
                speed[way] = tokens_per_s(bench.ours_step(data, bench.SIZES[size], dtype == "bf16"), batches, 2)
            real = sum(b.ntokens for b in batches) / sum(b.tgt_out.numel() for b in batches)
            print(
                f"{dtype:<5} {real:>5.2f} {speed['padded']:>13,.0f} {speed['packed']:>13,.0f} "
                f"{speed['packed'] / speed['padded']:>13.2f}×",
                flush=True,
            )


if __name__ == "__main__":
    main()
