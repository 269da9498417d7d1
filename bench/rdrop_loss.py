"""What blocking R-Drop's loss buys on a CPU: its loss alone and whole R-Drop updates, with the
loss worked on whole (one block of every row) against blocks of transformer.training.loss._BLOCK values.

Run from the repository root (under a minute on 2 cores):

    python bench/rdrop_loss.py [--vocab-dir data/vocab] [--reps 5]

The batches are bench.py's token batches (train.max_tokens of params.yaml) of the corpus in
--vocab-dir, else of its synthetic Multi30k-like one; the model is bench.py's small size (the
default recipe's), R-Drop α 5, bf16 where the CPU has it, else fp32. The loss rows time its
forward and backward on random logits of one batch's two passes, in the dtype the generator
gives them under autocast; the update rows time bench.py's update. The ways take turns call by
call in one process, after a warm-up, with freed memory kept for reuse as training keeps it;
medians are printed. Both ways give the same gradient bit for bit (tests/test_loss.py), so
only the time differs.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import transformer.training.loss  # noqa: E402
from transformer.data.vocab import PAD  # noqa: E402
from transformer.kernels.memory import keep_freed_memory  # noqa: E402
from transformer.training.distributed import use_bf16  # noqa: E402

WHOLE = 1 << 62  # a block larger than any batch: the loss in one piece
BLOCKS = {"whole": WHOLE} | {f"2^{k}": 1 << k for k in (15, 16, 17, 18, 19, 20)}
DEFAULT = transformer.training.loss._BLOCK  # training's


def rdrop_loss(logits: torch.Tensor, target: torch.Tensor, block: int) -> None:
    """Forward and backward of R-Drop's loss in blocks of `block` values."""
    transformer.training.loss._BLOCK = block
    x = logits.detach().requires_grad_()
    loss = transformer.training.loss._RDrop.apply(x, target, PAD, bench.PARAMS.train.label_smoothing, 5.0, False)
    (loss / len(target)).backward()


@click.command()
@bench.VOCAB_DIR
@click.option("--reps", type=int, default=5, show_default=True, help="Timed calls of each way, taking turns.")
def main(vocab_dir: Path | None, reps: int) -> None:
    """Prints milliseconds per loss and per update, whole and blocked; see the module docstring."""
    keep_freed_memory()  # as training does
    bf16 = use_bf16("auto", torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        data = bench.load_data(vocab_dir, Path(tmp))
        batches = bench.training_batches(data.corpus, 2 + reps)["token batches"]
    print(f"{data.origin}; {'bf16' if bf16 else 'fp32'}; {torch.get_num_threads()} threads")

    batch = batches[0]
    target = batch.tgt_out[batch.tgt_out != PAD].repeat(2)
    g = torch.Generator().manual_seed(bench.SEED)
    logits = (3 * torch.randn(len(target), data.tgt_vocab, generator=g)).to(torch.bfloat16 if bf16 else torch.float32)
    ms = bench.alternating_ms(
        {name: lambda i, block=block: rdrop_loss(logits, target, block) for name, block in BLOCKS.items()},
        warmup=1,
        reps=reps,
    )
    bench.print_speeds(f"loss of {len(target):,} rows × {data.tgt_vocab:,}, forward and backward (ms):", ms, "whole")

    size, blocks = bench.SIZES["small"], {"whole": WHOLE, f"{DEFAULT:,}": DEFAULT}
    steps = {}
    for name, block in blocks.items():
        transformer.training.loss._BLOCK = block
        steps[name] = bench.ours_step(data, size, bf16, rdrop=5.0)

    def update(name: str) -> Callable[[int], None]:
        def run(i: int) -> None:
            transformer.training.loss._BLOCK = blocks[name]
            steps[name](batches[i])

        return run

    ms = bench.alternating_ms({name: update(name) for name in blocks}, warmup=2, reps=reps)
    bench.print_speeds(
        f"R-Drop updates of the {size.name} model ({reps} batches, ms), whole and in training's blocks:", ms, "whole"
    )


if __name__ == "__main__":
    main()
