"""A profiled window of training updates, device work only, summed by kernel category and by the
phase of the update that launched it; bench/gpu_check.py reports it beside its unprofiled timings."""

from __future__ import annotations

import itertools
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

PHASE = "gpu_check::"  # the prefix of the update's record_function ranges, so they never meet an op's name
PHASES = ("forward", "loss", "backward", "step")
WAIT, WARMUP, ACTIVE = 1, 1, 2  # the profiler's schedule: only the ACTIVE updates are recorded

# A kernel's category by its lowercased name, first match wins. CUDA's kernels (cuBLAS, CUTLASS,
# flash attention, ATen's elementwise kernels), Triton's fused kernels (torch.compile names them
# after the ops they fuse, so one that fuses a log-softmax with a cast counts as the loss, and one
# that fuses dropout, a residual add and a layer norm as the norm), and in a dry run the CPU's
# aten ops. The loss precedes attention because both hold a softmax, and memory copies and
# anything unnamed fall to "other". Eager, the fused loss's kernels carry no name of their own
# (a softmax, an exp, a sum): those it launches in the loss phase count as the loss, all but its
# matmuls, the generator's, which stay GEMM (by_category).
CATEGORIES = (
    ("loss", r"log_?softmax|nll_loss|cross_entropy"),
    ("norm", r"layer_?norm"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|\b(add|b)?mm\b|matmul"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_|reduce|aten::"),
)


def phase(name: str):
    """The record_function range that marks a phase of the update (one of PHASES) for the profile."""
    return record_function(PHASE + name)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((what for what, pattern in CATEGORIES if re.search(pattern, name)), "other")


def by_category(kernel: str, in_phase: str) -> str:
    """The kernel's category by its name, except that a kernel of the loss phase other than a
    matmul counts as the loss."""
    what = category(kernel)
    return "loss" if in_phase == "loss" and what != "GEMM" else what


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_work(events: Sequence[Any], device: torch.device) -> list[tuple[str, float | None, float]]:
    """(name, start on the host's clock, µs) of every piece of device work. On CUDA, every kernel
    and copy the profiler saw on the device (its user-annotation ranges drawn there left out, as
    torch's own totals leave them), placed at the host time of the op that launched it, so that it
    counts in the phase that launched it however late it ran; a backward kernel launched on
    autograd's own thread still falls within the main thread's backward range, which waits for it.
    None where no op is linked. On a CPU, each aten op's own time: the CPU's kernels, without the
    profiler's ranges and autograd's wrappers around them."""
    if device.type == "cuda":
        launched = {e.id: e.time_range.start for e in events if e.device_type.name == "CPU" and e.id}  # 0: none
        kernels = [e for e in events if e.device_type.name == "CUDA" and not e.is_user_annotation]
        return [(e.name, launched.get(e.linked_correlation_id), e.time_range.elapsed_us()) for e in kernels]
    return [(e.name, e.time_range.start, e.self_cpu_time_total) for e in events if e.name.startswith("aten::")]


def profiled(update: Callable[[Any], None], updates: Sequence[Any], device: torch.device) -> dict[str, Any]:
    """ms of device work an update, by category and by phase, over the ACTIVE updates of a profiled
    window; the share of their wall time the device waited on the host; the kernels that took the
    most time, and the attention kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    window = list(itertools.islice(itertools.cycle(updates), WAIT + WARMUP + ACTIVE))
    with profile(activities=activities, schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1)) as prof:
        for i, micro in enumerate(window):
            if i == WAIT + WARMUP:
                sync(device)
                start = time.perf_counter()
            update(micro)
            if i == len(window) - 1:
                sync(device)
                wall = time.perf_counter() - start
            prof.step()
    events = prof.events()
    # the host's ranges only: under CUDA the profiler also draws each range on the device's timeline
    spans = [(e.name.removeprefix(PHASE), e.time_range) for e in events if host_range(e)]
    categories, phases, names = Counter(), Counter(), Counter()
    for name, at, us in device_work(events, device):
        in_phase = next((p for p, r in spans if at is not None and r.start <= at <= r.end), "outside the phases")
        categories[by_category(name, in_phase)] += us
        phases[in_phase] += us
        names[name] += us
    busy = sum(categories.values()) / 1e6
    return {
        "profiled_updates": ACTIVE,
        "device_ms_by_category": ms_per_update(categories),
        "device_ms_by_phase": ms_per_update(phases),
        "device_busy_ms_per_update": round(1000 * busy / ACTIVE, 3),
        "waits_on_host_share": round(max(0.0, 1 - busy / wall), 3),
        "top_kernels": [name[:100] for name, _ in names.most_common(8)],
        "attention_kernels": sorted({name[:100] for name in names if category(name) == "attention"})[:8],
    }


def host_range(event: Any) -> bool:
    return event.name.startswith(PHASE) and event.device_type.name == "CPU"


def ms_per_update(us: Counter) -> dict[str, float]:
    return {key: round(value / 1000 / ACTIVE, 3) for key, value in sorted(us.items())}
