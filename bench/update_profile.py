"""Where a training update's time goes on this machine: torch.profiler over a few updates.

Run from the repository root (under a minute on 2 cores):

    python -m bench.update_profile [--vocab-dir data/vocab] [--rdrop 5.0] [--share 1.0] [--masks ours]
        [--updates 4] [--rows 15]

The update is training's (bench/common.py: the default recipe's model, batching and label
smoothing; fused Adam) in bf16 where the CPU has it, else fp32, over the token batches of the
corpus in --vocab-dir, else of the synthetic Multi30k-like one, in a process set up as training's
(transformer.kernels.memory.training_memory). --rdrop 0 times the plain update and --share 0.5
R-Drop on half of each batch's sentences; --masks torch draws dropout's masks with torch's
F.dropout instead of transformer.kernels.dropout's. After --warmup untimed updates the profiler
records --updates more.
It prints the ops that took the most time of their own (self CPU time, each op's share of the
whole) and those shares gathered by kind: the matmuls, the draws of dropout's masks (torch's
`bernoulli_`, or the `random_` of ours; our masks' comparison counts with the rest), dtype
casts and copies, and the rest; then the casts and copies by the op that made them (the
first op above each that is not itself a step of a copy: a cast, clone or reshape), which
says where a fusion would take them out. Last, the matmuls' speed in their own time against
the matmul peak of the update's dtype: the MFU the update would reach if its other ops
took no time, the ceiling of fusing them away at this model's shapes; and the update's own MFU,
its matmuls' FLOPs over all its ops' time.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import transformer.kernels.dropout
from bench import common
from transformer.data.batching import Batch
from transformer.kernels.memory import training_memory
from transformer.training.distributed import use_bf16

MASKS = {"torch": lambda x, p, training=True: F.dropout(x, p, training), "ours": transformer.kernels.dropout.dropout}

KINDS = {  # op name -> kind; ops not named here are "the rest"
    "aten::mm": "matmuls",
    "aten::addmm": "matmuls",
    "aten::bmm": "matmuls",
    "aten::bernoulli_": "dropout masks",
    "aten::random_": "dropout masks",
    "aten::copy_": "casts and copies",
}


COPY_PATHS = {  # the ops a copy goes through below the op that asked for it -> what that step is
    "aten::to": "cast",
    "aten::_to_copy": "cast",
    "aten::clone": "clone",
    "aten::contiguous": "clone",
    "aten::reshape": "clone",
    "aten::copy_": "copy",
}


@dataclass
class Profile:
    times: dict[str, float]  # op -> self CPU seconds
    flops: float  # of the matmuls
    copies: dict[str, float]  # "op: how" -> self CPU seconds of the copies that op made


def op_times(step: common.Step, batches: list[Batch], warmup: int) -> Profile:
    """The ops of the updates of batches[warmup:], recorded after the first `warmup` updates."""
    for batch in batches[:warmup]:
        step(batch)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for batch in batches[warmup:]:
            step(batch)
    ops = prof.key_averages()
    copies = Counter()
    for event in prof.events():
        if event.name == "aten::copy_":
            copies[copy_origin(event)] += event.self_cpu_time_total / 1e6
    return Profile(
        {e.key: e.self_cpu_time_total / 1e6 for e in ops},
        sum(e.flops for e in ops if KINDS.get(e.key) == "matmuls"),
        dict(copies),
    )


def copy_origin(event) -> str:
    """Where a copy_ event comes from, as "op: how": the first op above it that is not a step of a
    copy (COPY_PATHS), and the step just below that op (a cast, a clone, or the copy itself)."""
    op = event
    while op.name in COPY_PATHS:
        how = COPY_PATHS[op.name]
        if op.cpu_parent is None:
            return f"(no op above): {how}"
        op = op.cpu_parent
    return f"{op.name.removeprefix('autograd::engine::evaluate_function: ')}: {how}"


def by_kind(times: dict[str, float]) -> dict[str, float]:
    """Each kind's share of the whole time."""
    total = sum(times.values())
    shares = dict.fromkeys([*dict.fromkeys(KINDS.values()), "the rest"], 0.0)
    for op, seconds in times.items():
        shares[KINDS.get(op, "the rest")] += seconds / total
    return shares


@click.command()
@common.VOCAB_DIR
@click.option("--rdrop", type=click.FloatRange(min=0.0), default=5.0, show_default=True, help="R-Drop's α; 0: plain")
@click.option(
    "--share",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True),
    default=1.0,
    show_default=True,
    help="The share of each batch's sentences R-Drop passes twice (train.rdrop_share)",
)
@click.option(
    "--masks",
    type=click.Choice(["ours", "torch"]),
    default="ours",
    show_default=True,
    help="Whose dropout masks the model draws.",
)
@click.option("--updates", type=click.IntRange(min=1), default=4, show_default=True, help="Updates profiled.")
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=30,
    show_default=True,
    help="Untimed updates first: enough that oneDNN has built most row buckets' kernels, as in training.",
)
@click.option("--rows", type=click.IntRange(min=1), default=15, show_default=True, help="Ops listed.")
def main(vocab_dir: Path | None, rdrop: float, share: float, masks: str, updates: int, warmup: int, rows: int) -> None:
    """Prints where an update's CPU time goes; see the module docstring."""
    bf16 = use_bf16("auto", torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        data = common.load_data(vocab_dir, Path(tmp))
        batches = common.training_batches(data.corpus, warmup + updates)["token batches"]
    step = common.ours_step(data, common.SIZES["small"], bf16, rdrop=rdrop, share=share)
    transformer.kernels.dropout.dropout = MASKS[masks]
    try:
        found = op_times(step, batches, warmup)
    finally:
        transformer.kernels.dropout.dropout = MASKS["ours"]
    peak = common.matmul_peak(torch.bfloat16 if bf16 else torch.float32, seconds=2.0)
    times, total = found.times, sum(found.times.values())
    print(
        f"{data.origin}; {'bf16' if bf16 else 'fp32'}; R-Drop α {rdrop}"
        f"{f' on {share:.0%} of the sentences' if rdrop and share < 1 else ''}; "
        f"{masks}'s dropout masks; "
        f"{torch.get_num_threads()} threads; {updates} updates, {total / updates * 1e3:,.0f} ms of CPU time each"
    )
    for op, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {op:<40} {seconds / total:6.1%}")
    print("by kind:", ", ".join(f"{kind} {share:.1%}" for kind, share in by_kind(times).items()))
    print("casts and copies by the op that made them:")
    for origin, seconds in sorted(found.copies.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {origin:<60} {seconds / total:6.1%}")
    matmuls = found.flops / 1e9 / sum(seconds for op, seconds in times.items() if KINDS.get(op) == "matmuls")
    print(
        f"matmuls: {matmuls:,.0f} GFLOP/s in their own time, {matmuls / peak:.1%} of the matmul peak "
        f"({peak:,.0f} GFLOP/s): the update's MFU if nothing else took time; "
        f"the update: {found.flops / 1e9 / total / peak:.1%} MFU"
    )


if __name__ == "__main__":
    training_memory()  # as training sets up its process: mimalloc, oneDNN's kernel cache
    main()
