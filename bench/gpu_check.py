"""One GPU's check of training at the WMT14 presets' sizes: one budgeted run that fits a ten-minute
command, its JSON report rewritten after every part, so that a kill at any moment keeps every part done.

Run from the repository root, venv active:

    python -m bench.gpu_check [--out reports/gpu_check.json] [--seconds 15] [--budget-s 480]
    python -m bench.gpu_check --dry-run     # no GPU: the same code on the CPU, tiny sizes, 2 updates a row

On cuda:0 it measures, in this order, each part in a try of its own: an exception (a Triton
error, out of memory) is recorded in the part, its type and message, and the run goes on; a part
that would start after --budget-s seconds is recorded as skipped, with the reason.

- peak_tflops: a bf16 and an fp32 matmul's TFLOP/s (fp32 in TF32, as training multiplies it):
  MFU's measured denominator, beside the datasheet's (datasheet_peak, by the card's name);
- train: the base and big models of wmt14_en_de_base and wmt14_en_de_big, eager then compiled,
  an update as training runs it (make_model, make_optimizer, the loss, set_precision's bf16 or
  TF32, training's attention kernels) over token batches of a synthetic WMT-shaped corpus (about
  31 tokens a side, log-normal) at the preset's train.max_tokens and train.accum: unprofiled ms
  an update, target tokens/s, MFU with train_flops (the bench's FLOPs a token) against both
  peaks, real and padded tokens a side an update, peak GPU memory; a profiled window of device
  work by kernel category and by phase of the update (bench/gpu_profile.py); compiled, the
  seconds of compiling, the frames compiled again after the first update, and graph breaks;
- trainer: the train stage (its Trainer, the real loop: batches prefetched, pinned host-to-device
  copies, the losses read back every LOG_EVERY updates) at the base preset's model and batches, on
  the synthetic corpus and a joint BPE vocabulary of the preset's size that sentencepiece learns from
  made-up words in seconds: after one sync window of warm-up, a fixed number of updates with no
  validation or checkpoint among them, their target tokens/s and ms an update by the loop's own
  clock, MFU as the rows reckon it, the loop's wait for batches, and its tokens/s over the eager base
  row's, the share of the update's speed that the real loop keeps;
- loss: the loss of one micro-batch, forward and backward, the fused loss (a CPU's, in eager
  training) and cross-entropy after one generator matmul (a GPU's, eager or compiled);
- attention: source attention over one micro-batch, forward and backward, torch's key-masked
  attention and the variable-length flash kernel that eager training takes on a card flash runs on;
- resume: the train stage (its Trainer, the real loop) on a toy corpus, killed with SIGKILL after
  its first checkpoint and rerun, against an uninterrupted run (the largest weight difference; 0
  is bit-identical), with the loop's own wait for batches from its train.json;
- tests: the suite's CUDA tests (CUDA_TESTS), their counts and exit status, in what is left of
  the budget.

Without a CUDA device it stops with one line, unless --dry-run: then the same code runs on the CPU
with tiny sizes, two timed updates a row (the trainer part: one sync window of the loop's) and
torch.compile's aot_eager backend (no C++ build), so a test can run it in seconds; its figures check
the code, not a machine.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
import torch.nn.functional as F
import yaml
from torch._dynamo.utils import counters

import transformer.training.train
from bench.common import ROOT, Size, train_flops
from bench.gpu_profile import CATEGORIES, phase, profiled, sync
from transformer import checkpoints
from transformer.config import params_from_dict
from transformer.data.batching import Batch, ParallelCorpus, token_batches
from transformer.data.vocab import PAD, BpeVocab, save_vocabs
from transformer.io import write_json, write_lines
from transformer.kernels.accelerate import accelerate, attention_backends, flash_runs
from transformer.kernels.loss import LossSpec, fused_loss
from transformer.kernels.memory import peak_rss_mb
from transformer.kernels.varlen import by_sentence, flash_kernel
from transformer.model.model import make_model
from transformer.presets import recipe
from transformer.training.distributed import autocast_dtype, set_precision
from transformer.training.loss import Loss, smoothed_cross_entropy
from transformer.training.train import LOG_EVERY, StepLoss, epoch_groups, make_optimizer

PRESETS = {"base": "wmt14_en_de_base", "big": "wmt14_en_de_big"}
CUDA_TESTS = (
    "tests/test_fast_paths.py",
    "tests/test_varlen.py",
    "tests/test_scale_out.py",
    "tests/test_distributed.py",
    "tests/test_writer.py",
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# No part starts after this many seconds: a ten-minute command keeps two minutes for the part
# started last, which may be a compile.
BUDGET_S = 480.0
TESTS_AT_LEAST_S = 60  # the CUDA tests' timeout when less of the budget is left
# Dense tensor-core TFLOP/s from the vendors' datasheets by torch.cuda.get_device_name, bf16 (the
# T4 has none: fp16); first match wins, so the PCIe H100 precedes the SXM one ("H100 80GB HBM3"),
# and cards not named here (an H100 or H200 NVL) get none rather than a neighbour's.
DATASHEET = (
    (r"H100.*PCIe", 756.0, "bf16"),
    (r"H100.*(SXM|HBM3)", 989.0, "bf16"),
    (r"H200(?!.*NVL)", 989.0, "bf16"),
    (r"A100", 312.0, "bf16"),
    (r"\bL4\b", 121.0, "bf16"),
    (r"\bT4\b", 65.0, "fp16"),
)


@dataclass(frozen=True)
class Plan:
    """How much to run: the real check's, or the dry run's."""

    device: torch.device
    pairs: int  # of the synthetic corpus
    warmup: int  # untimed updates a row (compile happens there)
    seconds: float  # timed updates until this much time has passed (at least `least` of them)
    least: int
    matmul: int  # the peak's n×n matrices
    tiny: bool  # the tests' sizes instead of the presets'
    backend: str  # torch.compile's
    loop_updates: int  # the trainer part's timed updates, whole sync windows of the loop (LOG_EVERY updates)


def plan_for(dry_run: bool, seconds: float) -> Plan:
    if dry_run:
        return Plan(torch.device("cpu"), 1000, 1, 0.0, 2, 128, True, "aot_eager", LOG_EVERY)  # 69 updates
    # 296 updates of 25k tokens; the trainer part's 240 timed ones (about 7 TFLOP each at the base size) take
    # 5 to 12 s on an H100 at 15 to 35% MFU
    return Plan(torch.device("cuda", 0), 200_000, 4, seconds, 10, 8192, False, "inductor", 12 * LOG_EVERY)


# ---------------------------------------------------------------------------- the presets' runs


def preset_params(name: str, tiny: bool) -> Any:
    """The preset's params; tiny: the tests' model size (twice as wide for big) and batches, every
    other value the preset's."""
    raw = recipe(name, ROOT)
    if tiny:
        width = 16 * raw["model"]["d_model"] // 512
        raw["vocab"]["size"] = 200
        raw["model"].update(N=1, d_model=width, d_ff=2 * width, h=2)
        raw["train"].update(max_tokens=300)
    return params_from_dict(raw, source=name)


