"""One GPU's check of training at the WMT14 presets' sizes, in under ten minutes; one JSON report.

Run from the repository root, venv active:

    python -m bench.gpu_check [--out reports/gpu_check.json] [--seconds 15]
    python -m bench.gpu_check --dry-run     # no GPU: the same code on the CPU, tiny sizes, 2 updates a row

On cuda:0 it measures, in order:

- tests: the suite's CUDA tests (CUDA_TESTS), their counts and exit status;
- peaks: a bf16 and an fp32 matmul's TFLOP/s (fp32 in TF32, as training multiplies it): MFU's
  denominator, measured as bench.py measures its CPU's;
- train: the base and big models of wmt14_en_de_base and wmt14_en_de_big, compile off and on, an
  update as training runs it (make_model, make_optimizer, StepLoss, set_precision's bf16 or TF32,
  training's attention kernels) over token batches of a synthetic WMT-shaped corpus (about 31
  tokens a side, log-normal) at the preset's train.max_tokens and train.accum: target tokens/s, MFU
  with train_flops (the bench's FLOPs a token), ms an update, the share of it the GPU spent
  waiting on the host (kernel time against wall time, from the profiler), the kernels that took the
  most GPU time and the attention kernels, and peak GPU memory;
- resume: the train stage on a toy corpus, killed with SIGKILL after its first checkpoint and
  rerun, against an uninterrupted run (the largest weight difference; 0 is bit-identical), with the
  training loop's own wait for batches from its train.json.

Without a CUDA device it stops with one line, unless --dry-run: then the same code runs on the CPU
with tiny sizes, two timed updates a row and torch.compile's aot_eager backend (no C++ build), so a
test can run it in seconds; its figures check the code, not a machine.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
import yaml
from torch.profiler import ProfilerActivity, profile

import transformer.training.train
from bench.common import ROOT, Size, train_flops
from transformer import checkpoints
from transformer.config import params_from_dict
from transformer.data.batching import Batch, ParallelCorpus, token_batches
from transformer.data.vocab import PAD
from transformer.io import write_json
from transformer.kernels.memory import peak_rss_mb
from transformer.kernels.select import attention_kernels
from transformer.model.model import make_model
from transformer.presets import recipe
from transformer.training.distributed import set_precision
from transformer.training.train import StepLoss, make_optimizer

PRESETS = {"base": "wmt14_en_de_base", "big": "wmt14_en_de_big"}
CUDA_TESTS = ("tests/test_fast_paths.py", "tests/test_scale_out.py", "tests/test_distributed.py")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ATTENTION = ("flash", "fmha", "efficient", "cudnn", "attention", "sdpa")  # kernel names of attention


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


def plan_for(dry_run: bool, seconds: float) -> Plan:
    if dry_run:
        return Plan(torch.device("cpu"), 400, 1, 0.0, 2, 128, True, "aot_eager")
    return Plan(torch.device("cuda", 0), 200_000, 4, seconds, 10, 8192, False, "inductor")  # 250 updates of 25k


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


def update_step(params, vocab: int, device: torch.device, compiled: bool, backend: str):
    """One training update over an update's micro-batches, the loss normalized by its target
    tokens, as transformer.training.train's loop runs it in one process; returns bf16's use too."""
    torch.manual_seed(1)
    config = {"src_vocab": vocab, "tgt_vocab": vocab, "pad": PAD} | dataclasses.asdict(params.model)
    model = make_model(**config).to(device).train()
    optimizer = make_optimizer(model, params.train.weight_decay, device)
    loss_of = StepLoss(model, params.train.label_smoothing)  # the model, its generator and the loss
    loss_of = transformer.training.train.compiled(loss_of, backend) if compiled else loss_of
    bf16 = set_precision(params.train.precision, device) == torch.bfloat16  # fp16 is not timed here

    def update(micro: list[Batch]) -> None:
        tokens = sum(b.ntokens for b in micro)
        for batch in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), attention_kernels(device, bf16):
                (loss_of(batch) / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return update, bf16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(update, updates: list[list[Batch]], plan: Plan) -> tuple[float, list[list[Batch]]]:
    """Seconds of the timed updates after `plan.warmup` untimed ones, and those updates."""
    for micro in updates[: plan.warmup]:
        update(micro)
    sync(plan.device)
    done, start = [], time.perf_counter()
    for micro in updates[plan.warmup :]:
        update(micro)
        done.append(micro)
        if len(done) >= plan.least and time.perf_counter() - start >= plan.seconds:
            break
    sync(plan.device)
    return time.perf_counter() - start, done


def profiled(update, updates: list[list[Batch]], device: torch.device) -> dict[str, Any]:
    """Kernel time against wall time over `updates`, and the kernels that took the most time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for micro in updates:
            update(micro)
        sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()

    def own(e) -> float:  # µs of the event's own work on the device the rows run on
        return e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total

    busy = sum(own(e) for e in events if device.type == "cpu" or e.device_type.name == "CUDA") / 1e6
    top = sorted(events, key=own, reverse=True)
    return {
        "device_busy_ms_per_update": round(1000 * min(busy, wall) / len(updates), 3),
        "waits_on_host_share": round(max(0.0, 1 - busy / wall), 3),
        "top_kernels": [e.key[:100] for e in top[:8]],
        "attention_kernels": sorted({e.key[:100] for e in top if any(k in e.key.lower() for k in ATTENTION)})[:8],
    }


