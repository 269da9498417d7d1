"""Speed of the project's model against the seed-style baseline, side by side in one process.

Run from the repository root (about 11 minutes on 2 cores; --quick: about 1.5 minutes, small size only):

    python bench/bench.py [--quick] [--vocab-dir data/vocab] [--out reports/bench.json]

It prints one table and writes all figures, with the machine's description, to reports/bench.json.

What is measured, on one machine, one model size at a time (small: N=3, d_model=256,
d_ff=1024, h=4; base: N=6, d_model=512, d_ff=2048, h=8), pre-norm, dropout 0.1:

- matmul peak: a 2048×2048 matmul repeated after warm-up, fp32 and bf16, in GFLOP/s. It is
  the denominator of MFU (model FLOPs utilization) for rows of that dtype.
- training, target tokens/s and MFU, a few warm-up updates then timed updates (Adam, fused
  for ours as in training, label smoothing 0.1, dropout on); batches are built before the clock starts:
    a. ours, 256 sentences: transformer.model.model.make_model + transformer.training.loss.batch_loss,
       fp32, 256 random sentences padded to the batch's longest (ParallelCorpus.batch). They
       are about 45% real tokens, so the model packs both sides (transformer.kernels.packing).
    b. baseline, 256 sentences: bench/baseline.py (the seed's way of computing the same
       model) on the very same batches as a.
    c. ours, token batches: the project's default batching, token_batches with
       max_tokens = 3000 (train.max_tokens), fp32.
    d. baseline, seed recipe: 32 sentences padded to a fixed 72 tokens, as the seed trains
       (without its gradient accumulation, which changes the update count, not the speed).
    e. ours, token batches, bf16: c under torch.autocast("cpu", dtype=torch.bfloat16), with the
       attention kernels training picks for it (transformer.model.attention.attention_kernels).
    f. ours, token batches, bf16, torch's default attention kernel (flash on this CPU): what
       the choice in e buys.
    r. ours, token batches, R-Drop: c with train.rdrop 5.0, each batch run twice in one forward
       (transformer.training.loss.rdrop_loss), fp32. Its tokens/s counts each batch's tokens once: the
       speed through the corpus, against c's. Its MFU credits both passes.
    s. ours, token batches, R-Drop, bf16: r under e's autocast, against e: what R-Drop costs
       where training runs in bf16.
    t. ours, token batches, with glibc's malloc defaults: c with the large blocks mapped and
       unmapped each update, as glibc does unless told otherwise; every other row of ours keeps
       freed memory for reuse, as training does on glibc's malloc (transformer.kernels.memory.keep_freed_memory),
       and the baseline's rows run with glibc's defaults, as the seed does.
    u. the same against e, in bf16.
    m. c on batches padded to multiples of 8 tokens a side (train.pad_multiple 8), batched for it
       (fewer sentences where rounding up outgrows max_tokens). Against c: what the padding costs.
    n. m under torch.compile (train.compile: the model, its generator and the loss, inductor,
       sizes symbolic), compiled in its warm-up updates. Against m: compile on and off, same batches.
    o. the same as m against e, in bf16.
    p. the same as n against o, in bf16.
  The bench runs with the memory settings training runs with (transformer.kernels.memory.training_memory):
  oneDNN's kernel cache limited, and mimalloc where it is installed, where rows t and u, which
  are about glibc's settings, are left out; TRANSFORMER_ALLOCATOR=glibc runs every row on glibc's.
  bench/allocators.py sets them side by side with glibc's heap and oneDNN's default cache.
    v. r with a shared encoder (train.rdrop_shared_encoder): the batch is encoded once and
       decoded twice, so the two passes differ in the decoder's dropout alone. Against r.
       Its MFU credits one encoder pass and two decoder passes.
    w. the same against s, in bf16.
    x. r on half of each batch's sentences (train.rdrop_share 0.5): the drawn half runs twice,
       the other half once. Against r. Its MFU credits 1.5 passes, the mean over the draws.
    y. the same against s, in bf16.
  The ratio compares a with b (same batches: the model's code alone), c, e, f with d (the
  project's training recipe against the seed's), r with c and s with e (what R-Drop costs in
  fp32 and in bf16), t with c and u with e (what keeping freed memory buys, as their inverse),
  v with r and w with s (what sharing the encoder pass saves R-Drop), x with r and y with s
  (what R-Drop on half the sentences saves), m with c and o with e (what padding to 8 costs), n with
  m and p with o (what torch.compile gains on those batches).
  Rows e, f, o, p, s, u, w and y, and the bf16 peak, are left out on a CPU without bf16
  hardware (AVX512_BF16 or AMX), where torch emulates bf16 at a few percent of fp32's speed
  and training runs in fp32 (train.precision: auto).
- decoding, target tokens/s and sentences/s, untrained models in eval mode, on source
  sentences of test2016-like lengths: ours greedy and beam 4 (transformer.decoding.search, batched by
  length as transformer.decoding.translate does), and the baseline's greedy, one sentence at a time,
  re-running the decoder over the whole prefix. An untrained model may never (or at once)
  emit </s>, so every search gets eos = -1, an id no token has: each sentence is decoded to
  exactly its max length, source length + 5, for ours and the baseline alike.

Data: by default a synthetic corpus with the size and length distribution of Multi30k de-en
under joint BPE 8000 (29,000 pairs; source ≈ 14.8 ± 5.4 tokens, target ≈ 14.3 ± 4.8; random
ids in [4, 8000), joint vocabulary, tied embeddings), seeded, so runs are comparable.
--vocab-dir takes the build_vocab stage's output instead (vocab.pt and train.pt) for real
token ids; ours then ties embeddings only if the vocabulary is joint (bpe). The baseline never
ties, as in the seed: that changes the parameter count, not the FLOPs.

The baseline rows time the model's update or search alone: the seed's own loop also
tokenizes with spaCy inside its DataLoader, so it runs slower than row b or d.

Other processes on the machine slow every row, small-op rows (decoding, 32-sentence batches)
the most, as their threads lose the cores. The column "others" is how many cores other
processes kept busy meanwhile (from /proc/stat); a warning follows the table above 0.2.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # baseline.py sits beside this script, outside the package
import baseline  # noqa: E402

from transformer.config import load_params  # noqa: E402
from transformer.data.batching import Batch, ParallelCorpus, token_batches  # noqa: E402
from transformer.data.vocab import BOS, PAD, load_vocabs  # noqa: E402
from transformer.decoding.search import beam_search  # noqa: E402
from transformer.decoding.translate import batched_search  # noqa: E402
from transformer.evaluation.system import hardware  # noqa: E402
from transformer.io import write_json  # noqa: E402
from transformer.kernels.memory import allocator, keep_freed_memory, kernel_cache, peak_rss_mb, training_memory  # noqa: E402
from transformer.kernels.select import attention_kernels  # noqa: E402
from transformer.model.model import Transformer, make_model  # noqa: E402
from transformer.training.distributed import use_bf16  # noqa: E402
from transformer.training.train import StepLoss, compiled, make_optimizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARAMS = load_params(ROOT / "params.yaml")  # the default recipe's batching, smoothing and decoding
SEED = 1234
SYNTHETIC_VOCAB = 8000
MULTI30K_TRAIN = 29_000  # sentence pairs
SEED_PADDING = 72  # the seed recipe's fixed length, source and target with <s> and </s>
NO_EOS = -1  # an id no token has: searches run every sentence to its max length
EXTRA = 5  # decoded length = source length + EXTRA
MAX_BATCHES = 40  # built per training row, warm-up included
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LEARNING_RATE = 1e-4  # training's schedule sets one per update; a fixed one times the same work
COMPILE_BACKEND = "inductor"  # train.compile's (transformer.training.train.compiled); tests trace with aot_eager


@dataclass(frozen=True)
class Size:
    name: str
    N: int
    d_model: int
    d_ff: int
    h: int


SIZES = {"small": Size("small", 3, 256, 1024, 4), "base": Size("base", 6, 512, 2048, 8)}


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


@dataclass(frozen=True)
class Data:
    corpus: ParallelCorpus
    src_vocab: int
    tgt_vocab: int
    joint: bool
    origin: str


# ---------------------------------------------------------------------------- data


def synthetic_lengths(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """Sentence lengths in tokens, without specials, like Multi30k de-en with joint BPE 8000
    (train: source 14.8 ± 5.4, target 14.3 ± 4.8, longest 52): a right-skewed gamma for the
    source, the target a noisy linear function of it."""
    mean, sd = 14.8, 5.4
    src = [min(60, max(2, round(rng.gammavariate((mean / sd) ** 2, sd * sd / mean)))) for _ in range(n)]
    tgt = [min(60, max(2, round(0.85 * s + 1.72 + rng.gauss(0.0, 1.4)))) for s in src]
    return src, tgt


def write_synthetic(path: Path, n: int, vocab: int, seed: int) -> None:
    """A corpus file in the build_vocab stage's format: random ids in [4, vocab) (no specials)."""
    src_lens, tgt_lens = synthetic_lengths(random.Random(seed), n)
    g = torch.Generator().manual_seed(seed)
    data = {}
    for side, lens in (("src", src_lens), ("tgt", tgt_lens)):
        data[side] = torch.randint(4, vocab, (sum(lens),), generator=g, dtype=torch.int32)
        data[f"{side}_offsets"] = torch.cumsum(torch.tensor([0] + lens), 0)
    torch.save(data, path)