def wmt_shaped(path: Path, pairs: int, vocab: int, max_len: int, seed: int = 1) -> ParallelCorpus:
    """A corpus file in the build_vocab stage's format with WMT14 en-de's lengths after BPE: about
    31 tokens a side (log-normal, median 26), the target's length the source's times a log-normal
    ratio; random ids in [4, vocab) (no specials)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.exp(math.log(26) + 0.6 * torch.randn(pairs, generator=g)).round().clamp(1, max_len - 1)
    tgt = (src * torch.exp(0.15 * torch.randn(pairs, generator=g))).round().clamp(1, max_len - 1)
    data = {}
    for side, lens in (("src", src.long()), ("tgt", tgt.long())):
        data[side] = torch.randint(4, vocab, (int(lens.sum()),), generator=g, dtype=torch.int32)
        data[f"{side}_offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    torch.save(data, path)
    return ParallelCorpus(path)


def updates_of(corpus: ParallelCorpus, max_tokens: int, accum: int, count: int, device) -> list[list[Batch]]:
    """`count` updates of `accum` token batches each, as training batches them, on `device`."""
    index = token_batches(corpus.src_lens, corpus.tgt_lens, max_tokens, 1)[: count * accum]
    batches = [corpus.batch(i).to(device) for i in index]
    return [batches[k : k + accum] for k in range(0, len(batches) - accum + 1, accum)]


def model_of(params: Any, vocab: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(1)
    config = {"src_vocab": vocab, "tgt_vocab": vocab, "pad": PAD} | dataclasses.asdict(params.model)
    return make_model(**config).to(device).train()


def update_step(params: Any, vocab: int, device: torch.device, compiled: bool, backend: str):
    """One training update over an update's micro-batches, the loss normalized by its target tokens,
    as transformer.training.train's loop runs it in one process, each phase in its profiler range
    (compiled, the forward's range holds the loss, traced into one graph with it as train.compile
    traces StepLoss); returns bf16's use too."""
    model, t = model_of(params, vocab, device), params.train
    optimizer = make_optimizer(model, t.weight_decay, device)
    step_loss = StepLoss(model, Loss(PAD, t.label_smoothing, t.smoothing_zeroes_pad))
    if compiled:  # as training: the plain step, traced
        whole = transformer.training.train.compiled(step_loss, backend)
    else:
        whole = None
        accelerate(step_loss, device)
    bf16 = set_precision(t.precision, device) == torch.bfloat16  # fp16 is not timed here

    def micro_loss(batch: Batch, tokens: int) -> torch.Tensor:
        if whole is not None:
            with phase("forward"):
                return whole(batch) / tokens
        with phase("forward"):  # StepLoss's own two steps, apart
            hidden = model(batch.src, batch.tgt_in)
        with phase("loss"):
            return step_loss.loss(model.generator, hidden, batch.tgt_out) / tokens

    def update(micro: list[Batch]) -> None:
        tokens = sum(b.ntokens for b in micro)
        for batch in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), attention_backends(device):
                loss = micro_loss(batch, tokens)
                with phase("backward"):
                    loss.backward()
        with phase("step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return update, bf16


def seconds_of(update, micro: list[Batch], device: torch.device) -> float:
    start = time.perf_counter()
    update(micro)
    sync(device)
    return time.perf_counter() - start


def timed(update, updates: list[list[Batch]], plan: Plan, deadline: float) -> tuple[float, list[list[Batch]]]:
    """Seconds of updates until plan.seconds have passed or the budget's deadline (perf_counter's
    clock) has, at least plan.least of them, and those updates."""
    done, start = [], time.perf_counter()
    for micro in updates:
        update(micro)
        done.append(micro)
        now = time.perf_counter()
        if len(done) >= plan.least and (now - start >= plan.seconds or now >= deadline):
            break
    sync(plan.device)
    return time.perf_counter() - start, done


def tokens_a_side(done: list[list[Batch]]) -> dict[str, float]:
    """Real and padded tokens an update of each side the model reads (source, and target with </s>)."""
    figures = {}
    for side, of in (("src", lambda b: b.src), ("tgt", lambda b: b.tgt_out)):
        sides = [of(b) for micro in done for b in micro]
        figures[f"{side}_real_tokens_per_update"] = round(sum(int((s != PAD).sum()) for s in sides) / len(done), 1)
        figures[f"{side}_padded_tokens_per_update"] = round(sum(s.numel() for s in sides) / len(done), 1)
    return figures


def compile_figures(warm: list[float], seconds_per_update: float, frames_after_first: int) -> dict[str, Any]:
    """Compiling's seconds (the warm-up updates' time beyond the steady state's), the frames dynamo
    compiled after the first update (recompiles: a new shape the symbolic trace does not cover), and
    its graph breaks with their reasons' first lines."""
    breaks = counters["graph_break"]
    return {
        "compile_s": round(max(0.0, sum(warm) - len(warm) * seconds_per_update), 2),
        "frames_compiled": counters["frames"]["ok"],
        "recompiles": counters["frames"]["ok"] - frames_after_first,
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": [reason.splitlines()[0][:200] for reason in breaks][:8],
    }


def release_memory(device: torch.device) -> None:
    """Frees what the parts before left on the device: their compiled graphs hold their models, and a
    row that ran out of memory leaves its cache behind."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def train_row(size: str, compiled: bool, plan: Plan, work: Path, deadline: float) -> dict[str, Any]:
    """One size at its preset's batches, compiled or not: speed, tokens, memory, its profiled
    window, and compiling's figures; MFU is added by with_mfu."""
    params = preset_params(PRESETS[size], plan.tiny)
    vocab, t = params.vocab.size, params.train
    corpus = wmt_shaped(work / f"{size}.pt", plan.pairs, vocab, params.tokenize.max_len)
    updates = updates_of(corpus, t.max_tokens, t.accum, plan.warmup + 250, plan.device)
    release_memory(plan.device)  # the rows before would count in its peak
    counters.clear()
    if plan.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(plan.device)
    update, bf16 = update_step(params, vocab, plan.device, compiled, plan.backend)
    warm = [seconds_of(update, updates[0], plan.device)]
    frames_after_first = counters["frames"]["ok"]
    warm += [seconds_of(update, micro, plan.device) for micro in updates[1 : plan.warmup]]
    seconds, done = timed(update, updates[plan.warmup :], plan, deadline)
    shape = Size(size, params.model.N, params.model.d_model, params.model.d_ff, params.model.h)
    flops = sum(train_flops(b, shape, vocab) for micro in done for b in micro)
    tokens = sum(b.ntokens for micro in done for b in micro)
    peak = torch.cuda.max_memory_allocated(plan.device) / 2**30 if plan.device.type == "cuda" else None
    row = {
        "preset": PRESETS[size],
        "dtype": "bf16" if bf16 else "fp32",
        "max_tokens": t.max_tokens,
        "accum": t.accum,
        "updates": len(done),
        "first_update_s": round(warm[0], 3),
        "ms_per_update": round(1000 * seconds / len(done), 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "flops_per_token": round(flops / tokens),
        "flops_per_s": flops / seconds,
        "peak_gpu_memory_gib": None if peak is None else round(peak, 2),
    } | tokens_a_side(done)
    if compiled:
        row |= compile_figures(warm, seconds / len(done), frames_after_first)
    return row | profiled(update, updates[plan.warmup :], plan.device)


def with_mfu(row: dict[str, Any], peaks: dict[str, Any], datasheet: dict[str, Any]) -> dict[str, Any]:
    """MFU as bench.py reckons it, model FLOPs a second over the row's dtype's measured matmul peak,
    and over the card's datasheet peak; None where a peak is unknown."""
    measured, sheet = peaks.get(row["dtype"]), datasheet["tflops"]
    return row | {
        "mfu": None if not measured else round(row["flops_per_s"] / (measured * 1e12), 6),
        "mfu_datasheet": None if sheet is None else round(row["flops_per_s"] / (sheet * 1e12), 6),
    }


def loss_row(plan: Plan) -> dict[str, Any]:
    """The loss of one micro-batch of the base preset, forward and backward, both ways training might
    compute it: the fused loss (kernels/loss.py's fused_loss, the generator a chunk of rows at a time;
    eager training's on a CPU) and cross-entropy after one generator matmul (the plain loss, eager
    training's on a GPU and what train.compile traces). Its rows are every position of a full
    micro-batch, a tenth of them padding; ms, peak GPU memory above the inputs, and how far the two
    losses differ."""
    params = preset_params(PRESETS["base"], plan.tiny)
    t, vocab = params.train, params.vocab.size
    generator = model_of(params, vocab, plan.device).generator
    bf16 = set_precision(t.precision, plan.device) == torch.bfloat16  # fp16 is not timed here
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(t.max_tokens, params.model.d_model, generator=g).to(plan.device).requires_grad_()
    target = torch.randint(4, vocab, (t.max_tokens,), generator=g)
    target = target.masked_fill(torch.rand(t.max_tokens, generator=g) < 0.1, PAD).to(plan.device)
    terms = dict(pad=PAD, smoothing=t.label_smoothing, zero_pad=t.smoothing_zeroes_pad)
    ways = {
        "fused": lambda: fused_loss(generator, hidden, target, LossSpec(**terms)),
        "plain": lambda: smoothed_cross_entropy(generator(hidden).float(), target, **terms),
    }
    row: dict[str, Any] = {"rows": t.max_tokens, "vocab": vocab, "dtype": "bf16" if bf16 else "fp32"}
    losses = {}
    for name, loss_of in ways.items():
        losses[name], ms, peak = timed_loss(loss_of, [hidden, generator.weight], plan, bf16)
        row |= {f"{name}_ms": ms, f"{name}_peak_gpu_memory_gib": peak}
    row["loss_relative_difference"] = abs(losses["fused"] - losses["plain"]) / abs(losses["plain"])
    return row


def attention_row(plan: Plan, work: Path) -> dict[str, Any]:
    """Source attention over a micro-batch of the base preset, forward and backward, both ways training
    might compute it on a GPU: torch's key-masked attention (its memory-efficient kernel: flash takes
    no mask) and the variable-length flash kernel that skips the padding (kernels/varlen.py's
    VarlenAttention, eager training's where flash runs); ms, peak GPU memory above the inputs, and the
    largest difference of the two outputs. Where flash does not run (a CPU, an older card, no bf16),
    the masked way alone."""
    params = preset_params(PRESETS["base"], plan.tiny)
    t, h, d_model = params.train, params.model.h, params.model.d_model
    corpus = wmt_shaped(work / "attention.pt", plan.pairs, params.vocab.size, params.tokenize.max_len)
    batch = updates_of(corpus, t.max_tokens, 1, 1, plan.device)[0][0]
    bf16 = set_precision(t.precision, plan.device) == torch.bfloat16
    dtype = torch.bfloat16 if bf16 else torch.float32
    (B, S), T = batch.src.shape, batch.tgt_in.size(1)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, n, d_model // h, generator=g).to(plan.device, dtype) for n in (T, S, S))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    weights = torch.randn(B, h, T, d_model // h, generator=g).to(plan.device)
    keys = (batch.src != PAD)[:, None, None, :]
    ways = {"masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keys)}
    if bf16 and flash_runs(plan.device):
        ways["varlen"] = lambda: by_sentence(q, k, v, keys, flash_kernel)
    row: dict[str, Any] = {"sentences": B, "source_length": S, "target_length": T, "dtype": "bf16" if bf16 else "fp32"}
    row["real_source_share"] = round(float(keys.float().mean()), 4)
    outputs = {}
    for name, attend in ways.items():
        with attention_backends(plan.device):
            _, ms, peak = timed_loss(lambda attend=attend: (attend().float() * weights).sum(), leaves, plan, bf16)
            outputs[name] = attend().detach().float()
        row |= {f"{name}_ms": ms, f"{name}_peak_gpu_memory_gib": peak}
    varlen = outputs.get("varlen")
    row["varlen_max_difference"] = None if varlen is None else float((varlen - outputs["masked"]).abs().max())
    return row


def timed_loss(loss_of: Callable[[], torch.Tensor], leaves: list[torch.Tensor], plan: Plan, bf16: bool):
    """The loss's value, ms of its forward and backward (after one untimed), and the GPU memory
    it took at its peak beyond what was allocated before it, in GiB (None on a CPU)."""
    cuda = plan.device.type == "cuda"

    def once() -> float:
        for leaf in leaves:
            leaf.grad = None
        with torch.autocast(plan.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of()
        loss.backward()
        return loss.item()  # waits for the device

    value = once()
    if cuda:
        torch.cuda.reset_peak_memory_stats(plan.device)
    before = torch.cuda.memory_allocated(plan.device) if cuda else 0
    reps, start = 0, time.perf_counter()
    while reps < plan.least or time.perf_counter() - start < plan.seconds / 5:
        once()
        reps += 1
    ms = round(1000 * (time.perf_counter() - start) / reps, 3)
    peak = round((torch.cuda.max_memory_allocated(plan.device) - before) / 2**30, 3) if cuda else None
    return value, ms, peak


# ---------------------------------------------------------------------------- peaks, tests, resume


def matmul_peak_tflops(dtype: torch.dtype, plan: Plan, seconds: float = 2.0) -> float:
    """TFLOP/s of an n×n by n×n matmul (2 n³ FLOPs) on the device, repeated after warm-up."""
    n = plan.matmul
    g = torch.Generator(device=plan.device).manual_seed(1)
    a, b = (torch.randn(n, n, generator=g, device=plan.device).to(dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(plan.device)
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < (0.1 if plan.tiny else seconds):
        a @ b
        reps += 1
    sync(plan.device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def measured_peaks(plan: Plan) -> dict[str, float]:
    set_precision("fp32", plan.device)  # the fp32 peak in TF32, as fp32 training multiplies
    # Four significant figures: a dry run's tiny matmul on a busy CPU is well under a GFLOP/s, which a
    # fixed number of decimals could round to a peak of 0.
    return {name: float(f"{matmul_peak_tflops(dtype, plan):.4g}") for name, dtype in DTYPES.items()}


def datasheet_peak(card: str) -> dict[str, Any]:
    """The card's dense TFLOP/s by DATASHEET, and their dtype; None for a card not listed there."""
    found = next(((tflops, dtype) for pattern, tflops, dtype in DATASHEET if re.search(pattern, card)), (None, None))
    return {"card": card, "tflops": found[0], "dtype": found[1]}


def cuda_tests(deadline: float) -> dict[str, Any]:
    """The suite's CUDA tests (and their CPU halves where they have them), in a process of their own,
    given what is left of the budget (TESTS_AT_LEAST_S at least)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-k", "cuda or gpu", *CUDA_TESTS]
    timeout = max(TESTS_AT_LEAST_S, deadline - time.perf_counter())
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", result.stdout)
    counts = {what: int(n) for n, what in found}
    return {"command": " ".join(cmd[1:]), "exit_code": result.returncode, "counts": counts}


def toy_vocab(work: Path) -> Path:
    """A tiny BPE vocabulary and token ids of a word-for-word toy corpus, as the stages make them."""
    from transformer.data.tokenize import tokenize_corpus
    from transformer.data.vocab import build_vocabs

    g = torch.Generator().manual_seed(1)
    words = [f"{c}{v}n" for c in "bdfgklmprst" for v in "aeiou"]
    raw = work / "raw"
    raw.mkdir(parents=True)
    for split, n in (("train", 600), ("val", 40)):
        lines = [[words[i] for i in torch.randint(len(words), (3 + k % 5,), generator=g)] for k in range(n)]
        (raw / f"{split}.de").write_text("".join(" ".join(s) + ".\n" for s in lines), encoding="utf-8")
        (raw / f"{split}.en").write_text("".join(" ".join(w[::-1] for w in s) + ".\n" for s in lines), encoding="utf-8")
    tokenize_corpus(raw, work / "tok", ["train", "val"], ("de", "en"), "train", 100)
    build_vocabs(work / "tok", work / "vocab", ("de", "en"), "bpe", 120, 1, "train", "val", seed=1)
    return work / "vocab"


def resume_params(work: Path) -> Path:
    """params.yaml with a tiny model, dropout on (so that the generators' states must come back),
    and a checkpoint every 10 of 60 updates."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    raw["vocab"]["size"] = 120
    raw["model"].update(N=1, d_model=32, d_ff=64, h=2, dropout=0.1)
    raw["train"].update(max_tokens=400, epochs=100, max_steps=60, save_every=10, rdrop=0.0, cooldown=0.0, warmup=100)
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def references(work: Path, data: Any) -> Path:
    """Where the validation split's references lie under `work`, as the train stage is pointed at them:
    raw/<valid split>.<target language> of the params' `data`."""
    return work / "raw" / f"{data.valid}.{data.tgt_lang}"


def train_stage(params: Path, vocab: Path, out: Path) -> subprocess.Popen:
    data = params_from_dict(yaml.safe_load(params.read_text(encoding="utf-8"))).data
    reports = out / "reports"
    cmd = [sys.executable, "stages/train.py", "--params", str(params), "--vocab", str(vocab), "--no-track"]
    cmd += ["--checkpoints", str(out / "ckpt"), "--steps", str(reports / "steps.tsv")]
    cmd += ["--epochs", str(reports / "epochs.tsv"), "--summary", str(reports / "train.json")]
    cmd += ["--references", str(references(vocab.parent, data))]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finished(job: subprocess.Popen) -> None:
    """Waits for the train stage, and raises its error where it failed."""
    try:
        _, err = job.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        job.kill()  # not left training beside the parts that follow
        job.wait()
        raise
    if job.returncode:
        raise click.ClickException(f"the train stage failed: {err.strip()[-800:]}")


def resume_check(work: Path) -> dict[str, Any]:
    """kill -9 after the first checkpoint, a rerun, and the final weights against an uninterrupted run's."""
    vocab, params = toy_vocab(work), resume_params(work)
    finished(train_stage(params, vocab, work / "whole"))
    job = train_stage(params, vocab, work / "killed")
    while not checkpoints.listed(work / "killed" / "ckpt") and job.poll() is None:
        time.sleep(0.01)
    killed_at = checkpoints.step_of(checkpoints.listed(work / "killed" / "ckpt")[0]) if job.poll() is None else None
    job.send_signal(signal.SIGKILL)
    job.wait()
    finished(train_stage(params, vocab, work / "killed"))
    whole, resumed = (checkpoints.load(checkpoints.listed(work / d / "ckpt")[-1]) for d in ("whole", "killed"))
    diff = max((whole["model"][k].float() - resumed["model"][k].float()).abs().max().item() for k in whole["model"])
    loop = yaml.safe_load((work / "killed" / "reports" / "train.json").read_text())
    return {
        "killed_at_step": killed_at,  # None: the run ended before a checkpoint could be seen
        "steps": resumed["step"],
        "max_weight_difference": diff,
        "bit_identical": diff == 0.0 and whole["step"] == resumed["step"],
        "train_loop_batch_wait_s": loop["batch_wait_s"],
    }


# ---------------------------------------------------------------------------- the real loop

VALID_PAIRS = 16  # the trainer part's validation split, measured once, after the timed updates


def made_up_lines(size: int, seed: int = 1) -> list[str]:
    """Lines of made-up words in which sentencepiece finds `size` BPE pieces: 2 * size word types of one
    to three syllables from an inventory of 1,274, drawn 16 * size times by Zipf's law, so that BPE's
    merges build the syllables, then the frequent words."""
    rng = random.Random(seed)
    onsets = [*"bdfghklmnprstvwz", "br", "dr", "fl", "gr", "kl", "pr", "sch", "st", "th", "tr"]
    vowels, codas = ("a", "e", "i", "o", "u", "ei", "au"), ("", "n", "r", "s", "l", "t", "ng")
    syllables = [onset + vowel + coda for onset in onsets for vowel in vowels for coda in codas]
    types: dict[str, None] = {}  # in the order drawn: the first are the most frequent
    while len(types) < 2 * size:
        types.setdefault("".join(rng.choices(syllables, k=rng.randint(1, 3))))
    zipf = [1 / rank for rank in range(1, len(types) + 1)]
    words = rng.choices(list(types), weights=zipf, k=16 * size)
    return [" ".join(words[i : i + 25]) for i in range(0, len(words), 25)]


def loop_params(plan: Plan) -> Any:
    """The base preset's params (the tests' sizes in the dry run) for LOG_EVERY updates of warm-up and
    plan.loop_updates timed, with no validation or checkpoint before the last of them."""
    params = preset_params(PRESETS["base"], plan.tiny)
    steps = LOG_EVERY + plan.loop_updates
    return dataclasses.replace(
        params, train=dataclasses.replace(params.train, max_steps=steps, eval_every=0, save_every=0, patience=0)
    )


def loop_inputs(work: Path, params: Any, plan: Plan, vocab: BpeVocab) -> ParallelCorpus:
    """What the train stage reads, in `work` as toy_vocab lays it out: the vocabulary (vocab/), a
    WMT-shaped corpus in its ids (vocab/train.pt, and the validation split's beside it), the validation
    split's references (`references`, its targets decoded) and params.yaml. Returns the training corpus."""
    save_vocabs(work / "vocab", vocab, vocab)
    max_len = params.tokenize.max_len
    corpus = wmt_shaped(work / "vocab" / "train.pt", plan.pairs, len(vocab), max_len)
    valid = wmt_shaped(work / "vocab" / f"{params.data.valid}.pt", VALID_PAIRS, len(vocab), max_len, seed=2)
    targets = [valid.tgt[valid.tgt_off[i] : valid.tgt_off[i + 1]].tolist() for i in range(len(valid))]
    (work / "raw").mkdir(parents=True)
    write_lines(references(work, params.data), [vocab.decode(ids) for ids in targets])
    (work / "params.yaml").write_text(yaml.safe_dump(params.to_dict()), encoding="utf-8")
    return corpus


def after_warmup(steps: Path, tokens: list[int]) -> float:
    """Seconds of the loop's updates after its first sync window, from its steps report: each row
    holds its window's tokens/s, the window's target tokens over its seconds, a window every LOG_EVERY
    updates; `tokens` are each update's target tokens as the loop batched them."""
    header, *rows = steps.read_text(encoding="utf-8").splitlines()
    column = header.split("\t").index("tokens_per_s")
    rates = [float(row.split("\t")[column]) for row in rows]
    if len(rates) != len(tokens):
        raise click.ClickException(f"{steps}: {len(rates)} updates, where {len(tokens)} were planned")
    seconds = 0.0
    for k in range(LOG_EVERY, len(rates), LOG_EVERY):
        window = rates[k : k + LOG_EVERY]
        if len(set(window)) > 1:
            raise click.ClickException(f"{steps}: updates {k + 1} to {k + len(window)} are not one sync window")
        seconds += sum(tokens[k : k + LOG_EVERY]) / window[0]
    return seconds


def trainer_row(plan: Plan, work: Path) -> dict[str, Any]:
    """The train stage (its Trainer: batches prefetched, pinned host-to-device copies, the losses read
    back every LOG_EVERY updates) at the base preset's model and batches, on a joint BPE vocabulary of
    the preset's size learned from made-up words; its figures over the updates after the warm-up, from
    its own clock. MFU is added by with_mfu."""
    params = loop_params(plan)
    t, start = params.train, time.perf_counter()
    vocab = BpeVocab.train(made_up_lines(params.vocab.size), params.vocab.size, seed=1)
    vocab_s = time.perf_counter() - start
    corpus = loop_inputs(work, params, plan, vocab)
    groups = epoch_groups(corpus, t, 0)[: t.max_steps]  # the first epoch's, as the loop plans it
    if len(groups) < t.max_steps:  # the epoch's end would validate and checkpoint among the timed updates
        raise click.ClickException(f"an epoch of {plan.pairs} pairs holds {len(groups)} updates, not {t.max_steps}")
    start = time.perf_counter()
    finished(train_stage(work / "params.yaml", work / "vocab", work / "run"))
    stage_s = time.perf_counter() - start
    loop = json.loads((work / "run" / "reports" / "train.json").read_text(encoding="utf-8"))
    seconds = after_warmup(work / "run" / "reports" / "steps.tsv", [sum(map(corpus.tokens, g)) for g in groups])
    dtype = autocast_dtype(t.precision, plan.device)
    return {
        "preset": PRESETS["base"],
        "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"),
        "max_tokens": t.max_tokens,
        "accum": t.accum,
        "vocab_kind": vocab.kind,
        "vocab_size": len(vocab),
        "vocab_s": round(vocab_s, 2),  # making the words up and learning BPE from them
        "warmup_updates": LOG_EVERY,
        "updates": plan.loop_updates,
        **timed_figures(params, corpus, groups[LOG_EVERY:], seconds, len(vocab)),
        "steps": loop["steps"],
        "train_time_s": loop["train_time_s"],  # of every update, the warm-up too, as is the wait for batches
        "batch_wait_s": loop["batch_wait_s"],
        "stage_s": round(stage_s, 1),  # the process's, start-up, validation and checkpoint included
    }


def timed_figures(params: Any, corpus: ParallelCorpus, groups: list, seconds: float, vocab: int) -> dict[str, Any]:
    """ms an update, target tokens/s and FLOPs (train_flops) of the updates `groups` (each its
    micro-batches' pairs), which took `seconds`."""
    m, micro = params.model, [index for group in groups for index in group]  # micro-batches
    shape = Size("base", m.N, m.d_model, m.d_ff, m.h)
    flops = sum(train_flops(corpus.batch(index), shape, vocab) for index in micro)
    tokens = sum(map(corpus.tokens, micro))
    return {
        "ms_per_update": round(1000 * seconds / len(groups), 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "tgt_real_tokens_per_update": round(tokens / len(groups), 1),
        "flops_per_token": round(flops / tokens),
        "flops_per_s": flops / seconds,
    }


# ---------------------------------------------------------------------------- report


def machine(device: torch.device) -> dict[str, Any]:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        info |= {"name": torch.cuda.get_device_name(device), "capability": torch.cuda.get_device_capability(device)}
    return info


class Report:
    """The report as it grows, rewritten atomically to `out` after every part, so that a kill at any
    moment leaves every part done on disk; each part runs in a try of its own, and none starts
    after `budget_s` seconds."""

    def __init__(self, out: Path, budget_s: float, data: dict[str, Any]):
        self.out, self.budget_s, self.data = out, budget_s, data | {"budget_s": budget_s}
        self.started = time.perf_counter()
        self.deadline = self.started + budget_s  # perf_counter's clock
        self.save()

    def save(self) -> None:
        self.data["runtime_s"] = round(time.perf_counter() - self.started, 1)
        write_json(self.out, self.data)

    def run(self, part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """part()'s figures, or why there are none: skipped past the budget, or the exception it raised."""
        late = time.perf_counter() - self.deadline
        if late >= 0:
            return {"skipped": f"the budget of {self.budget_s:g} s was spent ({late:.0f} s over) before it could start"}
        try:
            return part()
        except Exception as e:  # noqa: BLE001 (one failed part is a finding, and the parts after it still run)
            return {"error": {"type": type(e).__name__, "message": str(e)[-2000:]}}

    def section(self, key: str, part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        self.data[key] = self.run(part)
        self.save()
        return self.data[key]

    def row(self, key: str, label: dict[str, Any], part: Callable[[], dict[str, Any]]) -> None:
        self.data.setdefault(key, []).append(label | self.run(part))
        self.save()


def train_part(size: str, compiled: bool, plan: Plan, work: Path, report: Report) -> dict[str, Any]:
    row = train_row(size, compiled, plan, work, report.deadline)
    peaks = report.data["peak_tflops"]
    return with_mfu(row, {} if "skipped" in peaks or "error" in peaks else peaks, report.data["datasheet_peak"])


def trainer_part(plan: Plan, work: Path, report: Report) -> dict[str, Any]:
    """trainer_row after the rows' memory is freed (the stage is a process of its own, on the same
    device), with MFU, and its tokens/s over the eager base row's: the share of the update's speed
    that the real loop keeps (None without that row)."""
    release_memory(plan.device)
    row = trainer_row(plan, work)
    eager = next((r for r in report.data["train"] if r["size"] == "base" and not r["compile"]), {})
    ratio = round(row["tokens_per_s"] / eager["tokens_per_s"], 3) if "tokens_per_s" in eager else None
    peaks = report.data["peak_tflops"]
    peaks = {} if "skipped" in peaks or "error" in peaks else peaks
    return with_mfu(row, peaks, report.data["datasheet_peak"]) | {"ratio_to_eager_row": ratio}


def check(plan: Plan, work: Path, out: Path, budget_s: float) -> dict[str, Any]:
    """Every part in order (the module's docstring), the report on disk after each."""
    about = machine(plan.device)
    report = Report(
        out,
        budget_s,
        {
            "machine": about,
            "dry_run": plan.tiny,
            "compile_backend": plan.backend,
            "datasheet_peak": datasheet_peak(about.get("name", "cpu")),
            "flops_formula": train_flops.__doc__,
            "kernel_categories": [list(c) for c in CATEGORIES],  # in order: the first match wins
        },
    )
    report.section("peak_tflops", functools.partial(measured_peaks, plan))
    for size in PRESETS:
        for compiled in (False, True):
            part = functools.partial(train_part, size, compiled, plan, work, report)
            report.row("train", {"size": size, "compile": compiled}, part)
    report.section("trainer", functools.partial(trainer_part, plan, work / "trainer", report))
    report.section("loss", functools.partial(loss_row, plan))
    report.section("attention", functools.partial(attention_row, plan, work))
    report.section("resume", functools.partial(resume_check, work / "resume"))
    report.section("tests", lambda: cuda_tests(report.deadline))
    report.data["peak_rss_mb"] = round(peak_rss_mb())
    report.save()
    return report.data


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=ROOT / "reports" / "gpu_check.json")
@click.option("--seconds", type=click.FloatRange(min=1), default=15.0, show_default=True, help="timed per row")
@click.option(
    "--budget-s",
    type=click.FloatRange(min=0),
    default=BUDGET_S,
    show_default=True,
    help="no part starts after this many seconds; the parts left are recorded as skipped",
)
@click.option("--dry-run", is_flag=True, help="no GPU: the same code on the CPU, tiny sizes, 2 updates a row")
def main(out: Path, seconds: float, budget_s: float, dry_run: bool) -> None:
    """Training at the WMT14 presets' sizes on one GPU; see the module docstring."""
    if not dry_run and not torch.cuda.is_available():
        raise click.ClickException("no CUDA device: bench.gpu_check needs one GPU (--dry-run runs it on the CPU)")
    plan = plan_for(dry_run, seconds)
    with tempfile.TemporaryDirectory() as tmp:
        report = check(plan, Path(tmp), out, budget_s)
    click.echo("\n".join(summary(report)) + f"\nreport: {out}")


def outcome(part: dict[str, Any]) -> str | None:
    """Why a part has no figures: its skip or its exception, in a line; None when it has them."""
    if "skipped" in part:
        return f"skipped: {part['skipped']}"
    if "error" in part:
        return f"failed: {part['error']['type']}: {(part['error']['message'].splitlines() or [''])[-1]}"
    return None


def trainer_line(r: dict[str, Any]) -> str:
    name = "the train stage, base"
    if outcome(r):
        return f"{name}: {outcome(r)}"
    mfu = "?" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    sheet = "" if r["mfu_datasheet"] is None else f" ({100 * r['mfu_datasheet']:.1f}% of the datasheet's)"
    kept = "" if r["ratio_to_eager_row"] is None else f", {r['ratio_to_eager_row']:.0%} of the eager row's tokens/s"
    return (
        f"{name}: {r['dtype']} {r['tokens_per_s']:,.0f} tok/s  MFU {mfu}{sheet}  {r['ms_per_update']:.1f} ms an update"
        f"{kept}; {r['batch_wait_s']:.2f} s waiting for batches over {r['steps']} updates"
    )


def summary(report: dict[str, Any]) -> list[str]:
    lines = []
    for r in report["train"]:
        name = f"{r['size']:<5} {'compiled' if r['compile'] else 'eager':<8}"
        if outcome(r):
            lines.append(f"{name} {outcome(r)}")
            continue
        sheet = "" if r["mfu_datasheet"] is None else f" ({100 * r['mfu_datasheet']:.1f}% of the datasheet's)"
        mfu = "?" if r["mfu"] is None else f"{100 * r['mfu']:5.1f}%"
        lines.append(
            f"{name} {r['dtype']} {r['tokens_per_s']:>12,.0f} tok/s  MFU {mfu}{sheet}  "
            f"{r['ms_per_update']:8.1f} ms an update, {r['waits_on_host_share']:.0%} of it waiting on the host"
        )
    lines.append(trainer_line(report["trainer"]))
    loss, resume, tests = report["loss"], report["resume"], report["tests"]
    loss_line = outcome(loss) or f"fused {loss['fused_ms']} ms, plain cross-entropy {loss['plain_ms']} ms"
    lines.append(f"the loss of a micro-batch: {loss_line}")
    attention = report["attention"]
    attention_line = outcome(attention) or f"masked {attention['masked_ms']} ms" + (
        f", variable-length flash {attention['varlen_ms']} ms" if "varlen_ms" in attention else ""
    )
    lines.append(f"source attention of a micro-batch: {attention_line}")
    if outcome(resume):
        lines.append(f"resume after kill -9: {outcome(resume)}")
    else:
        lines.append(f"resume after kill -9: largest weight difference {resume['max_weight_difference']:.3g}")
    tests_line = outcome(tests) or f"{tests['counts']}, exit {tests['exit_code']}"
    lines.append(f"CUDA tests: {tests_line}; {report['runtime_s']:.0f} s in all")
    return lines


if __name__ == "__main__":
    main()
