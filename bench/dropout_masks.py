"""What transformer.kernels.dropout's CPU masks buy: dropout and whole training updates with torch's
masks (F.dropout) against ours, taking turns in one process.

Run from the repository root (about a minute on 2 cores):

    python bench/dropout_masks.py [--vocab-dir data/vocab] [--reps 5] [--precision fp32]

The batches are bench.py's token batches (train.max_tokens of params.yaml) of the corpus in
--vocab-dir, else of its synthetic Multi30k-like one; the model is bench.py's small size (the
default recipe's, dropout 0.1), in --precision (auto: bf16 where the CPU has it), with freed memory kept
as training keeps it. The first rows time one dropout, forward and backward, of a batch's
residual stream (its target tokens × d_model, R-Drop's two passes); the others time bench.py's
update without R-Drop and with it (α 5). Medians of --reps calls after a warm-up. The two ways
draw different masks, so their losses differ; their cost is what is compared.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import click
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import transformer.kernels.dropout  # noqa: E402
from transformer.config import CHOICES  # noqa: E402
from transformer.data.vocab import PAD  # noqa: E402
from transformer.kernels.memory import keep_freed_memory  # noqa: E402
from transformer.training.distributed import use_bf16  # noqa: E402

WAYS = {"torch": lambda x, p, training=True: F.dropout(x, p, training), "ours": transformer.kernels.dropout.dropout}


def with_masks(way: str, run: Callable[[int], object]) -> Callable[[int], None]:
    """`run`, with the model's dropout drawing `way`'s masks."""

    def call(i: int) -> None:
        transformer.kernels.dropout.dropout = WAYS[way]
        run(i)

    return call


@click.command()
@bench.VOCAB_DIR
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True, help="Timed calls of each way.")
@click.option(
    "--precision",
    type=click.Choice(CHOICES["train.precision"]),
    default="auto",
    show_default=True,
    help="As train.precision: auto is bf16 where the CPU has it, else fp32.",
)
def main(vocab_dir: Path | None, reps: int, precision: str) -> None:
    """Prints milliseconds per dropout and per update with either way's masks; see the module docstring."""
    keep_freed_memory()  # as training does
    bf16 = use_bf16(precision, torch.device("cpu"))
    size = bench.SIZES["small"]
    with tempfile.TemporaryDirectory() as tmp:
        data = bench.load_data(vocab_dir, Path(tmp))
        batches = bench.training_batches(data.corpus, 2 + reps)["token batches"]
    print(f"{data.origin}; {'bf16' if bf16 else 'fp32'}; {torch.get_num_threads()} threads")
    try:
        tokens = 2 * int((batches[0].tgt_out != PAD).sum())
        x = torch.randn(tokens, size.d_model, dtype=torch.bfloat16 if bf16 else torch.float32, requires_grad=True)

        def one_dropout(i: int) -> None:
            transformer.kernels.dropout.dropout(x, 0.1).backward(torch.ones_like(x))

        ms = bench.alternating_ms({way: with_masks(way, one_dropout) for way in WAYS}, warmup=2, reps=10 * reps)
        bench.print_speeds(f"one dropout of {tokens:,} × {size.d_model}, forward and backward (ms):", ms, "torch")
        for rdrop in (0.0, bench.RDROP):
            steps = {way: bench.ours_step(data, size, bf16, rdrop=rdrop) for way in WAYS}
            runs = {way: with_masks(way, lambda i, way=way: steps[way](batches[i])) for way in WAYS}  # noqa: B023 (timed here)
            ms = bench.alternating_ms(runs, warmup=2, reps=reps)
            bench.print_speeds(f"updates of the {size.name} model, R-Drop α {rdrop} ({reps} batches, ms):", ms, "torch")
    finally:
        transformer.kernels.dropout.dropout = WAYS["ours"]


if __name__ == "__main__":
    main()
