"""On a CUDA GPU: which attention kernels a training update runs, and what each backend costs.

    python bench/gpu_attention.py [--vocab-dir data/vocab] [--batches 60]

Builds the default model (params.yaml) and times R-Drop updates of it in bf16 (fused Adam, as
training does) over the first token batches of build_vocab's training ids, each batch a new shape:
first with the kernels training picks (transformer.attention.attention_kernels), then with
torch's own choice, then with each backend forced (a refused one says why). The first --warmup
batches are not timed. The profile of a few updates under torch's choice names the attention
kernels it ran. cuDNN keeps a plan per shape, so a backend timed after another that planned the
same shapes runs warm: the row order is the one printed. Needs a CUDA device; prints one table."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import click
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer.attention import attention_kernels  # noqa: E402
from transformer.batching import ParallelCorpus, token_batches  # noqa: E402
from transformer.config import load_params  # noqa: E402
from transformer.loss import batch_loss  # noqa: E402
from transformer.model import make_model  # noqa: E402
from transformer.vocab import PAD, load_vocabs  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


@click.command()
@click.option("--vocab-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=Path("data/vocab"),
              show_default=True, help="build_vocab's output: vocab.pt and train.pt")
@click.option("--batches", type=click.IntRange(min=2), default=60, show_default=True, help="token batches per row")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="untimed batches first")
def main(vocab_dir: Path, batches: int, warmup: int) -> None:
    if not torch.cuda.is_available():
        raise click.ClickException("needs a CUDA device")
    device = torch.device("cuda")
    p = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    m, t = p.model, p.train
    src_vocab, tgt_vocab = load_vocabs(vocab_dir)
    corpus = ParallelCorpus(vocab_dir / "train.pt")
    index = token_batches(corpus.src_lens, corpus.tgt_lens, t.max_tokens, t.seed)[:batches]
    data = [corpus.batch(i).to(device) for i in index]
    torch.manual_seed(t.seed)
    model = make_model(len(src_vocab), len(tgt_vocab), m.N, m.d_model, m.d_ff, m.h, m.dropout, m.norm, m.tie_embeddings,
                       PAD).to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    rdrop = t.rdrop or 5.0

    def update(batch) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = batch_loss(model, model, batch, PAD, t.label_smoothing, rdrop)
        (loss / batch.ntokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def ms_per_update(kernels: contextlib.AbstractContextManager) -> float:
        with kernels:
            for batch in data[:warmup]:
                update(batch)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for batch in data[warmup:]:
                update(batch)
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / len(data[warmup:]) * 1e3

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in data[:3]:
            update(batch)
        torch.cuda.synchronize()
    ran = sorted({e.name.split("(")[0] for e in prof.events()
                  if any(k in e.name.lower() for k in ("flash", "fmha", "efficient", "cudnn", "attention", "sdpa"))})
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; the default model, R-Drop α {rdrop}, bf16, "
          f"{t.max_tokens}-token batches, {len(data) - warmup} timed")
    print("attention kernels under torch's choice:", *ran[:8], sep="\n  ")
    rows = [("training's choice", lambda: attention_kernels(device, True)), ("torch's choice", contextlib.nullcontext)]
    rows += [(name, lambda b=backend: sdpa_kernel(b)) for name, backend in BACKENDS.items()]
    for name, kernels in rows:
        try:
            print(f"{name:18} {ms_per_update(kernels()):8.2f} ms an update")
        except RuntimeError as e:
            print(f"{name:18} refused: {str(e).splitlines()[0][:120]}")
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
