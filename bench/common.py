"""What the bench scripts share: the synthetic corpus, training's batches and update, model FLOPs
and the matmul peak that MFU is measured against."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from transformer.config import load_params
from transformer.data.batching import Batch, ParallelCorpus, token_batches
from transformer.data.vocab import PAD, load_vocabs
from transformer.kernels.accelerate import accelerate, attention_backends
from transformer.kernels.attention import CpuAttention
from transformer.kernels.packing import PackedAttention
from transformer.model.model import Transformer, make_model
from transformer.training.loss import Loss
from transformer.training.train import StepLoss, compiled, make_optimizer

ROOT = Path(__file__).resolve().parents[1]
PARAMS = load_params(ROOT / "params.yaml")  # the default recipe's batching, smoothing and decoding
SEED = 1234
SYNTHETIC_VOCAB = 8000
MULTI30K_TRAIN = 29_000  # sentence pairs
ANNOTATED_PADDING = 72  # the Annotated Transformer's fixed length, source and target with <s> and </s>
LEARNING_RATE = 1e-4  # training's schedule sets one per update; a fixed one times the same work
COMPILE_BACKEND = "inductor"  # train.compile's (transformer.training.train.compiled); tests trace with aot_eager
RDROP = 5.0  # the alpha of the R-Drop preset (params/multi30k_en_de_rdrop.yaml); its cost does not depend on it

Step = Callable[[Batch], torch.Tensor]


@dataclass(frozen=True)
class Size:
    name: str
    N: int
    d_model: int
    d_ff: int
    h: int


SIZES = {"small": Size("small", 3, 256, 1024, 4), "base": Size("base", 6, 512, 2048, 8)}


@dataclass(frozen=True)
class Data:
    corpus: ParallelCorpus
    src_vocab: int
    tgt_vocab: int
    joint: bool
    origin: str


VOCAB_DIR = click.option(
    "--vocab-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A build_vocab output (train.pt, vocab.pt) for real token ids; default: the synthetic corpus.",
)


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
    """The Annotated Transformer's fixed padding: source and <s> target </s> to `length`, so length - 1
    after the shift."""

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
        "annotated recipe": [pad_to(b, ANNOTATED_PADDING) for b in sentence_batches(corpus, 32, count, SEED + 1)],
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


# ---------------------------------------------------------------------------- training's update


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
    loss_of = StepLoss(model, Loss(PAD, PARAMS.train.label_smoothing), shared_encoder=shared_encoder, share=share)
    if compile:  # as training: the plain step, traced
        loss_of = compiled(loss_of, COMPILE_BACKEND)
    else:
        accelerate(loss_of, device)
    if default_kernel:  # the device's twins, but attention in torch's kernel
        for part in model.modules():
            if type(part) is CpuAttention:
                part.__class__ = PackedAttention
    kernels = contextlib.nullcontext if default_kernel else lambda: attention_backends(device)

    def step(batch: Batch) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), kernels():
            loss = loss_of(batch, rdrop)
            (loss / batch.ntokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
