"""Speed of the project's model against the baseline, the Annotated Transformer's way, side by side in
one process.

Run from the repository root (about 11 minutes on 2 cores; --quick: about 1.5 minutes, small size only):

    python -m bench.bench [--quick] [--vocab-dir data/vocab] [--rows plain-fp32,plain-bf16] [--out reports/bench.json]

It prints one table and writes all figures, with the machine's description, to reports/bench.json.

What is measured, on one machine, one model size at a time (small: N=3, d_model=256,
d_ff=1024, h=4; base: N=6, d_model=512, d_ff=2048, h=8), pre-norm, dropout 0.1:

- matmul peak: a 2048×2048 matmul repeated after warm-up, fp32 and bf16, in GFLOP/s. It is
  the denominator of MFU (model FLOPs utilization) for rows of that dtype.
- training, target tokens/s and MFU, a few warm-up updates then timed updates (Adam, fused
  for ours as in training, label smoothing 0.1, dropout on); batches are built before the clock
  starts. Each row (TRAIN_ROWS) changes one thing from the row it is compared with:
    ours-256, baseline-256: 256 random sentences padded to the batch's longest, about 45% real
      tokens (so ours packs both sides), ours (make_model + StepLoss) against bench/baseline.py,
      the Annotated Transformer's way of computing the same model, on the very same batches: the code
      alone.
    plain-fp32, plain-bf16: the project's default batching (token_batches, train.max_tokens),
      a plain update in fp32, and in bf16 autocast with training's attention kernels; against
    annotated-transformer: the baseline on 32 sentences padded to a fixed 72 tokens, as the Annotated
      Transformer trains.
    torch-attention-bf16: plain-bf16 with torch's default attention kernel (flash on a CPU).
    rdrop-*: R-Drop (α RDROP) in one forward of both passes; tokens/s counts a batch's tokens
      once (the speed through the corpus), MFU credits both passes. rdrop-shared-* encode once
      and decode twice (train.rdrop_shared_encoder); rdrop-half-* run half the sentences twice
      (train.rdrop_share 0.5, 1.5 passes credited), as the default recipe does.
    glibc-*: the plain update on glibc's malloc defaults, large blocks mapped and unmapped each
      update; every other row of ours keeps freed memory as training does on glibc
      (keep_freed_memory), and the baseline's rows run with glibc's defaults, as the Annotated
      Transformer does.
    pad8-*: batch sides padded to multiples of 8 tokens (train.pad_multiple 8), batched for it;
      compiled-*: the same under torch.compile (train.compile; inductor, sizes symbolic),
      compiled in its warm-up updates; compiled-rdrop-half-*: rdrop-half-* under torch.compile.
      Every row reports its warm-up's seconds apart (warmup_s): a compiled row's compile time.
  The bench runs with training's memory settings (training_memory: oneDNN's kernel cache
  limited, mimalloc where installed, where the glibc rows are left out; TRANSFORMER_ALLOCATOR=glibc
  runs every row on glibc's). The bf16 rows and peak are left out on a CPU without bf16 hardware
  (AVX512_BF16 or AMX), where torch emulates bf16 at a few percent of fp32's speed and training
  runs in fp32 (train.precision: auto).
- decoding, target tokens/s and sentences/s, untrained models in eval mode, on source sentences
  of test2016-like lengths: ours greedy and beam (batched by length as translate does) against
  the baseline's greedy, one sentence at a time, re-running the decoder over the whole prefix.
  Every search gets eos = -1, an id no token has, so each sentence is decoded to exactly its max
  length, source length + 5, for ours and the baseline alike.
- --model: a trained model's decoding instead, ours against its CTranslate2 export, fp32 and int8.

Data: by default a synthetic corpus with the size and length distribution of Multi30k de-en
under joint BPE 8000 (29,000 pairs; source ≈ 14.8 ± 5.4 tokens, target ≈ 14.3 ± 4.8; random
ids in [4, 8000), joint vocabulary, tied embeddings), seeded, so runs are comparable.
--vocab-dir takes the build_vocab stage's output instead (vocab.pt and train.pt) for real
token ids; ours then ties embeddings only if the vocabulary is joint (bpe). The baseline never
ties, as in the Annotated Transformer: that changes the parameter count, not the FLOPs. The
baseline rows time the model's update or search alone: the Annotated Transformer's own loop also
tokenizes with spaCy inside its DataLoader, so it runs slower than baseline-256 or
annotated-transformer.

Other processes on the machine slow every row, small-op rows (decoding, 32-sentence batches)
the most, as their threads lose the cores. The column "others" is how many cores other
processes kept busy meanwhile (from /proc/stat); a warning follows the table above 0.2.
"""