def train_row(size: str, compiled: bool, plan: Plan, work: Path) -> dict[str, Any]:
    """One size at its preset's batches, compiled or not: speed, MFU, waits, kernels, memory."""
    params = preset_params(PRESETS[size], plan.tiny)
    vocab, t = params.vocab.size, params.train
    corpus = wmt_shaped(work / f"{size}.pt", plan.pairs, vocab, params.tokenize.max_len)
    updates = updates_of(corpus, t.max_tokens, t.accum, plan.warmup + 250, plan.device)
    torch._dynamo.reset()  # the rows before: their compiled graphs hold their models, which would count
    gc.collect()
    update, bf16 = update_step(params, vocab, plan.device, compiled, plan.backend)
    if plan.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(plan.device)
    seconds, done = timed(update, updates, plan)
    shape = Size(size, params.model.N, params.model.d_model, params.model.d_ff, params.model.h)
    flops = sum(train_flops(b, shape, vocab) for micro in done for b in micro)
    tokens = sum(b.ntokens for micro in done for b in micro)
    peak = torch.cuda.max_memory_allocated(plan.device) / 2**30 if plan.device.type == "cuda" else None
    return {
        "size": size,
        "preset": PRESETS[size],
        "compile": compiled,
        "dtype": "bf16" if bf16 else "fp32",
        "max_tokens": t.max_tokens,
        "accum": t.accum,
        "updates": len(done),
        "ms_per_update": round(1000 * seconds / len(done), 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "flops_per_token": round(flops / tokens),
        "flops_per_s": flops / seconds,
        "peak_gpu_memory_gib": None if peak is None else round(peak, 2),
    } | profiled(update, updates[plan.warmup : plan.warmup + 2], plan.device)


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


def cuda_tests() -> dict[str, Any]:
    """The suite's CUDA tests (and their CPU halves where they have them), in a process of their own."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-k", "cuda or gpu", *CUDA_TESTS]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
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


def train_stage(params: Path, vocab: Path, out: Path) -> subprocess.Popen:
    reports = out / "reports"
    cmd = [sys.executable, "stages/train.py", "--params", str(params), "--vocab", str(vocab), "--no-track"]
    cmd += ["--checkpoints", str(out / "ckpt"), "--steps", str(reports / "steps.tsv")]
    cmd += ["--epochs", str(reports / "epochs.tsv"), "--summary", str(reports / "train.json")]
    cmd += ["--references", str(vocab.parent / "raw" / "val.en")]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finished(job: subprocess.Popen) -> None:
    _, err = job.communicate(timeout=300)
    if job.returncode:
        raise click.ClickException(f"the train stage failed in the resume check: {err.strip()[-800:]}")


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


# ---------------------------------------------------------------------------- report


def machine(device: torch.device) -> dict[str, Any]:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        info |= {"name": torch.cuda.get_device_name(device), "capability": torch.cuda.get_device_capability(device)}
    return info


def with_mfu(rows: list[dict[str, Any]], peaks: dict[str, float]) -> list[dict[str, Any]]:
    """MFU as bench.py reckons it: model FLOPs a second over the row's dtype's measured matmul peak."""
    return [r | {"mfu": round(r["flops_per_s"] / (peaks[r["dtype"]] * 1e12), 6)} for r in rows]


def check(plan: Plan, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    report: dict[str, Any] = {"machine": machine(plan.device), "dry_run": plan.tiny, "compile_backend": plan.backend}
    report["tests"] = cuda_tests()
    set_precision("fp32", plan.device)  # the fp32 peak in TF32, as fp32 training multiplies
    peaks = {name: matmul_peak_tflops(dtype, plan) for name, dtype in DTYPES.items()}
    report["peak_tflops"] = {k: round(v, 3 if plan.tiny else 1) for k, v in peaks.items()}
    rows = [train_row(size, compiled, plan, work) for size in PRESETS for compiled in (False, True)]
    report["train"] = with_mfu(rows, peaks)
    report["resume"] = resume_check(work / "resume")
    report["peak_rss_mb"] = round(peak_rss_mb())
    report["runtime_s"] = round(time.perf_counter() - started, 1)
    report["flops_formula"] = train_flops.__doc__
    return report


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=ROOT / "reports" / "gpu_check.json")
@click.option("--seconds", type=click.FloatRange(min=1), default=15.0, show_default=True, help="timed per row")
@click.option("--dry-run", is_flag=True, help="no GPU: the same code on the CPU, tiny sizes, 2 updates a row")
def main(out: Path, seconds: float, dry_run: bool) -> None:
    """Training at the WMT14 presets' sizes on one GPU; see the module docstring."""
    if not dry_run and not torch.cuda.is_available():
        raise click.ClickException("no CUDA device: bench.gpu_check needs one GPU (--dry-run runs it on the CPU)")
    plan = plan_for(dry_run, seconds)
    with tempfile.TemporaryDirectory() as tmp:
        report = check(plan, Path(tmp))
    write_json(out, report)
    click.echo("\n".join(summary(report)) + f"\nreport: {out}")


def summary(report: dict[str, Any]) -> list[str]:
    lines = []
    for r in report["train"]:
        compiled = "compiled" if r["compile"] else "eager"
        lines.append(
            f"{r['size']:<5} {compiled:<8} {r['dtype']} {r['tokens_per_s']:>12,.0f} tok/s  MFU {100 * r['mfu']:5.1f}%  "
            f"{r['ms_per_update']:8.1f} ms an update, {r['waits_on_host_share']:.0%} of it waiting on the host"
        )
    r, tests = report["resume"], report["tests"]
    lines.append(f"resume after kill -9: largest weight difference {r['max_weight_difference']:.3g}")
    lines.append(f"CUDA tests: {tests['counts']}, exit {tests['exit_code']}; {report['runtime_s']:.0f} s in all")
    return lines


if __name__ == "__main__":
    main()
