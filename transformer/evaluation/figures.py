"""Figures of a trained model: attention maps (as in the paper's Figures 3-5), the learning-rate
schedule of section 5.3, and the loss curves. matplotlib (Agg) is imported only to draw."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transformer.data.tokenize import JOINER
from transformer.data.vocab import BOS, EOS, PAD, SPECIALS, BpeVocab, Vocab, model_vocabs
from transformer.decoding.search import greedy
from transformer.io import DataError, atomic_dir, read_lines
from transformer.model.model import Transformer
from transformer.training.schedule import rate

SENTENCES = 3  # the first non-empty sentences of the source file are drawn
WARMUPS = (2000, 4000, 8000)  # schedules drawn beside the params' own, for comparison
SPECIAL_IDS = range(len(SPECIALS))  # <s>, </s>, <blank>, <unk>: the first ids of every vocabulary
WORD_START = "\u2581"  # ▁, sentencepiece's mark of a piece that begins a word
PNG = {"dpi": 100, "metadata": {"Software": None}}  # no version stamp: same model, same bytes


@dataclass
class AttentionMaps:
    """One sentence's last-layer attention weights, one map per head, with the tokens of both axes."""

    src: list[str]  # source tokens, ending with </s>
    inputs: list[str]  # decoder inputs: <s> and the greedy translation
    outputs: list[str]  # what each decoder position predicts: the translation and </s>
    encoder: torch.Tensor  # (h, S, S) encoder self-attention
    decoder: torch.Tensor  # (h, T, T) decoder self-attention
    source: torch.Tensor  # (h, T, S) decoder-source attention

    def alignment(self) -> torch.Tensor:
        """Where each written token looked in the source: source attention, the mean of the heads, (T, S)."""
        return self.source.float().mean(0)


def labels(vocab: Vocab, ids: list[int]) -> list[str]:
    """Axis labels as a reader takes the tokens: a word, or a word's first BPE piece, bare; a piece
    that goes on with the word before it after a middle dot (`bran`, `·ches`); specials as they are.
    The marks the model reads go: sentencepiece's ▁, which begins a word, and the tokenizer's joiner
    ￭, which glues punctuation to what precedes it."""
    if not isinstance(vocab, BpeVocab):
        return [vocab.itos[i].replace(JOINER, "") for i in ids]
    shown = []
    for i in ids:
        piece = vocab.sp.id_to_piece(i)
        if i in SPECIAL_IDS:
            shown.append(piece)
            continue
        text = piece.replace(JOINER, "")
        shown.append(text[1:] if text.startswith(WORD_START) else "·" + text)
    return shown


@torch.no_grad()
def attention_maps(
    model, src_vocab: Vocab, tgt_vocab: Vocab, lines: list[str], max_len_extra: int
) -> list[AttentionMaps]:
    """Translates `lines` greedily, then runs the full forward pass on (source, translation)
    recording the last layers' attention weights."""
    model.eval()
    encoded = [src_vocab.encode(line) + [EOS] for line in lines]
    src = _pad([torch.tensor(e) for e in encoded])
    max_len = torch.tensor([len(e) + max_len_extra for e in encoded])
    hyps = greedy(model, src, max_len, BOS, EOS)
    tgt_in = _pad([torch.tensor([BOS] + h) for h in hyps])
    layers = (model.encoder.layers[-1].self_attn, model.decoder.layers[-1].self_attn, model.decoder.layers[-1].src_attn)
    for attention in layers:
        attention.keep_weights = True
    try:
        model(src, tgt_in)
    finally:
        for attention in layers:
            attention.keep_weights = False
    encoder, decoder, source = (attention.weights for attention in layers)  # (B, h, T, S) each
    maps = []
    for i, (e, hyp) in enumerate(zip(encoded, hyps)):
        S, T = len(e), len(hyp) + 1
        maps.append(
            AttentionMaps(
                labels(src_vocab, e),
                labels(tgt_vocab, [BOS] + hyp),
                labels(tgt_vocab, hyp + [EOS]),
                encoder[i, :, :S, :S],
                decoder[i, :, :T, :T],
                source[i, :, :T, :S],
            )
        )
    return maps


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)