from __future__ import annotations

import functools
import gc
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click
import torch

from bench import baseline
from bench.common import (
    PARAMS,
    RDROP,
    ROOT,
    SEED,
    SIZES,
    VOCAB_DIR,
    Data,
    Size,
    Step,
    load_data,
    matmul_peak,
    ours_model,
    ours_step,
    train_flops,
    training_batches,
)
from transformer.data.batching import Batch, ParallelCorpus
from transformer.data.vocab import BOS, PAD
from transformer.decoding.search import beam_search
from transformer.decoding.translate import Search, batched_search
from transformer.evaluation.system import host_class
from transformer.io import write_json
from transformer.kernels.memory import allocator, keep_freed_memory, kernel_cache, peak_rss_mb, training_memory
from transformer.training.distributed import use_bf16

NO_EOS = -1  # an id no token has: searches run every sentence to its max length
EXTRA = 5  # decoded length = source length + EXTRA
MAX_BATCHES = 40  # built per training row, warm-up included
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Plan:
    """How long to measure. Each training row runs `warmup` updates, then timed updates until
    `row_seconds` have passed (at least 2); rows are timed, not counted, to bound the runtime."""

    sizes: tuple[str, ...]
    warmup: tuple[int, ...]  # per size
    row_seconds: tuple[float, ...]  # per size
    decode_sentences: int
    matmul_seconds: float


FULL = Plan(("small", "base"), (2, 1), (10.0, 20.0), 100, 2.0)
QUICK = Plan(("small",), (1,), (3.0,), 24, 1.0)


# ---------------------------------------------------------------------------- training


def baseline_model(data: Data, size: Size) -> baseline.Baseline:
    torch.manual_seed(SEED)
    return baseline.make_baseline(data.src_vocab, data.tgt_vocab, size.N, size.d_model, size.d_ff, size.h, 0.1)


def baseline_step(data: Data, size: Size) -> Step:
    model = baseline_model(data, size).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    criterion = baseline.LabelSmoothing(data.tgt_vocab, PAD, PARAMS.train.label_smoothing)
    return lambda b: baseline.train_step(model, criterion, optimizer, b.src, b.tgt_in, b.tgt_out, PAD)


def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has run (Linux /proc/stat); 0 elsewhere."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Clock:
    """Wall time, and how many cores other processes kept busy meanwhile: on a shared
    machine every figure measured while they run is low."""

    def __enter__(self) -> Clock:
        self.start, self.cpu_start, self.busy_start = time.perf_counter(), time.process_time(), busy_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        mine = time.process_time() - self.cpu_start
        self.others = max(0.0, busy_cpu_seconds() - self.busy_start - mine) / self.seconds


def time_training(step: Step, batches: list[Batch], warmup: int, seconds: float) -> tuple[Clock, list[Batch]]:
    """The clock of the timed updates (its warmup_s: the seconds of the untimed ones before), and their
    batches. CPU ops run synchronously, so the clock needs no device sync."""
    start = time.perf_counter()
    for batch in batches[:warmup]:
        step(batch)
    warmup_s = time.perf_counter() - start
    timed = []
    with Clock() as clock:
        for batch in batches[warmup:]:
            step(batch)
            timed.append(batch)
            if len(timed) >= 2 and time.perf_counter() - clock.start >= seconds:
                break
    clock.warmup_s = warmup_s
    return clock, timed


