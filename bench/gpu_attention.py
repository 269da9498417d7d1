"""On a CUDA GPU: which attention kernels a training update runs, and what each backend costs.

    python -m bench.gpu_attention [--vocab-dir data/vocab] [--batches 60]

Builds the model of params.yaml's size and times bench/common.py's R-Drop update of it in bf16 (fused
Adam, as training does) over the first token batches of build_vocab's training ids, each batch a new shape:
first with the kernels training picks (transformer.kernels.accelerate.attention_backends), then with
torch's own choice, then with each backend forced (a refused one says why). The first --warmup
batches of each row are not timed. The profile of a few updates under torch's choice names the
attention kernels it ran. Before the rows, one untimed pass over every batch with training's
kernels meets each shape once, so every row finds the matrix products and the allocator warm and
differs from the others in attention alone. cuDNN keeps a plan per shape, so its rows differ in
whether it had planned the shapes: torch's choice plans them, and the cudnn row after it runs
warm. Needs a CUDA device; prints one table."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import click
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from bench import common
from transformer.kernels.accelerate import attention_backends

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


@click.command()
@click.option(
    "--vocab-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=Path("data/vocab"),
    show_default=True,
    help="build_vocab's output: vocab.pt and train.pt",
)
@click.option("--batches", type=click.IntRange(min=2), default=60, show_default=True, help="token batches per row")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="untimed batches first")
def main(vocab_dir: Path, batches: int, warmup: int) -> None:
    if not torch.cuda.is_available():
        raise click.ClickException("needs a CUDA device")
    device = torch.device("cuda")
    m, t = common.PARAMS.model, common.PARAMS.train
    data = common.load_data(vocab_dir, Path())  # a vocab dir: no synthetic corpus is written
    batches_on_device = [b.to(device) for b in common.training_batches(data.corpus, batches)["token batches"]]
    rdrop = t.rdrop or common.RDROP
    # The default kernel: each row's context below picks the backend.
    update = common.ours_step(
        data,
        common.Size("params.yaml", m.N, m.d_model, m.d_ff, m.h),
        True,
        default_kernel=True,
        rdrop=rdrop,
        device=device,
    )

    def run(some: list[torch.Tensor]) -> None:
        for batch in some:
            update(batch)
        torch.cuda.synchronize()

    def ms_per_update(kernels: contextlib.AbstractContextManager) -> float:
        with kernels:
            run(batches_on_device[:warmup])
            start = time.perf_counter()
            run(batches_on_device[warmup:])
        return (time.perf_counter() - start) / len(batches_on_device[warmup:]) * 1e3

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(batches_on_device[:3])
    ran = sorted(
        {
            e.name.split("(")[0]
            for e in prof.events()
            if any(k in e.name.lower() for k in ("flash", "fmha", "efficient", "cudnn", "attention", "sdpa"))
        }
    )
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; the model of params.yaml's size, "
        f"R-Drop α {rdrop}, bf16, "
        f"{t.max_tokens}-token batches, {len(batches_on_device) - warmup} timed"
    )
    print("attention kernels under torch's choice:", *ran[:8], sep="\n  ")
    with attention_backends(device):
        run(batches_on_device)
    rows = [("training's choice", lambda: attention_backends(device)), ("torch's choice", contextlib.nullcontext)]
    rows += [(name, lambda b=backend: sdpa_kernel(b)) for name, backend in BACKENDS.items()]
    for name, kernels in rows:
        try:
            print(f"{name:18} {ms_per_update(kernels()):8.2f} ms an update")
        except RuntimeError as e:
            print(f"{name:18} refused: {str(e).splitlines()[0][:120]}")
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