def load_data(vocab_dir: Path | None, tmp: Path) -> Data:
    if vocab_dir is None:
        path = tmp / "synthetic.pt"
        write_synthetic(path, MULTI30K_TRAIN, SYNTHETIC_VOCAB, SEED)
        return Data(ParallelCorpus(path), SYNTHETIC_VOCAB, SYNTHETIC_VOCAB, True, "synthetic, Multi30k-like lengths")
    src, tgt = load_vocabs(vocab_dir)
    return Data(
        ParallelCorpus(vocab_dir / "train.pt"),
        len(src),
        len(tgt),
        src.kind == "bpe",
        f"{vocab_dir / 'train.pt'} ({src.kind} vocabulary)",
    )


def sentence_batches(corpus: ParallelCorpus, sentences: int, count: int, seed: int) -> list[Batch]:
    """`count` batches of `sentences` random sentences, each padded to its own longest."""
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(seed)).tolist()
    return [corpus.batch(order[i * sentences : (i + 1) * sentences]) for i in range(count)]


def pad_to(batch: Batch, length: int) -> Batch:
    """The seed's fixed padding: source and <s> target </s> to `length`, so length - 1 after the shift."""

    def pad(t: torch.Tensor, n: int) -> torch.Tensor:
        return F.pad(t, (0, n - t.size(1)), value=PAD)

    return Batch(pad(batch.src, length), pad(batch.tgt_in, length - 1), pad(batch.tgt_out, length - 1), batch.ntokens)