def schedule_curves(d_model: int, factor: float, warmup: int, steps: int) -> dict[int, list[float]]:
    """lrate over steps 1..`steps` for the given warmup and each of WARMUPS (same d_model and factor)."""
    return {w: [rate(s, d_model, factor, w) for s in range(1, steps + 1)] for w in sorted({warmup, *WARMUPS})}


def read_tsv(path: Path) -> dict[str, list[float]]:
    """A train report (header line, then numbers) as columns."""
    lines = read_lines(path)
    if not lines:
        raise DataError(f"{path}: empty report (no header line)")
    header = lines[0].split("\t")
    rows = [line.split("\t") for line in lines[1:] if line]
    try:
        return {name: [float(row[i]) for row in rows] for i, name in enumerate(header)}
    except (ValueError, IndexError):
        raise DataError(f"{path}: a row is not {len(header)} tab-separated numbers") from None


def draw_figures(
    model: Transformer,
    ckpt: dict[str, Any],
    source: Path,
    steps_tsv: Path,
    epochs_tsv: Path,
    out_dir: Path,
    *,
    d_model: int,
    factor: float,
    warmup: int,
    cooldown: float,
) -> list[Path]:
    """Writes every figure of `model` (with its checkpoint's vocabularies) and of the train reports
    as a PNG into `out_dir`, built aside and swapped in whole."""
    import matplotlib

    matplotlib.use("Agg")
    src_vocab, tgt_vocab = model_vocabs(ckpt)
    lines = [line for line in read_lines(source) if line.strip()][:SENTENCES]
    if not lines:
        raise DataError(f"{source}: no sentence to draw attention for")
    maps = attention_maps(model, src_vocab, tgt_vocab, lines, ckpt["params"]["decode"]["max_len_extra"])
    steps, epochs = read_tsv(steps_tsv), read_tsv(epochs_tsv)
    with atomic_dir(out_dir) as tmp:
        for n, m in enumerate(maps, 1):
            sentence_heatmaps(m, n, tmp)
        alignment(maps[0], tmp / "alignment_1.png")
        lr_figure(d_model, factor, warmup, steps, tmp / "lr_schedule.png", cooldown)
        loss_figure(steps, epochs, tmp / "loss.png")
        names = sorted(p.name for p in tmp.iterdir())
    return [out_dir / name for name in names]


def sentence_heatmaps(m: AttentionMaps, n: int, out_dir: Path) -> None:
    """Sentence n's three maps, a PNG each: encoder self-, decoder self- and decoder-source attention."""
    maps = {  # name: weights, their rows and columns, what they are, the axes
        "encoder": (m.encoder, m.src, m.src, "encoder self-attention", "key (source)", "query (source)"),
        "decoder": (
            m.decoder,
            m.outputs,
            m.inputs,
            "decoder self-attention",
            "key (decoder input)",
            "query (predicting)",
        ),
        "source": (m.source, m.outputs, m.src, "decoder-source attention", "key (source)", "query (predicting)"),
    }
    for name, (weights, rows, cols, what, xlabel, ylabel) in maps.items():
        title = f"{what}, last layer, sentence {n}"
        heatmaps(weights, rows, cols, out_dir / f"attention_{n}_{name}.png", title=title, xlabel=xlabel, ylabel=ylabel)


def alignment(m: AttentionMaps, path: Path) -> None:
    """One sentence's decoder-source attention in the last layer, averaged over its heads, large enough
    to read at a page's width: for each word the model writes, where in the source it looked."""
    from matplotlib.figure import Figure

    fig = Figure(layout="constrained")
    draw_alignment(fig, m.alignment(), m.src, m.outputs)
    fig.suptitle("Where the translation looks in the source: the last layer's source attention")
    fig.savefig(path, **PNG)