@dataclass(frozen=True)
class TrainRow:
    """One training row: what it runs, and the row its speed is compared with (`vs`)."""

    name: str
    label: str
    batches: str  # a key of training_batches
    bf16: bool = False
    vs: str | None = None
    baseline: bool = False  # the Annotated Transformer's model and update instead of ours
    default_kernel: bool = False  # torch's attention kernel choice instead of training's
    rdrop: bool = False
    shared_encoder: bool = False  # with rdrop: one encoder pass for both
    share: float = 1.0  # with rdrop: the share of each batch's sentences run twice
    malloc_defaults: bool = False  # glibc's defaults instead of training's kept freed memory
    compile: bool = False  # model, generator and loss under torch.compile; it compiles in the warm-up

    @property
    def dtype(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    @property
    def passes(self) -> float:
        """Forward passes of each batch an update runs: R-Drop's 2, 1.5 on half the sentences on average."""
        return 1 + self.share if self.rdrop else 1

    @property
    def keeps_freed_memory(self) -> bool:
        """Whether the row keeps freed memory, as training does; the baseline's rows do not."""
        return not (self.baseline or self.malloc_defaults)


TOKENS, TO_8 = "token batches", "token batches to 8"
TRAIN_ROWS = (
    TrainRow("ours-256", "ours, 256 sentences", "256 sentences", vs="baseline-256"),
    TrainRow("baseline-256", "baseline, 256 sentences", "256 sentences", baseline=True),
    TrainRow("plain-fp32", "ours, token batches", TOKENS, vs="annotated-transformer"),
    TrainRow(
        "annotated-transformer", "baseline, the Annotated Transformer's recipe", "annotated recipe", baseline=True
    ),
    TrainRow("plain-bf16", "ours, token batches, bf16", TOKENS, bf16=True, vs="annotated-transformer"),
    TrainRow(
        "torch-attention-bf16", "torch's attention kernel", TOKENS, True, "annotated-transformer", default_kernel=True
    ),
    TrainRow("rdrop-fp32", "R-Drop", TOKENS, vs="plain-fp32", rdrop=True),
    TrainRow("rdrop-bf16", "R-Drop", TOKENS, bf16=True, vs="plain-bf16", rdrop=True),
    TrainRow("glibc-fp32", "glibc's malloc defaults", TOKENS, vs="plain-fp32", malloc_defaults=True),
    TrainRow("glibc-bf16", "glibc's malloc defaults", TOKENS, True, "plain-bf16", malloc_defaults=True),
    TrainRow("rdrop-shared-fp32", "a shared encoder", TOKENS, vs="rdrop-fp32", rdrop=True, shared_encoder=True),
    TrainRow("rdrop-shared-bf16", "a shared encoder", TOKENS, True, "rdrop-bf16", rdrop=True, shared_encoder=True),
    TrainRow("rdrop-half-fp32", "half the sentences", TOKENS, vs="rdrop-fp32", rdrop=True, share=0.5),
    TrainRow("rdrop-half-bf16", "half the sentences", TOKENS, True, "rdrop-bf16", rdrop=True, share=0.5),
    TrainRow("pad8-fp32", "padded to multiples of 8", TO_8, vs="plain-fp32"),
    TrainRow("compiled-fp32", "torch.compile", TO_8, vs="pad8-fp32", compile=True),
    TrainRow("pad8-bf16", "padded to multiples of 8", TO_8, bf16=True, vs="plain-bf16"),
    TrainRow("compiled-bf16", "torch.compile", TO_8, bf16=True, vs="pad8-bf16", compile=True),
    TrainRow(
        "compiled-rdrop-half-fp32", "torch.compile", TOKENS, vs="rdrop-half-fp32", rdrop=True, share=0.5, compile=True
    ),
    TrainRow(
        "compiled-rdrop-half-bf16",
        "torch.compile",
        TOKENS,
        True,
        "rdrop-half-bf16",
        rdrop=True,
        share=0.5,
        compile=True,
    ),
)
ROW_NAMES = tuple(row.name for row in TRAIN_ROWS)
COMPILE_WARMUP = 3  # untimed updates of a compiled row at least


def train_row(row: TrainRow, step: Step, batches: list[Batch], size: Size, data: Data, plan: Plan, peak: float):
    """Tokens/s counts each corpus token once, so it is the speed through the corpus; MFU credits
    every pass of R-Drop's (`row.passes`), the encoder's once with a shared encoder."""
    i = plan.sizes.index(size.name)
    clock, timed = time_training(step, batches, plan.warmup[i], plan.row_seconds[i])
    seconds = clock.seconds
    tokens = sum(b.ntokens for b in timed)
    flops = sum(train_flops(b, size, data.tgt_vocab, row.passes, row.shared_encoder) for b in timed)
    result = {
        "size": size.name,
        "key": row.name,
        "row": row.label,
        "dtype": row.dtype,
        "updates": len(timed),
        "seconds": round(seconds, 3),
        "warmup_s": round(clock.warmup_s, 3),
        "target_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "flops_per_token": round(flops / tokens),
        "mfu": round(flops / seconds / (peak * 1e9), 4),
        "target_fill": round(tokens / sum(b.tgt_out.numel() for b in timed), 3),
        "other_cores_busy": round(clock.others, 2),
    }
    print(
        f"  {size.name} {row.name:<20} {result['tokens_per_s']:>9,.0f} tok/s  ({len(timed)} updates, {seconds:.1f} s)",
        file=sys.stderr,
    )
    gc.collect()
    return result


def compile_warmup(batches: list[Batch]) -> int:
    """Untimed updates a compiled row runs: COMPILE_WARMUP at least and, where the first batch has
    S == T, up to and including the first batch with S != T. Dynamo's duck sizing gives S and T
    one symbol where they were equal at the first trace, and traces again where they part."""
    same = [b.src.size(1) == b.tgt_in.size(1) for b in batches]
    parted = same.index(False) + 1 if same[0] and not all(same) else 0
    return max(COMPILE_WARMUP, parted)


def row_step(row: TrainRow, data: Data, size: Size) -> Step:
    if row.baseline:
        return baseline_step(data, size)
    rdrop = RDROP if row.rdrop else 0.0
    return ours_step(
        data,
        size,
        bf16=row.bf16,
        default_kernel=row.default_kernel,
        rdrop=rdrop,
        shared_encoder=row.shared_encoder,
        share=row.share,
        compile=row.compile,
    )


def dtypes_here() -> dict[str, torch.dtype]:
    """The dtypes this CPU trains in: bf16 only with bf16 hardware (training's train.precision: auto)."""
    return DTYPES if use_bf16("auto", torch.device("cpu")) else {"fp32": torch.float32}


def left_out_here(row: TrainRow, dtypes: Collection[str]) -> str | None:
    """Why this machine does not run `row` where `dtypes` are what it trains in; None where it does."""
    if row.dtype not in dtypes:
        return "bf16: this CPU has no bf16 hardware"
    if row.malloc_defaults and allocator() != "glibc":
        return "glibc's malloc settings: this process runs on another malloc"
    return None


def training_rows(
    size: Size, data: Data, plan: Plan, peaks: dict[str, float], names: Collection[str] | None = None
) -> list[dict[str, Any]]:
    """The training rows of `names` (all where None) that this machine can run: bf16 rows need bf16
    hardware, and glibc's malloc settings (glibc-*) a process on glibc's malloc."""
    batches = training_batches(data.corpus, MAX_BATCHES)
    rows = []
    for row in TRAIN_ROWS:
        if (names and row.name not in names) or left_out_here(row, peaks):
            continue
        keep_freed_memory(row.keeps_freed_memory)
        step = row_step(row, data, size)
        warmup = compile_warmup(batches[row.batches])
        warm = replace(plan, warmup=tuple(max(w, warmup) for w in plan.warmup)) if row.compile else plan
        rows.append(train_row(row, step, batches[row.batches], size, data, warm, peaks[row.dtype]))
    keep_freed_memory()
    return compare(rows, {row.name: row.vs for row in TRAIN_ROWS if row.vs})


def compare(rows: list[dict[str, Any]], against: dict[str, str]) -> list[dict[str, Any]]:
    """Adds each row's speed ratio to the baseline row it is compared with."""
    speed = {r["key"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        ref = against.get(r["key"])
        r["vs"], r["ratio"] = (ref, round(speed[r["key"]] / speed[ref], 3)) if ref in speed else (None, None)
    return rows


# ---------------------------------------------------------------------------- decoding


def decode_sources(corpus: ParallelCorpus, count: int) -> list[list[int]]:
    """Source sentences (ids + </s>) drawn at random: test2016 has the training set's lengths."""
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(SEED + 2))[:count].tolist()
    return [corpus.batch([i]).src[0].tolist() for i in order]


def decode_ours(model: torch.nn.Module, sources: list[list[int]], beam: int) -> int:
    """Target tokens produced by ours on every source, batched by length as transformer.decoding.translate does."""
    search = Search.of(PARAMS.decode, beam=beam, max_len_extra=EXTRA)
    run = functools.partial(beam_search, model, beam=search.beam, alpha=search.alpha, bos=BOS, eos=NO_EOS)
    limits = [len(s) + search.max_len_extra for s in sources]
    searched = batched_search(sources, limits, search, torch.device("cpu"), run)
    return sum(len(out) for _, found in searched for out in found)


def decode_baseline(model: baseline.Baseline, sources: list[list[int]]) -> int:
    return sum(len(baseline.greedy_decode(model, torch.tensor([s]), len(s) + EXTRA, BOS, PAD)) for s in sources)


def decode_row(
    key: str, label: str, run: Callable[[list[list[int]]], int], sources: list[list[int]], size: Size
) -> dict[str, Any]:
    run(sources[:4])  # warm-up
    with Clock() as clock:
        tokens = run(sources)
    seconds = clock.seconds
    expected = sum(len(s) + EXTRA for s in sources)
    row = {
        "size": size.name,
        "key": key,
        "row": label,
        "dtype": "fp32",
        "sentences": len(sources),
        "seconds": round(seconds, 3),
        "target_tokens": tokens,
        "forced_length_held": tokens == expected,
        "tokens_per_s": round(tokens / seconds, 1),
        "sentences_per_s": round(len(sources) / seconds, 2),
        "other_cores_busy": round(clock.others, 2),
    }
    print(f"  {size.name} {key:<20} {row['tokens_per_s']:>9,.0f} tok/s  ({seconds:.1f} s)", file=sys.stderr)
    return row


def decoding_rows(size: Size, data: Data, plan: Plan) -> list[dict[str, Any]]:
    sources = decode_sources(data.corpus, plan.decode_sentences)
    ours, base, beam = ours_model(data, size).eval(), baseline_model(data, size).eval(), PARAMS.decode.beam
    rows = [
        decode_row("greedy", "ours, greedy, batched", lambda s: decode_ours(ours, s, 1), sources, size),
        decode_row("beam", f"ours, beam {beam}, batched", lambda s: decode_ours(ours, s, beam), sources, size),
        decode_row("baseline-greedy", "baseline, one by one", lambda s: decode_baseline(base, s), sources, size),
    ]
    return compare(rows, {"greedy": "baseline-greedy", "beam": "baseline-greedy"})


# ---------------------------------------------------------------------------- a trained model against CTranslate2


def model_rows(
    model_path: Path, source: Path, reference: Path, work: Path, beam: int | None = None
) -> list[dict[str, Any]]:
    """Ours (batched, the model's decode params) against its CTranslate2 export in float32 and int8,
    on the same sentences and threads: target tokens/s (</s> included) and BLEU (sacreBLEU, detokenized)."""
    import sacrebleu

    from transformer.data.tokenize import detokenize
    from transformer.decoding.translate import Translator
    from transformer.io import read_lines
    from transformer.serving.export import ctranslate2_translate, export_ctranslate2, load_ctranslate2

    translator = Translator(model_path, device="cpu")
    search = translator.search(beam=beam) if beam else translator.search()
    lines, refs = read_lines(source), read_lines(reference)
    for q in ("none", "int8"):
        export_ctranslate2(model_path, work / q, q)

    def ours(batch: list[str]) -> tuple[list[str], int]:
        translator.tokens_out = 0
        out = translator.translate_tokenized(batch, search)
        return out, translator.tokens_out

    def theirs(q: str) -> Callable[[list[str]], tuple[list[str], int]]:
        engine = load_ctranslate2(work / q, torch.get_num_threads())  # same threads as ours

        def run(batch: list[str]) -> tuple[list[str], int]:
            ids = ctranslate2_translate(engine, translator.src_vocab, translator.tgt_vocab, batch, search)
            produced = sum(len(i) + 1 for i, line in zip(ids, batch) if line.strip())  # + </s>, as ours counts
            return [detokenize(translator.tgt_vocab.decode(i)) for i in ids], produced

        return run

    rows = []
    for key, label, dtype, run in (
        ("ours-beam", f"ours, beam {search.beam}, batched", "fp32", ours),
        ("ctranslate2-fp32", f"CTranslate2, beam {search.beam}", "fp32", theirs("none")),
        ("ctranslate2-int8", f"CTranslate2, beam {search.beam}", "int8", theirs("int8")),
    ):
        run(lines[:8])  # warm-up
        with Clock() as clock:
            hyps, tokens = run(lines)
        rows.append(
            {
                "size": "model",
                "key": key,
                "row": label,
                "dtype": dtype,
                "sentences": len(lines),
                "seconds": round(clock.seconds, 3),
                "target_tokens": tokens,
                "tokens_per_s": round(tokens / clock.seconds, 1),
                "sentences_per_s": round(len(lines) / clock.seconds, 2),
                "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                "threads": torch.get_num_threads(),
                "other_cores_busy": round(clock.others, 2),
            }
        )
        print(
            f"  model {key:<20} {rows[-1]['tokens_per_s']:>9,.0f} tok/s  BLEU {rows[-1]['bleu']}",
            file=sys.stderr,
        )
    return compare(rows, {"ours-beam": "ctranslate2-fp32", "ctranslate2-int8": "ctranslate2-fp32"})


# ---------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    return {
        "hardware": host_class(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "allocator": allocator(),
        "kernel_cache": kernel_cache(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }


def table(peaks: dict[str, float], peak_busy: float, rows: list[dict[str, Any]]) -> str:
    bf16 = f"{peaks['bf16']:.0f} GFLOP/s" if "bf16" in peaks else "not measured (no bf16 hardware: its rows left out)"
    lines = [
        f"matmul peak (2048×2048): fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {bf16}",
        f"{'size':<6} {'row':<22} {'dtype':<5} {'tok/s':>8} {'sent/s':>7} {'MFU %':>6} {'ratio':>26} {'others':>6}",
    ]
    for r in rows:
        sent = f"{r['sentences_per_s']:.1f}" if "sentences_per_s" in r else "-"
        mfu = f"{100 * r['mfu']:.1f}" if "mfu" in r else "-"
        ratio = f"{r['ratio']:.2f}× {r['vs']}" if r["vs"] else "1 (ref)"
        lines.append(
            f"{r['size']:<6} {r['key']:<22} {r['dtype']:<5} {r['tokens_per_s']:>8,.0f} "
            f"{sent:>7} {mfu:>6} {ratio:>26} {r['other_cores_busy']:>6.2f}"
        )
    busy = max([peak_busy] + [r["other_cores_busy"] for r in rows])
    if busy > 0.2:
        lines.append(
            f"warning: other processes kept up to {busy:.2f} cores busy during a row ('others'): "
            f"its figures are low and the ratios noisy; rerun on a quiet machine"
        )
    return "\n".join(lines)


def row_names(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    """--rows: training rows by name, comma-separated."""
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(set(names) - set(ROW_NAMES))
    if unknown:
        raise click.BadParameter(f"no row {', '.join(unknown)}; the rows: {', '.join(ROW_NAMES)}")
    return names


@click.command()
@click.option("--quick", is_flag=True, help="Small size only, shorter rows (about a minute).")
@VOCAB_DIR
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=ROOT / "reports" / "bench.json", show_default=True
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="a trained model file: measure only its decoding, ours against CTranslate2 fp32 and int8 "
    "(needs --source and --reference)",
)
@click.option(
    "--source",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="tokenized source, e.g. data/tokenized/test2016.de",
)
@click.option(
    "--reference",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="raw reference, e.g. data/raw/test2016.en",
)
@click.option(
    "--rows",
    "names",
    default=None,
    callback=row_names,
    help="only these training rows, by name, comma-separated (e.g. plain-fp32,plain-bf16); no decoding rows",
)
def main(
    quick: bool,
    vocab_dir: Path | None,
    out: Path,
    model_path: Path | None,
    source: Path | None,
    reference: Path | None,
    names: tuple[str, ...] | None,
) -> None:
    """Training and decoding speed of ours against the Annotated Transformer's way; see the module docstring."""
    plan = QUICK if quick else FULL
    start = time.perf_counter()
    info = machine()
    if model_path:
        if not (source and reference):
            raise click.UsageError("--model needs --source and --reference")
        with tempfile.TemporaryDirectory() as tmp:
            rows = model_rows(model_path, source, reference, Path(tmp))
        print(table({"fp32": 0.0, "bf16": 0.0}, 0.0, rows).split("\n", 1)[1])
        runtime = round(time.perf_counter() - start, 1)
        report = {"model": str(model_path), "source": str(source), "model_decode": rows, "runtime_s": runtime}
        write_json(out, {"machine": info} | report)
        return
    with Clock() as clock:
        peaks = {name: matmul_peak(dtype, plan.matmul_seconds) for name, dtype in dtypes_here().items()}
    info["other_cores_busy_during_peak"] = round(clock.others, 2)
    with tempfile.TemporaryDirectory() as tmp:
        data = load_data(vocab_dir, Path(tmp))
        train, decode = [], []
        for name in plan.sizes:
            train += training_rows(SIZES[name], data, plan, peaks, names)
            decode += [] if names else decoding_rows(SIZES[name], data, plan)
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    info["peak_rss_mb"] = round(peak_rss_mb())
    runtime = time.perf_counter() - start
    by_size = sorted(train + decode, key=lambda r: plan.sizes.index(r["size"]))  # stable: keys stay in order
    print(table(peaks, info["other_cores_busy_during_peak"], by_size))
    print(
        f"decoding: untrained models, eos disabled, every sentence decoded to source length + {EXTRA}; "
        f"runtime {runtime:.0f} s"
    )
    write_json(
        out,
        {
            "machine": info,
            "data": data.origin,
            "plan": asdict(plan),
            "quick": quick,
            "sizes": {n: asdict(SIZES[n]) for n in plan.sizes},
            "peak_gflops": {k: round(v, 1) for k, v in peaks.items()},
            "train": train,
            "decode": decode,
            "runtime_s": round(runtime, 1),
            "flops_formula": train_flops.__doc__,
        },
    )


if __name__ == "__main__":
    training_memory()  # the kernel cache and malloc training runs with
    main()