def training_batches(corpus: ParallelCorpus, count: int) -> dict[str, list[Batch]]:
    lens = (corpus.src_lens, corpus.tgt_lens)
    index = token_batches(*lens, PARAMS.train.max_tokens, SEED)[:count]
    return {
        "256 sentences": sentence_batches(corpus, 256, count, SEED),
        "token batches": [corpus.batch(i) for i in index],
        "token batches to 8": [
            corpus.batch(i, 8) for i in token_batches(*lens, PARAMS.train.max_tokens, SEED, 8)[:count]
        ],
        "seed recipe": [pad_to(b, SEED_PADDING) for b in sentence_batches(corpus, 32, count, SEED + 1)],
    }


# ---------------------------------------------------------------------------- FLOPs


def train_flops(batch: Batch, size: Size, tgt_vocab: int, passes: float = 1, shared_encoder: bool = False) -> float:
    """Model FLOPs of one training update (forward and backward) on the real tokens of `batch`,
    run `passes` times (R-Drop's 2; 1.5 on half the sentences, on average), the encoder once with
    `shared_encoder`.

    Every weight of a matmul costs 6 FLOPs per token it is applied to (2 forward, 4 backward;
    Kaplan et al. 2020), with S the source tokens (with </s>) and T the target tokens (with </s>):
        encoder, per source token:  N (4 d_model² + 2 d_model d_ff)
        decoder, per target token:  N (8 d_model² + 2 d_model d_ff) + d_model V   (V: generator)
    Attention adds QKᵀ and AV, 2 d_model FLOPs each per (query, attended key) pair and layer,
    times 3 for training, over the pairs the masks allow, per sentence:
        12 N d_model (S² + T(T + 1)/2 + T S)   (encoder self, causal decoder self, source)
    Padding, embedding look-ups, biases, norms, softmax and the optimizer are not counted: MFU
    credits useful work only, so time spent on padding lowers it."""
    S = (batch.src != PAD).sum(1).double()  # (B,)
    T = (batch.tgt_out != PAD).sum(1).double()
    N, d, d_ff = size.N, size.d_model, size.d_ff
    encoder = 6 * N * (4 * d * d + 2 * d * d_ff) * S + 12 * N * d * S * S
    decoder = 6 * (N * (8 * d * d + 2 * d * d_ff) + d * tgt_vocab) * T + 12 * N * d * (T * (T + 1) / 2 + T * S)
    return float(((1 if shared_encoder else passes) * encoder + passes * decoder).sum())


