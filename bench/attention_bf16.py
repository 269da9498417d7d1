"""bf16 training updates with four ways to attend on a CPU, taking turns update by update in one
process: torch's math kernel as torch leaves it, copying bf16 queries, keys and values to float32;
the same kernel in bf16 (torch's switch for bf16 reductions on); attention written out with torch's
bf16 softmax; and attention written out as training computes it on a CPU
(transformer.model.attention.attention_kernels), its softmax in float32 (_Softmax).

Run from the repository root (about 3 minutes on 2 cores with the defaults and real data, 4 with R-Drop):

    python bench/attention_bf16.py [--vocab-dir data/vocab] [--rdrop 10 --share 0.5] [--warmup 30] [--updates 40]
    python bench/attention_bf16.py --softmax-table

--softmax-table times the softmax alone instead, forward and backward, on bf16 scores (B, 4, S, S)
of about 3,000 queries (B x S) for S from 5 to 64, rows of S values: torch's bf16 softmax against
_Softmax (--warmup and --updates calls each, taking turns).

The update is bench.py's (the default recipe's model and loss) in bf16 autocast, over the token
batches of the corpus in --vocab-dir, else of bench.py's synthetic one, each batch new; each arm
trains a model of its own from the same initial weights, in a process set up as training's
(transformer.kernels.memory.training_memory). It prints each arm's median milliseconds an update after
--warmup untimed ones, and its speed against the math kernel's in bf16. Where the CPU has no native
bf16, training runs in float32 and never takes this path; the script still times it, and says so.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import transformer.model.attention  # noqa: E402
from transformer.kernels.memory import training_memory  # noqa: E402
from transformer.model.attention import attention_kernels  # noqa: E402
from transformer.training.distributed import use_bf16  # noqa: E402


@contextlib.contextmanager
def math_in_bf16() -> Iterator[None]:
    """torch's math kernel with its switch for bf16 reductions on (torch names it under cuda; it
    holds on every device), which keeps bf16 queries, keys and values in bf16."""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


@contextlib.contextmanager
def softmax_in_bf16() -> Iterator[None]:
    """Attention written out, as training's, but with torch's softmax of the bf16 scores."""
    softmax = transformer.model.attention._Softmax
    transformer.model.attention._Softmax = _TorchSoftmax
    try:
        with attention_kernels(torch.device("cpu"), True):
            yield
    finally:
        transformer.model.attention._Softmax = softmax


class _TorchSoftmax:
    @staticmethod
    def apply(scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(-1)


ARMS = {  # torch leaves its switch for bf16 math off: the kernel alone copies to float32
    "float32 copies": lambda: sdpa_kernel(SDPBackend.MATH),
    "math in bf16": math_in_bf16,
    "bf16 softmax": softmax_in_bf16,
    "written out": lambda: attention_kernels(torch.device("cpu"), True),
}
LENGTHS = (5, 8, 11, 13, 16, 19, 24, 30, 32, 40, 48, 64)  # --softmax-table's row lengths


def softmax_table_of(warmup: int, reps: int) -> None:
    """Prints the softmax's microseconds, forward and backward, on bf16 scores of each of LENGTHS."""
    threads = torch.get_num_threads()
    print(f"softmax of bf16 scores (B, 4, S, S), about 3,000 queries, forward and backward (µs); {threads} threads")
    print(f"  {'S':>3} {'B':>4} {'torch bf16':>11} {'_Softmax':>9}")
    for length in LENGTHS:
        scores = torch.randn(3000 // length, 4, length, length).bfloat16().requires_grad_()
        grad = torch.randn(scores.shape).bfloat16()
        ways = {"torch": _TorchSoftmax.apply, "ours": transformer.model.attention._Softmax.apply}
        runs = {name: _forward_and_back(way, scores, grad) for name, way in ways.items()}
        us = {name: 1000 * ms for name, ms in bench.alternating_ms(runs, warmup, reps).items()}
        speed = us["torch"] / us["ours"]
        print(f"  {length:>3} {scores.size(0):>4} {us['torch']:>11,.0f} {us['ours']:>9,.0f}   {speed:.2f}×")


def _forward_and_back(softmax, scores: torch.Tensor, grad: torch.Tensor):
    return lambda i: torch.autograd.grad(softmax(scores), scores, grad)  # no pass adding into scores.grad


@click.command()
@bench.VOCAB_DIR
@bench.rdrop_options(0.0)
@click.option("--warmup", type=click.IntRange(min=0), default=30, show_default=True, help="Untimed updates first.")
@click.option("--updates", type=click.IntRange(min=1), default=40, show_default=True, help="Updates timed.")
@click.option(
    "--softmax-table",
    is_flag=True,
    help="Time the softmax alone, over row lengths (--warmup, --updates calls each; no data, no R-Drop).",
)
def main(vocab_dir: Path | None, rdrop: float, share: float, warmup: int, updates: int, softmax_table: bool) -> None:
    """Prints each arm's milliseconds an update; see the module docstring."""
    if softmax_table:
        softmax_table_of(warmup, updates)
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = bench.load_data(vocab_dir, Path(tmp))
        batches = bench.training_batches(data.corpus, warmup + updates)["token batches"]
    native = use_bf16("auto", torch.device("cpu"))
    print(
        f"{data.origin}; {torch.get_num_threads()} threads" + ("" if native else "; no native bf16: training runs fp32")
    )
    steps = {  # the same initial weights (bench.ours_model seeds them)
        arm: bench.ours_step(data, bench.SIZES["small"], True, default_kernel=True, rdrop=rdrop, share=share)
        for arm in ARMS
    }

    def run(arm: str):
        def update(i: int) -> None:
            with ARMS[arm]():
                steps[arm](batches[i])

        return update

    ms = bench.alternating_ms({arm: run(arm) for arm in ARMS}, warmup=warmup, reps=updates)
    what = f"R-Drop α {rdrop}" + (f" on {share:.0%} of the sentences" if share < 1 else "") if rdrop else "no R-Drop"
    bench.print_speeds(f"bf16 updates of the small model, {what} ({updates} batches, ms):", ms, "math in bf16")


if __name__ == "__main__":
    training_memory()  # as training sets up its process: mimalloc, oneDNN's kernel cache
    main()