def draw_alignment(fig, weights: torch.Tensor, sources: list[str], outputs: list[str]):
    """Draws source attention `weights` (T, S), a row per written token of `outputs` over the tokens
    of `sources`, onto the matplotlib figure `fig`, sized to keep every label readable; its axes."""
    fig.set_size_inches(1.5 + 0.42 * len(sources), 1.2 + 0.42 * len(outputs))
    ax = fig.subplots()
    image = ax.imshow(weights.numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_xticks(range(len(sources)), sources, rotation=60, ha="right", rotation_mode="anchor", fontsize=12)
    ax.set_yticks(range(len(outputs)), outputs, fontsize=12)
    ax.set(xlabel="source", ylabel="translation (each row: the word being written)")
    fig.colorbar(image, ax=ax, shrink=0.8, label="attention weight, mean of the heads")
    return ax


def heatmaps(
    weights: torch.Tensor, rows: list[str], cols: list[str], path: Path, *, title: str, xlabel: str, ylabel: str
) -> None:
    """One heatmap per head, in a grid of up to 4 columns, tokens on both axes."""
    from matplotlib.figure import Figure

    h, n = weights.size(0), max(len(rows), len(cols))
    ncols = min(h, 4)
    nrows = math.ceil(h / ncols)
    cell = min(10.0, max(3.0, 0.2 * n))  # inches per head
    fontsize = max(4.0, min(9.0, 150 / n))
    fig = Figure(figsize=(ncols * cell + 1, nrows * cell + 0.8), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.set_axis_off()
            continue
        image = ax.imshow(weights[i].float().numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(len(rows)), rows, fontsize=fontsize)
        ax.set_title(f"head {i + 1}", fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title)
    fig.savefig(path, **PNG)


def lr_figure(
    d_model: int, factor: float, warmup: int, steps: dict[str, list[float]], path: Path, cooldown: float
) -> None:
    """Left: the schedule for this warmup beside WARMUPS; right: the rate the training logged, on the formula
    (with the cooldown over the steps trained, which are all of them once training has finished)."""
    from matplotlib.figure import Figure

    trained = int(max(steps["step"], default=0))
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    span = max(20000, 2 * max(WARMUPS), trained)
    for w, curve in schedule_curves(d_model, factor, warmup, span).items():
        mine = w == warmup
        left.plot(
            range(1, span + 1),
            curve,
            lw=2.2 if mine else 1.2,
            ls="-" if mine else "--",
            label=f"warmup {w}" + (" (params)" if mine else ""),
        )
    left.set(
        title=f"lrate = {factor:g} · {d_model}^-0.5 · min(step^-0.5, step · warmup^-1.5)",
        xlabel="step",
        ylabel="learning rate",
    )
    left.legend()
    if trained:
        right.plot(steps["step"], steps["lr"], ".", ms=5, color="tab:blue", label="logged by train")
        right.plot(
            range(1, trained + 1),
            [rate(s, d_model, factor, warmup, trained, cooldown) for s in range(1, trained + 1)],
            color="black",
            lw=0.8,
            label="formula",
        )
        right.legend()
    cooled = f", cooldown over the last {cooldown:.0%}" if cooldown else ""
    right.set(title=f"this training ({trained} steps{cooled})", xlabel="step", ylabel="learning rate")
    fig.savefig(path, **PNG)


def loss_figure(steps: dict[str, list[float]], epochs: dict[str, list[float]], path: Path) -> None:
    """Training loss per update; at each epoch end, the mean of the last 200 and the validation NLL."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(steps["step"], steps["loss"], lw=0.8, alpha=0.6, label="train loss, label-smoothed (per update)")
    ax.plot(
        epochs["step"], epochs["train_loss"], "o-", label="train loss, label-smoothed (mean of the last 200 updates)"
    )
    ax.plot(epochs["step"], epochs["val_loss"], "s-", label="validation NLL (epoch end)")
    ax.set(title="loss per target token", xlabel="step", ylabel="loss (nats)")
    ax.legend()
    fig.savefig(path, **PNG)
