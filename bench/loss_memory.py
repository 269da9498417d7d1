"""What fusing the generator and the loss saves on a CPU: the peak memory and time of one loss
forward and backward, the whole loss (every logit at once) against the fused one
(transformer.training.loss._Fused, a chunk of rows at a time), at the paper's batch size.

Run from the repository root (a few minutes on 2 cores; the whole loss needs about 15 GB):

    python bench/loss_memory.py [--tokens 25000] [--vocab 37000] [--d-model 512] [--reps 2]

The loss is token_loss (label smoothing 0.1) of --tokens target tokens, and rdrop_loss (α 5) of
--tokens rows: two passes of half as many tokens. Its input is random decoder states (tokens,
d_model) and a bias-free generator (vocab, d_model), in fp32, and under bf16 autocast where the
CPU has bf16. "whole" is the loss with transformer.training.loss.FUSE_ABOVE out of reach, "fused" with it
at 0; the first line printed says which of the two the code takes at this size by itself.

Each case runs in a fresh process, so that one case's freed memory is not another's: there the
inputs are made, the resident set read (VmRSS of /proc/self/status), one forward and backward
run, and the high-water mark of the resident set read (VmHWM). The peak is their difference:
the most memory the call held at once beyond its inputs, gradients included, as the kernel
counted the pages it touched (glibc hands freed blocks this large back at once). Then --reps
more calls; every call is timed, the first too (it faults its memory in, as a training step's loss
does after each release of freed memory), and the median printed. Linux only (/proc).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import torch
from torch import nn

import transformer.training.loss
from transformer.data.vocab import PAD
from transformer.training.distributed import use_bf16

LOSSES = ("token_loss", "rdrop_loss")
PATHS = {"whole": 1 << 62, "fused": 0}  # FUSE_ABOVE: never, always
LENGTH = 50  # target positions a sentence, none of them padding


def proc_mb(key: str, path: str = "/proc/self/status") -> float:
    """A figure of /proc in MB: VmRSS (now) or VmHWM (the most since the process began) of this
    process, or MemAvailable of /proc/meminfo."""
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path(path).read_text(), re.M).group(1)) / 1024


def generator_only(d_model: int, vocab: int) -> nn.Module:
    """All of a model the loss reads: its generator, bias-free as the Transformer's."""
    model = nn.Module()
    model.generator = nn.Linear(d_model, vocab, bias=False)
    return model


def run_case(loss: str, path: str, bf16: bool, tokens: int, vocab: int, d_model: int, reps: int) -> dict:
    """Peak MB beyond the inputs of one forward and backward, and the median seconds of it and --reps more."""
    transformer.training.loss.FUSE_ABOVE = PATHS[path]
    g = torch.Generator().manual_seed(0)
    model = generator_only(d_model, vocab)
    passes = 2 if loss == "rdrop_loss" else 1
    tgt_out = torch.randint(PAD + 1, vocab, (tokens // passes // LENGTH, LENGTH), generator=g)
    hidden = torch.randn(passes * tgt_out.size(0), LENGTH, d_model, generator=g).requires_grad_()
    args = (0.1, 5.0) if passes == 2 else (0.1,)

    def call() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            value = getattr(transformer.training.loss, loss)(model, hidden, tgt_out, PAD, *args)
        value.backward()
        hidden.grad = model.generator.weight.grad = None

    before, seconds = proc_mb("VmRSS"), []
    for _ in range(1 + reps):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return {"peak_mb": proc_mb("VmHWM") - before, "s": statistics.median(seconds)}


@click.command()
@click.option("--tokens", type=int, default=25_000, show_default=True, help="Target tokens (rows of logits).")
@click.option("--vocab", type=int, default=37_000, show_default=True, help="The generator's vocabulary.")
@click.option("--d-model", type=int, default=512, show_default=True)
@click.option("--reps", type=int, default=2, show_default=True, help="Calls a case after the first; all are timed.")
@click.option("--case", default=None, hidden=True, help="loss,path,precision: run one case here, print JSON.")
def main(tokens: int, vocab: int, d_model: int, reps: int, case: str | None) -> None:
    """Prints peak MB and seconds a call, whole and fused; see the module docstring."""
    sizes = dict(tokens=tokens, vocab=vocab, d_model=d_model, reps=reps)
    if case:
        loss, path, precision = case.split(",")
        print(json.dumps(run_case(loss, path, precision == "bf16", **sizes)))
        return
    need, free = 3 * 4 * tokens * vocab / 2**20, proc_mb("MemAvailable", "/proc/meminfo")
    if need > free:  # three float32 tensors of every logit: the whole loss's
        raise click.ClickException(f"the whole loss needs about {need:,.0f} MB; {free:,.0f} MB are available")
    precisions = ["fp32"] + (["bf16"] if use_bf16("auto", torch.device("cpu")) else [])
    with torch.device("meta"):  # shapes only
        fuses = transformer.training.loss._fuses(generator_only(d_model, vocab), torch.empty(tokens, d_model))
    chosen = "fused" if fuses else "whole"
    print(f"{tokens:,} rows × {vocab:,} vocabulary (the code takes the {chosen} loss), d_model {d_model}")
    for loss in LOSSES:
        for precision in precisions:
            got = {path: _in_fresh_process(f"{loss},{path},{precision}", sizes) for path in PATHS}
            whole, fused = got["whole"], got["fused"]
            print(
                f"{loss} {precision}: peak {whole['peak_mb']:,.0f} MB whole, {fused['peak_mb']:,.0f} MB fused "
                f"({fused['peak_mb'] / whole['peak_mb']:.3f}×); s a call {whole['s']:.2f} whole, {fused['s']:.2f} fused"
            )


def _in_fresh_process(case: str, sizes: dict[str, int]) -> dict:
    options = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    done = subprocess.run([sys.executable, __file__, *options, "--case", case], capture_output=True, text=True)
    if done.returncode:
        raise click.ClickException(f"case {case} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