def matmul_peak(dtype: torch.dtype, seconds: float, n: int = 2048) -> float:
    """GFLOP/s of an n×n by n×n matmul (2 n³ FLOPs), repeated for `seconds` after warm-up."""
    g = torch.Generator().manual_seed(SEED)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    c = torch.empty(n, n, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=c)
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < seconds:
        torch.mm(a, b, out=c)
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


# ---------------------------------------------------------------------------- training

Step = Callable[[Batch], torch.Tensor]


def ours_model(data: Data, size: Size) -> Transformer:
    torch.manual_seed(SEED)
    return make_model(
        src_vocab=data.src_vocab,
        tgt_vocab=data.tgt_vocab,
        N=size.N,
        d_model=size.d_model,
        d_ff=size.d_ff,
        h=size.h,
        dropout=0.1,
        norm="pre",
        tie_embeddings=data.joint,
        pad=PAD,
    )


def baseline_model(data: Data, size: Size) -> baseline.Baseline:
    torch.manual_seed(SEED)
    return baseline.make_baseline(data.src_vocab, data.tgt_vocab, size.N, size.d_model, size.d_ff, size.h, 0.1)


def ours_step(
    data: Data,
    size: Size,
    bf16: bool,
    default_kernel: bool = False,
    rdrop: float = 0.0,
    shared_encoder: bool = False,
    device: torch.device = torch.device("cpu"),  # noqa: B008 (a device is immutable)
    share: float = 1.0,
    compile: bool = False,
) -> Step:
    """One update the way transformer.training.train does it (loss normalized by target tokens);
    `default_kernel` leaves the attention backend to torch (or to the caller's context) instead
    of training's choice; `rdrop` > 0 runs R-Drop's two passes of the batch in one forward, as
    training does, over one encoder pass with `shared_encoder`, on a `share` of its sentences;
    `compile`: model, generator and loss under torch.compile, as train.compile has them.
    Batches should be on `device` already; the step does not wait for the device."""
    model = ours_model(data, size).to(device).train()
    optimizer = make_optimizer(model, PARAMS.train.weight_decay, device)
    for group in optimizer.param_groups:
        group["lr"] = LEARNING_RATE
    loss_of = StepLoss(model, PARAMS.train.label_smoothing, shared_encoder=shared_encoder, share=share)
    loss_of = compiled(loss_of, COMPILE_BACKEND) if compile else loss_of
    kernels = (lambda: contextlib.nullcontext()) if default_kernel else (lambda: attention_kernels(device, bf16))

    def step(batch: Batch) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), kernels():
            loss = loss_of(batch, rdrop)
            (loss / batch.ntokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def baseline_step(data: Data, size: Size) -> Step:
    model = baseline_model(data, size).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    criterion = baseline.LabelSmoothing(data.tgt_vocab, PAD, PARAMS.train.label_smoothing)
    return lambda b: baseline.train_step(model, criterion, optimizer, b.src, b.tgt_in, b.tgt_out, PAD)


def alternating_ms(runs: dict[str, Callable[[int], None]], warmup: int, reps: int) -> dict[str, float]:
    """The median milliseconds of each run over `reps` calls, the runs taking turns call by call
    after `warmup` untimed calls each; a run gets its call's index."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + reps):
        for name, run in runs.items():
            start = time.perf_counter()
            run(i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def print_speeds(title: str, ms: dict[str, float], reference: str) -> None:
    """alternating_ms's medians, each with its speed against the `reference` run's."""
    print(title)
    for name, m in ms.items():
        print(f"  {name:>14} {m:8.1f}   {ms[reference] / m:.2f}× {reference}'s speed")


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
    """The clock of the timed updates, and their batches. CPU ops run synchronously, so the
    clock needs no device sync."""
    for batch in batches[:warmup]:
        step(batch)
    timed = []
    with Clock() as clock:
        for batch in batches[warmup:]:
            step(batch)
            timed.append(batch)
            if len(timed) >= 2 and time.perf_counter() - clock.start >= seconds:
                break
    return clock, timed


def train_row(
    key: str,
    label: str,
    dtype: str,
    step: Step,
    batches: list[Batch],
    size: Size,
    data: Data,
    plan: Plan,
    peak: float,
    passes: float = 1,
    shared_encoder: bool = False,
) -> dict[str, Any]:
    """`passes`: forward passes of each batch an update runs (R-Drop's 2, 1.5 on half the sentences
    on average), the encoder's once with `shared_encoder`. Tokens/s counts each corpus token once,
    so it is the speed through the corpus; MFU credits every pass."""
    i = plan.sizes.index(size.name)
    clock, timed = time_training(step, batches, plan.warmup[i], plan.row_seconds[i])
    seconds = clock.seconds
    tokens = sum(b.ntokens for b in timed)
    flops = sum(train_flops(b, size, data.tgt_vocab, passes, shared_encoder) for b in timed)
    row = {
        "size": size.name,
        "key": key,
        "row": label,
        "dtype": dtype,
        "updates": len(timed),
        "seconds": round(seconds, 3),
        "target_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "flops_per_token": round(flops / tokens),
        "mfu": round(flops / seconds / (peak * 1e9), 4),
        "target_fill": round(tokens / sum(b.tgt_out.numel() for b in timed), 3),
        "other_cores_busy": round(clock.others, 2),
    }
    print(
        f"  {size.name} {key}. {label:<27} {row['tokens_per_s']:>9,.0f} tok/s  ({len(timed)} updates, {seconds:.1f} s)",
        file=sys.stderr,
    )
    gc.collect()
    return row


RDROP = 5.0  # the alpha of the R-Drop preset (params/multi30k_en_de_rdrop.yaml); its cost does not depend on it


@dataclass(frozen=True)
class TrainRow:
    """One training row: what it runs, and the row its speed is compared with (`vs`)."""

    key: str
    label: str
    batches: str  # a key of training_batches
    bf16: bool = False
    vs: str | None = None
    baseline: bool = False  # the seed's model and update instead of ours
    default_kernel: bool = False  # torch's attention kernel choice instead of training's
    rdrop: bool = False
    shared_encoder: bool = False  # with rdrop: one encoder pass for both
    share: float = 1.0  # with rdrop: the share of each batch's sentences run twice
    malloc_defaults: bool = False  # glibc's defaults instead of training's kept freed memory
    compile: bool = False  # model, generator and loss under torch.compile; it compiles in the warm-up


TRAIN_ROWS = (
    TrainRow("a", "ours, 256 sentences", "256 sentences", vs="b"),
    TrainRow("b", "baseline, 256 sentences", "256 sentences", baseline=True),
    TrainRow("c", "ours, token batches", "token batches", vs="d"),
    TrainRow("d", "baseline, seed recipe", "seed recipe", baseline=True),
    TrainRow("e", "ours, token batches, bf16", "token batches", bf16=True, vs="d"),
    TrainRow("f", "e with torch's default kernel", "token batches", bf16=True, vs="d", default_kernel=True),
    TrainRow("r", "c with R-Drop", "token batches", vs="c", rdrop=True),
    TrainRow("s", "e with R-Drop", "token batches", bf16=True, vs="e", rdrop=True),
    TrainRow("t", "c, glibc's malloc defaults", "token batches", vs="c", malloc_defaults=True),
    TrainRow("u", "e, glibc's malloc defaults", "token batches", bf16=True, vs="e", malloc_defaults=True),
    TrainRow("v", "r with a shared encoder", "token batches", vs="r", rdrop=True, shared_encoder=True),
    TrainRow("w", "s with a shared encoder", "token batches", bf16=True, vs="s", rdrop=True, shared_encoder=True),
    TrainRow("x", "r on half the sentences", "token batches", vs="r", rdrop=True, share=0.5),
    TrainRow("y", "s on half the sentences", "token batches", bf16=True, vs="s", rdrop=True, share=0.5),
    TrainRow("m", "c padded to multiples of 8", "token batches to 8", vs="c"),
    TrainRow("n", "m compiled", "token batches to 8", vs="m", compile=True),
    TrainRow("o", "e padded to multiples of 8", "token batches to 8", bf16=True, vs="e"),
    TrainRow("p", "o compiled", "token batches to 8", bf16=True, vs="o", compile=True),
)
COMPILE_WARMUP = 3  # untimed updates of a compiled row at least


def compile_warmup(batches: list[Batch]) -> int:
    """Untimed updates a compiled row runs: COMPILE_WARMUP at least and, where the first batch has
    S == T, up to and including the first batch with S != T. Dynamo's duck sizing gives S and T
    one symbol where they were equal at the first trace, and traces again where they part."""
    same = [b.src.size(1) == b.tgt_in.size(1) for b in batches]
    parted = same.index(False) + 1 if same[0] and not all(same) else 0
    return max(COMPILE_WARMUP, parted)


def training_rows(
    size: Size, data: Data, plan: Plan, peaks: dict[str, float], keys: str | None = None
) -> list[dict[str, Any]]:
    """The training rows of `keys` (all where None) that this machine can run: bf16 rows need bf16
    hardware, and glibc's malloc settings (t, u) a process on glibc's malloc."""
    batches = training_batches(data.corpus, MAX_BATCHES)
    rows = []
    for row in TRAIN_ROWS:
        dtype = "bf16" if row.bf16 else "fp32"
        if dtype not in peaks or (keys and row.key not in keys) or (row.malloc_defaults and allocator() != "glibc"):
            continue
        rdrop = RDROP if row.rdrop else 0.0
        keep_freed_memory(not (row.baseline or row.malloc_defaults))  # as training does; the seed does not
        step = (
            baseline_step(data, size)
            if row.baseline
            else ours_step(
                data,
                size,
                bf16=row.bf16,
                default_kernel=row.default_kernel,
                rdrop=rdrop,
                shared_encoder=row.shared_encoder,
                share=row.share,
                compile=row.compile,
            )
        )
        warmup = compile_warmup(batches[row.batches])
        warm = replace(plan, warmup=tuple(max(w, warmup) for w in plan.warmup)) if row.compile else plan
        rows.append(
            train_row(
                row.key,
                row.label,
                dtype,
                step,
                batches[row.batches],
                size,
                data,
                warm,
                peaks[dtype],
                1 + row.share if rdrop else 1,
                row.shared_encoder,
            )
        )
    keep_freed_memory()
    return compare(rows, {row.key: row.vs for row in TRAIN_ROWS if row.vs})


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
    run = functools.partial(beam_search, model, beam=beam, alpha=PARAMS.decode.alpha, bos=BOS, eos=NO_EOS)
    limits = [len(s) + EXTRA for s in sources]
    searched = batched_search(sources, limits, beam, PARAMS.decode.batch_tokens, torch.device("cpu"), run)
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
    print(f"  {size.name} {key}. {label:<27} {row['tokens_per_s']:>9,.0f} tok/s  ({seconds:.1f} s)", file=sys.stderr)
    return row


def decoding_rows(size: Size, data: Data, plan: Plan) -> list[dict[str, Any]]:
    sources = decode_sources(data.corpus, plan.decode_sentences)
    ours, base, beam = ours_model(data, size).eval(), baseline_model(data, size).eval(), PARAMS.decode.beam
    rows = [
        decode_row("g", "ours, greedy, batched", lambda s: decode_ours(ours, s, 1), sources, size),
        decode_row("h", f"ours, beam {beam}, batched", lambda s: decode_ours(ours, s, beam), sources, size),
        decode_row("i", "baseline, greedy, one by one", lambda s: decode_baseline(base, s), sources, size),
    ]
    return compare(rows, {"g": "i", "h": "i"})


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
    p = translator.params["decode"]
    beam = beam or p["beam"]
    lines, refs = read_lines(source), read_lines(reference)
    for q in ("none", "int8"):
        export_ctranslate2(model_path, work / q, q)

    def ours(batch: list[str]) -> tuple[list[str], int]:
        translator.tokens_out = 0
        out = translator.translate_tokenized(batch, beam=beam, alpha=p["alpha"], max_len_extra=p["max_len_extra"])
        return out, translator.tokens_out

    def theirs(q: str) -> Callable[[list[str]], tuple[list[str], int]]:
        engine = load_ctranslate2(work / q, torch.get_num_threads())  # same threads as ours

        def run(batch: list[str]) -> tuple[list[str], int]:
            ids = ctranslate2_translate(
                engine,
                translator.src_vocab,
                translator.tgt_vocab,
                batch,
                beam,
                p["alpha"],
                p["max_len_extra"],
                p["batch_tokens"] // beam,
            )
            produced = sum(len(i) + 1 for i, line in zip(ids, batch) if line.strip())  # + </s>, as ours counts
            return [detokenize(translator.tgt_vocab.decode(i)) for i in ids], produced

        return run

    rows = []
    for key, label, dtype, run in (
        ("j", f"ours, beam {beam}, batched", "fp32", ours),
        ("k", f"CTranslate2, beam {beam}", "fp32", theirs("none")),
        ("l", f"CTranslate2, beam {beam}", "int8", theirs("int8")),
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
            f"  model {key}. {label} {dtype:<5} {rows[-1]['tokens_per_s']:>9,.0f} tok/s  BLEU {rows[-1]['bleu']}",
            file=sys.stderr,
        )
    return compare(rows, {"j": "k", "l": "k"})


# ---------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    return {
        "hardware": hardware(),
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
    bf16 = (
        f"{peaks['bf16']:.0f} GFLOP/s" if "bf16" in peaks else "not measured (no bf16 hardware: rows e and f left out)"
    )
    lines = [
        f"matmul peak (2048×2048): fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {bf16}",
        f"{'size':<6} {'row':<32} {'dtype':<5} {'tok/s':>8} {'sent/s':>7} {'MFU %':>6} {'ratio':>10} {'others':>6}",
    ]
    for r in rows:
        sent = f"{r['sentences_per_s']:.1f}" if "sentences_per_s" in r else "-"
        mfu = f"{100 * r['mfu']:.1f}" if "mfu" in r else "-"
        ratio = f"{r['ratio']:.2f}× {r['vs']}" if r["vs"] else "1 (ref)"
        lines.append(
            f"{r['size']:<6} {r['key'] + '. ' + r['row']:<32} {r['dtype']:<5} {r['tokens_per_s']:>8,.0f} "
            f"{sent:>7} {mfu:>6} {ratio:>10} {r['other_cores_busy']:>6.2f}"
        )
    busy = max([peak_busy] + [r["other_cores_busy"] for r in rows])
    if busy > 0.2:
        lines.append(
            f"warning: other processes kept up to {busy:.2f} cores busy during a row ('others'): "
            f"its figures are low and the ratios noisy; rerun on a quiet machine"
        )
    return "\n".join(lines)


# Options the bench scripts share.
VOCAB_DIR = click.option(
    "--vocab-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A build_vocab output (train.pt, vocab.pt) for real token ids; default: the synthetic corpus.",
)


def rdrop_options(rdrop: float) -> Callable:
    """--rdrop (R-Drop's α, `rdrop` by default; 0: the plain update) and --share (train.rdrop_share)."""

    def options(command: Callable) -> Callable:
        command = click.option(
            "--share",
            type=click.FloatRange(min=0.0, max=1.0, min_open=True),
            default=1.0,
            show_default=True,
            help="The share of each batch's sentences R-Drop passes twice (train.rdrop_share)",
        )(command)
        return click.option(
            "--rdrop", type=click.FloatRange(min=0.0), default=rdrop, show_default=True, help="R-Drop's α; 0: plain"
        )(command)

    return options


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
    help="tokenized source, e.g. data/tokenized/test2016.en",
)
@click.option(
    "--reference",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="raw reference, e.g. data/raw/test2016.de",
)
@click.option("--rows", "keys", default=None, help="only these training rows, by key (e.g. ce); no decoding rows")
def main(
    quick: bool,
    vocab_dir: Path | None,
    out: Path,
    model_path: Path | None,
    source: Path | None,
    reference: Path | None,
    keys: str | None,
) -> None:
    """Training and decoding speed of ours against the seed-style baseline; see the module docstring."""
    plan = QUICK if quick else FULL
    start = time.perf_counter()
    info = machine()
    if model_path:
        if not (source and reference):
            raise click.UsageError("--model needs --source and --reference")
        with tempfile.TemporaryDirectory() as tmp:
            rows = model_rows(model_path, source, reference, Path(tmp))
        print(table({"fp32": 0.0, "bf16": 0.0}, 0.0, rows).split("\n", 1)[1])
        write_json(
            out,
            {
                "machine": info,
                "model": str(model_path),
                "source": str(source),
                "model_decode": rows,
                "runtime_s": round(time.perf_counter() - start, 1),
            },
        )
        return
    with Clock() as clock:
        dtypes = DTYPES if use_bf16("auto", torch.device("cpu")) else {"fp32": torch.float32}
        peaks = {name: matmul_peak(dtype, plan.matmul_seconds) for name, dtype in dtypes.items()}
    info["other_cores_busy_during_peak"] = round(clock.others, 2)
    with tempfile.TemporaryDirectory() as tmp:
        data = load_data(vocab_dir, Path(tmp))
        train, decode = [], []
        for name in plan.sizes:
            train += training_rows(SIZES[name], data, plan, peaks, keys)
            decode += [] if keys else decoding_rows(SIZES[name], data, plan)
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
