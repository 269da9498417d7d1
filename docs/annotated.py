# %% [markdown]
# # The annotated model
#
# ["Attention Is All You Need"](https://arxiv.org/abs/1706.03762) (Vaswani et al., 2017) read section
# by section next to the code that
# trains this project's models, as [The Annotated Transformer](https://nlp.seas.harvard.edu/annotated-transformer/)
# reads it next to its own. No cell below defines a layer of its own: each prints the package's
# own code (`show`: the source, under a link to its file and lines on the repository), the very
# classes the pipeline trains, then builds them at toy size and shows what they do.
# That code is the paper's alone; on a CPU, training swaps in faster twins of a few of these modules,
# each held by a test to the plain one (`transformer/kernels/`, [speed](speed.md)).
# The layout follows the paper: the model (section 3), training (section 5), decoding (section 6),
# then what the full pipeline makes of it on Multi30k.
#
# This project's default recipe departs from the paper in a few places, chosen for a small corpus
# (Multi30k, 29,000 sentence pairs) and 2 CPU cores rather than WMT and 8 GPUs. Each departure is
# explained where it enters, with the paper's choice beside ours; [the experiments](experiments.md)
# list the trials that decided each one and what it was worth.
#
# This page is a script, `docs/annotated.py`, run top to bottom by `python docs/tools/render.py`,
# which writes the page you are reading with every printout and figure the run made; the test suite
# runs it too (`tests/test_annotated.py`). Its `# %%` cells open as a notebook in editors that know
# the percent format (VS Code, Jupyter with jupytext). Everything is sized to run on a laptop CPU in
# under a minute.

# %%
import inspect
import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import yaml
from matplotlib.patches import FancyBboxPatch

import transformer
from transformer.config import load_params
from transformer.data.batching import ParallelCorpus, token_batches
from transformer.data.tokenize import Tokenizer, detokenize
from transformer.data.vocab import BOS, EOS, PAD, SPECIALS, BpeVocab
from transformer.decoding import search
from transformer.decoding.search import beam_search, beam_search_nbest, greedy, length_penalty, one_path
from transformer.evaluation.figures import draw_alignment
from transformer.evaluation.score import interval, values, with_interval
from transformer.evaluation.verdict import RECORD, reference_dir
from transformer.model.attention import Mask, MultiHeadAttention
from transformer.model.embeddings import Embeddings, PositionalEncoding
from transformer.model.layers import DecoderLayer, EncoderLayer, FeedForward, Residual
from transformer.model.model import Transformer, count_parameters, make_model
from transformer.training.loss import Loss, smoothed_cross_entropy
from transformer.training.schedule import rate
from transformer.training.train import make_optimizer


def show(code) -> None:
    """Prints the package's source of `code` (a class, function or method) under its file and lines,
    which the page's renderer turns into a link to them on the repository."""
    code = inspect.unwrap(code)  # a decorated function's own source, not its decorator's
    lines, first = inspect.getsourcelines(code)
    path = Path(inspect.getsourcefile(code)).relative_to(Path(transformer.__file__).parents[1])
    print(f"# {path.as_posix()}, lines {first}-{first + len(lines) - 1}")
    print("".join(lines))


torch.manual_seed(0)
torch.set_num_threads(1)  # models this small run fastest on one thread
params = load_params("params.yaml")  # the default recipe, set beside the paper's below
print("special tokens:", dict(zip(SPECIALS, range(len(SPECIALS)))))

# %% [markdown]
# ## The model at a glance (section 3.1)
#
# An encoder reads the source sentence and turns every token into a vector that has looked at the
# whole sentence; a decoder writes the translation one token at a time, looking at what it has
# written so far and at the encoder's vectors. Both are stacks of $N$ identical layers of width
# $d_\text{model}$. Every layer is made of sub-layers (attention, a feed-forward network), each
# wrapped in a residual connection and a layer normalization. The tokens enter as embeddings with
# their positions added; the decoder's last vectors are projected onto the vocabulary.
#
# The figure draws the model as this project builds it, left to right. The encoder's layers
# attend over the source (self-attention); the decoder's attend over the target written so far
# (masked self-attention) and over the encoder's output, the memory (source attention). Each
# sub-layer's output is added to its input, the `+` with the path under the box. Where the layer
# normalization sits is the one difference between the paper's post-norm and this project's
# pre-norm, drawn at the bottom and explained below.

# %% [folded] The figure's drawing code (matplotlib boxes and arrows)
COLORS = {"attention": "#fbd9b5", "ffn": "#cfe2f3", "norm": "#d5ecc9", "embed": "#e4daf2", "other": "#e6e6e6"}
ROUNDED = "round,pad=0,rounding_size=0.08"


def draw_box(ax, x, y, width, text, kind, dashed=False):
    """A box from x to x + width centred on y; returns its right edge."""
    style = dict(facecolor=COLORS[kind], edgecolor="0.3", linestyle="--" if dashed else "-")
    ax.add_patch(FancyBboxPatch((x, y - 0.35), width, 0.7, ROUNDED, **style))
    ax.text(x + width / 2, y, text, ha="center", va="center")
    return x + width


def draw_path(ax, *points):
    """Straight lines through the points, an arrowhead at the last."""
    xs, ys = zip(*points)
    ax.plot(xs[:-1], ys[:-1], color="0.3", lw=1.1)
    ax.annotate("", points[-1], points[-2], arrowprops=dict(arrowstyle="-|>", color="0.3", lw=1.1, shrinkB=0))


def draw_sublayer(ax, x, y, boxes):
    """The boxes (text, kind, width) in a row after x, then the sum, the residual path drawn under
    them; returns the sum's right edge."""
    start = x + 0.1
    for text, kind, width in boxes:
        draw_path(ax, (x, y), (x + 0.22, y))
        x = draw_box(ax, x + 0.22, y, width, text, kind)
    plus = x + 0.34
    draw_path(ax, (x, y), (plus - 0.13, y))
    ax.plot(plus, y, "o", ms=14, mfc="white", mec="0.3")
    ax.text(plus, y, "+", ha="center", va="center", fontsize=12)
    draw_path(ax, (start, y), (start, y - 0.55), (plus, y - 0.55), (plus, y - 0.13))
    return plus + 0.13


def draw_stack(ax, y, right, top, label):
    """The dotted frame of a layer that the stack repeats N times."""
    style = dict(facecolor="none", edgecolor="0.55", linestyle=":", lw=1.4)
    ax.add_patch(FancyBboxPatch((1.26, y - 0.72), right - 1.26, 0.72 + top, ROUNDED, **style))
    ax.text(1.32, y + top - 0.05, label, ha="left", va="top", style="italic", color="0.35")


fig, ax = plt.subplots(figsize=(9, 7.5))  # as wide as the page's column, so that its text keeps its size
ax.set(xlim=(0, 9), ylim=(-0.3, 7.2), title="the model: encoder and decoder stacks, and a sub-layer two ways")
ax.set_position([0, 0, 1, 1])  # a unit of the axes is an inch of the figure
ax.axis("off")
encoder, decoder = 6.2, 3.75  # the rows' heights
for y, tokens in ((encoder, "source tokens"), (decoder, "<s>, then the\ntarget tokens")):
    draw_box(ax, 0.05, y, 1.15, "embedding\n× √d_model\n+ positions", "embed")
    draw_path(ax, (0.625, y - 0.75), (0.625, y - 0.35))
    ax.text(0.625, y - 0.8, tokens, ha="center", va="top")
x = draw_sublayer(ax, 1.2, encoder, [("self-attention\n(padding mask)", "attention", 1.35)])
x = draw_sublayer(ax, x, encoder, [("feed-forward", "ffn", 1.1)])
draw_stack(ax, encoder, x + 0.08, 0.62, "encoder layer, × N")
draw_path(ax, (x, encoder), (x + 0.35, encoder))
memory = draw_box(ax, x + 0.35, encoder, 1.0, "LayerNorm\n(pre-norm)", "norm", dashed=True)
x = draw_sublayer(ax, 1.2, decoder, [("masked\nself-attention\n(causal mask)", "attention", 1.35)])
source = x + 0.22 + 0.75  # the middle of source attention's box
x = draw_sublayer(ax, x, decoder, [("source attention\n(encoder–decoder)", "attention", 1.5)])
x = draw_sublayer(ax, x, decoder, [("feed-forward", "ffn", 1.1)])
draw_stack(ax, decoder, x + 0.08, 0.8, "decoder layer, × N")
draw_path(ax, (x, decoder), (x + 0.35, decoder))
x = draw_box(ax, x + 0.35, decoder, 1.0, "LayerNorm\n(pre-norm)", "norm", dashed=True)
draw_path(ax, (x - 0.5, decoder - 0.35), (x - 0.5, decoder - 0.75))
draw_box(ax, x - 1.0, decoder - 1.1, 1.0, "linear (the\nembedding)\n+ softmax", "other")
draw_path(ax, (x - 0.5, decoder - 1.45), (x - 0.5, decoder - 1.8))
ax.text(x - 0.5, decoder - 1.85, "next-token probabilities", ha="center", va="top")
draw_path(
    ax, (memory, encoder), (memory + 0.25, encoder), (memory + 0.25, 4.85), (source, 4.85), (source, decoder + 0.35)
)
ax.text(memory + 0.15, 4.9, "memory: keys and values", ha="right", va="bottom")
ax.axhline(1.55, 0.01, 0.99, color="0.8", lw=0.8)
post = [("sub-layer", "attention", 0.9), ("dropout", "other", 0.8)]
for left, boxes, after, label in (
    (0.0, post, True, "post-norm, the paper:\nLayerNorm(x + Sublayer(x))"),
    (4.55, [("LayerNorm", "norm", 1.0), *post], False, "pre-norm, our default: x + Sublayer(LayerNorm(x)),"),
):
    ax.text(left + 0.05, 1.4, label, va="top")
    x = draw_sublayer(ax, left, 0.45, boxes)
    if after:
        draw_path(ax, (x, 0.45), (x + 0.22, 0.45))
        x = draw_box(ax, x + 0.22, 0.45, 1.0, "LayerNorm", "norm")
    draw_path(ax, (x, 0.45), (x + 0.3, 0.45))
ax.text(4.6, 1.2, "and a last LayerNorm on each stack", va="top")

# %% [markdown]
# The paper's names are the code's: `N`, `d_model`, `d_ff`, `h`, and params.yaml's `model` section
# uses them too. The toy sizes of this page:

# %%
d_model, h, d_ff = 16, 2, 32
B, T = 2, 5  # sentences and tokens of the tiny batch used below
print(f"d_model={d_model}, h={h}, d_k={d_model // h}, d_ff={d_ff}")

# %% [markdown]
# ## Embeddings and positions (sections 3.4 and 3.5)
#
# A token's embedding is a learned row of width $d_\text{model}$, multiplied by
# $\sqrt{d_\text{model}}$ as in section 3.4. With tied embeddings (below) the same matrix,
# unscaled, projects the decoder's output onto the vocabulary. Attention has no notion of order,
# so each position $pos$ gets a fixed vector of sines and cosines
# whose wavelengths grow geometrically from $2\pi$ to $10000 \cdot 2\pi$ along the dimensions:
#
# $$PE_{(pos, 2i)} = \sin\left(pos / 10000^{2i/d_\text{model}}\right), \qquad
#   PE_{(pos, 2i+1)} = \cos\left(pos / 10000^{2i/d_\text{model}}\right)$$
#
# Low dimensions change from one position to the next, high ones barely move, so every position
# gets a distinct pattern and nearby positions get similar ones. `Embeddings` is the lookup and
# its factor; `PositionalEncoding` computes the table once and adds it to its input (it grows the
# table when a longer input arrives, and decoding passes the `start` of the positions it adds);
# fed zeros, it returns the table itself.
#
# Why a formula and not a learned vector per position? Section 3.5 reports that learned positional
# embeddings scored nearly the same, and keeps the sinusoids because they may let the model
# extrapolate to sentences longer than any it was trained on: a learned table has no row for an
# unseen position, the formula has one for every position. Each pair of dimensions is a rotation,
# so for any offset $k$, $PE_{pos+k}$ is a fixed linear map of $PE_{pos}$, which the paper
# expected to make relative positions easy to attend to. Why the scaling by $\sqrt{d_\text{model}}$
# shows once `make_model` has drawn the initial weights, below.

# %%
show(Embeddings)
show(PositionalEncoding)
embed = Embeddings(vocab=10, d_model=d_model)
tokens = torch.tensor([[4, 5, 6, 7, 1], [8, 9, 1, PAD, PAD]])  # (B, T)
print("embeddings:", tuple(embed(tokens).shape), " scale sqrt(d_model) =", embed.scale)

position = PositionalEncoding(d_model=64)
table = position(torch.zeros(1, 100, 64))[0]  # (positions, d_model)
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2))
for dim in (4, 5, 6, 7):
    left.plot(table[:, dim], label=f"dim {dim}")
left.set(xlabel="position", ylabel="value", title="four dimensions of the encoding")
left.legend(loc="lower right", fontsize=8)
image = right.imshow(table.T, aspect="auto", cmap="RdBu", interpolation="nearest")
right.set(xlabel="position", ylabel="dimension", title="the whole table, d_model = 64")
fig.colorbar(image, ax=right)

# %% [markdown]
# ## Scaled dot-product attention (section 3.2.1)
#
# A query is compared with every key by a dot product; the scores, divided by $\sqrt{d_k}$, go
# through a softmax, and the result weighs the values:
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\left(\frac{QK^\top}{\sqrt{d_k}}\right) V$$
#
# Without the division, dot products of wide random vectors have a variance of about $d_k$ and
# push the softmax into a region where one weight is nearly 1 and the gradients nearly vanish.
#
# `MultiHeadAttention` computes this with torch's `scaled_dot_product_attention`, which picks a
# fused kernel and never shows the weights. Set `keep_weights` and it takes the formula above
# instead, keeping the softmax's output in `.weights`; the two give the same result.

# %%
show(MultiHeadAttention.attend)
attention = MultiHeadAttention(d_model, h, self_attention=True).eval()
x = torch.randn(B, T, d_model)
fast = attention(x, None, Mask())  # self-attention: no memory, every key visible
attention.keep_weights = True
written_out = attention(x, None, Mask())
print("input  x:", tuple(x.shape), "  (B, T, d_model)")
print("output  :", tuple(fast.shape), "  (B, T, d_model)")
print("weights :", tuple(attention.weights.shape), "(B, h, T, T): one T x T map per sentence and head")
print("each row of weights sums to 1:", torch.allclose(attention.weights.sum(-1), torch.ones(B, h, T)))
print("fused kernel == formula:", torch.allclose(fast, written_out, atol=1e-6))

# %% [markdown]
# ## Multi-head attention (section 3.2.2)
#
# Rather than one attention over $d_\text{model}$-wide vectors, the model projects queries, keys and
# values $h$ times into $d_k = d_\text{model}/h$ dimensions, attends in each of these heads in
# parallel, concatenates the heads and projects the result back:
#
# $$\mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_h)\, W^O,
#   \qquad \mathrm{head}_i = \mathrm{Attention}(QW_i^Q, KW_i^K, VW_i^V)$$
#
# The total cost is about that of one head of full width, and each head can attend to something
# else. In code the $h$ projections of each kind are one matrix, split into heads by reshaping;
# self-attention (queries, keys and values from the same sequence) computes all three in a single
# matmul, and source attention, the decoder's attention over the encoder's output, projects queries
# from the decoder and keys and values from the memory. Decoding computes the memory's keys and
# values once per sentence (`memory_heads`) and reuses them at every step, appending each step's
# own keys and values to self-attention's `cache`.

# %%
show(MultiHeadAttention.forward)
show(MultiHeadAttention.heads)
source_attention = MultiHeadAttention(d_model, h, self_attention=False).eval()
memory = torch.randn(B, 7, d_model)  # an encoder output of 7 source tokens
k, v = source_attention.memory_heads(memory)
for name, module in (("self-attention", attention), ("source attention", source_attention)):
    print(name, {n: tuple(p.shape) for n, p in module.named_parameters()})
print("memory:", tuple(memory.shape), "-> keys", tuple(k.shape), "and values", tuple(v.shape), " (B, h, S, d_k)")
print("decoder states", tuple(x.shape), "attending to it ->", tuple(source_attention(x, memory, Mask()).shape))

# %% [markdown]
# ## Masks
#
# Two things must stay invisible to attention. Padding: sentences of a batch are right-padded with
# `<blank>` to one length, and no query may attend to a padded key. The model builds a boolean
# mask, True where a key is real, shaped `(B, 1, 1, S)` so that it broadcasts over heads and
# queries. The future: when training, the decoder sees the whole target at once, shifted right by
# `<s>`, and position $i$ must not attend to positions after $i$, or it would read the token it is
# asked to predict. That causal mask is lower triangular; torch's kernels build it themselves from
# `is_causal`, so here it shows in the decoder's weights. One `Mask` says both, for each attention:

# %%
show(Mask)
tiny = dict(d_model=d_model, d_ff=d_ff, h=h, dropout=0.0, tie_embeddings=True)
model = make_model(src_vocab=10, tgt_vocab=10, pad=PAD, N=1, norm="pre", **tiny).eval()
src_mask = model.src_mask(tokens)
print("source mask", tuple(src_mask.keys.shape), "of the two sentences above:")
print(src_mask.keys[:, 0, 0].int())

layer = model.decoder.layers[0]
layer.self_attn.keep_weights = layer.src_attn.keep_weights = True
with torch.no_grad():
    model(tokens, tokens)
fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
axes[0].imshow(src_mask.keys[:, 0, 0], cmap="Greys_r")
axes[0].set(title="padding mask (white: a real key)", xlabel="key position", ylabel="sentence", yticks=[0, 1])
axes[1].imshow(layer.self_attn.weights[1, 0], cmap="viridis")
axes[1].set(title="decoder self-attention: causal", xlabel="key position", ylabel="query position")
axes[2].imshow(layer.src_attn.weights[1, 0], cmap="viridis")
axes[2].set(title="source attention: padding hidden", xlabel="source position", ylabel="query position")
fig.tight_layout()

# %% [markdown]
# The second sentence has two padded positions: in source attention, their columns get no weight;
# in self-attention, everything above the diagonal gets none.

# %% [markdown]
# ## Feed-forward networks and sub-layer connections (sections 3.3 and 3.1)
#
# Between attentions, each position goes through the same two-layer network on its own, widening
# to $d_{ff}$ and back:
#
# $$\mathrm{FFN}(x) = \max(0, xW_1 + b_1)\,W_2 + b_2$$
#
# Every sub-layer, attention or feed-forward, is wrapped by `Residual`: dropout on the sub-layer's
# output, a residual connection, and a layer normalization. An encoder layer is two of them,
# self-attention then the feed-forward network; a decoder layer three, with attention over the
# encoder's output (the memory) between its masked self-attention and its feed-forward network.

# %%
show(FeedForward)
ffn = FeedForward(d_model, d_ff)
print("FFN:", ffn.w_1, "->", ffn.w_2, "; shape in", tuple(x.shape), "out", tuple(ffn(x).shape))
show(Residual.forward)
show(EncoderLayer.forward)
show(DecoderLayer.forward)

# %% [markdown]
# ## Pre-norm and post-norm
#
# The paper normalizes after the residual sum, $\mathrm{LayerNorm}(x + \mathrm{Sublayer}(x))$
# ("post-norm", `model.norm: post`). The Annotated Transformer, like most later code, normalizes the
# sub-layer's input instead, $x + \mathrm{Sublayer}(\mathrm{LayerNorm}(x))$ ("pre-norm",
# `model.norm: pre`), and adds a final LayerNorm to each stack. Pre-norm leaves an unnormalized
# path from the embeddings to the top of the stack, which makes deep models train stably without
# a careful warmup (Xiong et al., 2020); this project's default recipe uses it. On Multi30k,
# post-norm was tried once and stopped early, behind on validation loss (the "post-norm" row of
# [the experiments](experiments.md)).
#
# The difference shows in the residual stream of an untrained 6-layer encoder: post-norm brings
# every layer's output back to unit scale, pre-norm lets the sum grow layer by layer.

# %%
src = torch.randint(4, 10, (8, 12))
print("layer   post-norm std   pre-norm std")
scales = {}
for norm in ("post", "pre"):
    deep = make_model(src_vocab=10, tgt_vocab=10, pad=PAD, N=6, norm=norm, **tiny).eval()
    outputs = []
    for encoder_layer in deep.encoder.layers:
        encoder_layer.register_forward_hook(lambda module, args, out, kept=outputs: kept.append(out.std().item()))
    with torch.no_grad():
        deep.encode(src, deep.src_mask(src))
    scales[norm] = outputs
for i, (post, pre) in enumerate(zip(scales["post"], scales["pre"]), 1):
    print(f"{i:5d}   {post:13.2f}   {pre:12.2f}")

# %% [markdown]
# ## The whole model: make_model
#
# `make_model` is the one place a model is built: from params.yaml's `model` section (or a model
# file's saved config), with Xavier-uniform initial weights on every matrix. With
# `tie_embeddings`, the source embedding, the target embedding and the final projection onto the
# vocabulary share one matrix, as in section 3.4. The paper's base model, on a shared vocabulary
# of 37,000 BPE pieces, is counted below without allocating it (on torch's `meta` device). The
# paper gives 65M parameters for it (Table 3); the default recipe of this project is much smaller.
# `make_model`, then the model's forward pass for training, encoder then decoder over the whole
# target at once:

# %%
show(make_model)
show(Transformer.forward)
paper_base = dict(N=6, d_model=512, d_ff=2048, h=8, dropout=0.1, norm="post", tie_embeddings=True)
with torch.device("meta"):
    base = make_model(src_vocab=37000, tgt_vocab=37000, pad=PAD, **paper_base)
print(f"paper's base model, shared 37k vocabulary: {count_parameters(base) / 1e6:.1f}M parameters")

gap = 65e6 - count_parameters(base)
print(f"Table 3's 65M minus this count: {gap / 1e6:.1f}M, the size of {gap / 512:,.0f} rows of the shared matrix")

recipe, pieces = params.model, params.vocab.size
with torch.device("meta"):
    ours = make_model(recipe, src_vocab=pieces, tgt_vocab=pieces, pad=PAD)
print(
    f"this project's default (N={recipe.N}, d_model={recipe.d_model}, h={recipe.h}, {pieces} BPE pieces): "
    f"{count_parameters(ours) / 1e6:.1f}M parameters"
)

# %% [markdown]
# The count follows the paper's description, biases and layer normalizations included, and falls
# short of Table 3's 65M. The paper does not say how it counted, and its vocabulary is "about
# 37,000" pieces; the gap is what a few thousand more rows of the shared matrix would hold. The
# default recipe is about an eighth of the base model: fewer and narrower layers and a smaller
# vocabulary, because Multi30k's 29,000 training pairs are a small fraction of WMT 2014's 4.5
# million sentence pairs (the Annotated Transformer's recipe, at the end of this page, trains the
# base model on Multi30k).
#
# Now the factor $\sqrt{d_\text{model}}$ of section 3.4, which the paper does not explain. With tied
# embeddings the matrix is also the pre-softmax projection, and Xavier-uniform, drawn alike for
# every matrix, gives its entries a standard deviation of $\sqrt{2 / (V + d_\text{model})}$: a row
# is much shorter than 1. A row of the positional table has length $\sqrt{d_\text{model}/2}$, since
# each sine-cosine pair contributes 1. Unscaled, the position would drown the token it is added to;
# the factor brings the two to the same order. On the default recipe's model, its weights drawn
# this time:

# %%
drawn = make_model(recipe, src_vocab=pieces, tgt_vocab=pieces, pad=PAD)
row = drawn.src_embed.lut.weight.norm(dim=-1).mean().item()
positions = drawn.position(torch.zeros(1, 50, recipe.d_model))[0].norm(dim=-1).mean().item()
scale = drawn.src_embed.scale
print(f"length of an embedding row: {row:.2f}; times sqrt(d_model) = {scale:.0f}: {row * scale:.2f}")
print(f"length of a position's encoding: {positions:.2f}")

# %% [markdown]
# ## Tokens: a joint subword vocabulary (section 5.1)
#
# The paper encodes WMT's English and German with byte-pair encoding (BPE) into one vocabulary of
# about 37,000 tokens shared by both languages. This project does the same at a size that suits
# Multi30k (`vocab.size`), in two steps. spaCy's rule-based tokenizer first splits punctuation off
# the words, and a token that had no space before it in the raw text gets the joiner `￭` in front
# (`transformer/data/tokenize.py`), so that the raw text can be rebuilt exactly and scored as
# people write it. Then one sentencepiece BPE model, learned from the training text of both
# languages, cuts the tokens into pieces: frequent words stay whole, rare ones become a few
# frequent pieces instead of `<unk>`. Sentencepiece marks a piece that begins a word with `▁`, so
# `▁dog s` spells "dogs"; `▁￭.` is a full stop written right after the word before it. One
# vocabulary for both sides is what lets the source embedding, the target embedding and the
# output projection be one matrix (section 3.4).
#
# The Annotated Transformer instead keeps a word vocabulary a language, rarer words becoming
# `<unk>`. The vocabulary's size was tuned on val BLEU (the "joint BPE" rows of
# [the experiments](experiments.md)). The cell learns a toy BPE model from eight sentences
# with the package's `BpeVocab`, as the `build_vocab` stage does from the whole training split,
# and cuts a sentence it has not seen:

# %%
german = ["Ein Mann fährt Fahrrad.", "Zwei Männer fahren Fahrräder.", "Ein Hund läuft über die Straße."]
english = ["A man rides a bicycle.", "Two men are riding bicycles.", "A dog runs across the street."]
english += ["Two dogs are running across a street.", "A man is riding a bike."]
tokenized = [Tokenizer("de")(line) for line in german] + [Tokenizer("en")(line) for line in english]
bpe = BpeVocab.train(tokenized * 10, size=90, seed=1)  # 90 pieces, the 4 specials among them
sentence = Tokenizer("en")("Two dogs ride bicycles.")
ids = bpe.encode(sentence)
print(f"default recipe: {params.vocab.kind}, {params.vocab.size} pieces; this toy model: {len(bpe)}")
print("tokenized:", sentence)
print("pieces:   ", [bpe.sp.id_to_piece(i) for i in ids])
print("ids:      ", ids)
print("back:     ", bpe.decode(ids), "->", detokenize(bpe.decode(ids)))

# %% [markdown]
# ## Batches by token count (section 5.1)
#
# The paper groups sentence pairs of similar length and fills each batch up to a number of tokens
# (about 25,000 source and 25,000 target tokens), not of sentences. Each batch is padded to its
# longest sentence, so sorting by length wastes far less on padding than drawing sentences at
# random. `token_batches` sorts pairs by length (shuffling pairs of equal length with a seed),
# cuts the order into batches whose padded size stays within `max_tokens`, and shuffles the order
# of the batches. `ParallelCorpus` holds the token ids; here it is filled with random "sentences"
# of 1 to 40 tokens.
#
# The paper's batches (about 25,000 tokens a side, on 8 GPUs) are far larger than the default
# recipe's `train.max_tokens`, printed below: Multi30k is small, and smaller batches give it more
# updates an epoch on 2 cores. The number of updates a run makes is read from the reference run's
# record.


# %%
def random_corpus(pairs: int, longest: int, words: int, seed: int) -> ParallelCorpus:
    """`pairs` copies of random sentences of 1 to `longest` tokens drawn from `words` ids after the specials."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (pairs,), generator=g)
    ids = torch.randint(len(SPECIALS), len(SPECIALS) + words, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return ParallelCorpus(data={"src": ids, "src_offsets": offsets, "tgt": ids, "tgt_offsets": offsets})


def padding_share(corpus: ParallelCorpus, batches: list[list[int]]) -> float:
    slots = sum(b * s for b, s, _ in (corpus.shape(index) for index in batches))
    return 1 - sum(int(corpus.src_lens[index].sum()) for index in batches) / slots


corpus = random_corpus(pairs=5000, longest=40, words=1000, seed=1)
by_length = token_batches(corpus.src_lens, corpus.tgt_lens, max_tokens=1000, seed=1)
order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(1)).tolist()
size = len(corpus) // len(by_length)
at_random = [order[i : i + size] for i in range(0, len(order), size)]
print(f"{len(corpus)} pairs in {len(by_length)} batches of at most 1,000 padded tokens a side")
print(f"padding, batches by length : {padding_share(corpus, by_length):.1%} of the source slots")
print(f"padding, same batch sizes at random: {padding_share(corpus, at_random):.1%}")
batch = corpus.batch(by_length[0])
print("one batch: src", tuple(batch.src.shape), "tgt_in", tuple(batch.tgt_in.shape), "target tokens", batch.ntokens)
print("a row of it:\n src    ", batch.src[0].tolist(), "\n tgt_in ", batch.tgt_in[0].tolist())
print(" tgt_out", batch.tgt_out[0].tolist())
reference = json.loads(open("reports/train/train.json").read())
epochs, updates_made = reference["epochs"], reference["steps"]
print(f"default recipe: train.max_tokens {params.train.max_tokens}; {epochs} epochs, {updates_made} updates")
print(f"that is {updates_made / epochs:.0f} updates an epoch; the paper's base model made 100,000")

# %% [markdown]
# The source ends with `</s>` (id 1); the decoder's input starts with `<s>` (id 0) and its expected
# output is the same sentence shifted one to the left, ending with `</s>`. `ntokens` counts the
# target tokens that are not padding, the number the loss is divided by.

# %% [markdown]
# ## The learning rate (section 5.3)
#
# Adam with $\beta_1 = 0.9$, $\beta_2 = 0.98$, $\epsilon = 10^{-9}$, and a rate that grows linearly
# for `warmup` updates and then decays with the inverse square root of the update number:
#
# $$lrate = d_\text{model}^{-0.5} \cdot \min(step^{-0.5},\ step \cdot warmup^{-1.5})$$
#
# Why warm up? Adam divides each parameter's step by a running estimate of its gradient's square,
# and in the first updates that estimate rests on a handful of gradients: it is noisy, and some
# steps come out far too large (Liu et al., 2020, measure this). A small rate until the estimates
# settle keeps those first steps from throwing the freshly initialized model somewhere it does
# not recover from; after the peak, the rate decays as $1/\sqrt{step}$.
#
# `rate` scales this by `factor` and can end with a linear cooldown over the last `cooldown`
# share of the `total` updates. Left: the paper's base model (4,000 warmup updates of 100,000).
# Right: this project's default recipe, read from params.yaml, over the updates its reference run
# made (`reports/train/train.json`). A run of a few thousand updates cannot spend 4,000 of them
# warming up, so the default warms up for fewer and peaks higher (`train.factor`); shorter
# warmups than the default's did worse ("train.warmup" rows of [the experiments](experiments.md)).
# The cooldown, which the paper does not have, brings the rate to 0 at the last update, so that
# the run ends on settled weights ("train.cooldown" rows).

# %%
show(rate)
train = params.train
total = reference["steps"]
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2))
steps = range(1, 100_001, 100)
left.plot(steps, [rate(s, 512, 1.0, 4000) for s in steps])
left.set(xlabel="update", ylabel="learning rate", title="paper: d_model 512, warmup 4000")
steps = range(1, total + 1)
schedule = dict(d_model=recipe.d_model, factor=train.factor, warmup=train.warmup)
right.plot(steps, [rate(s, **schedule) for s in steps], ":", label="no cooldown")
right.plot(steps, [rate(s, **schedule, total=total, cooldown=train.cooldown) for s in steps], label="cooldown")
right.set(xlabel="update", title="default recipe: " + ", ".join(f"{k} {v}" for k, v in schedule.items()))
right.legend()
fig.tight_layout()

# %% [markdown]
# ### Adam with weight decay
#
# The optimizer is the paper's Adam with the same $\beta_1$, $\beta_2$ and $\epsilon$, plus AdamW's
# decoupled weight decay (Loshchilov and Hutter, 2019): apart from the gradient's step, each
# update shrinks every weight matrix and embedding by a fraction, the rate times
# `train.weight_decay`, while biases and the layer normalizations' gains are left alone. The paper
# uses no decay; on a corpus as small as Multi30k, which a model can learn by heart, it helped a
# little ("weight_decay" rows of [the experiments](experiments.md)). `make_optimizer` is what
# training calls; its learning rate is 0 until the schedule sets it at every update.

# %%
optimizer = make_optimizer(model, params.train.weight_decay, torch.device("cpu"))
print(type(optimizer).__name__, {k: optimizer.defaults[k] for k in ("lr", "betas", "eps")})
for group in optimizer.param_groups:
    shapes = sorted({tuple(p.shape) for p in group["params"]}, key=len)
    print(f"  weight_decay {group['weight_decay']}: {len(group['params'])} tensors of shapes {shapes[:4]} ...")

# %% [markdown]
# ## Label smoothing (section 5.4)
#
# The loss does not ask for all the probability on the reference token: with smoothing
# $\epsilon_{ls} = 0.1$, the target keeps $1 - \epsilon_{ls}$ on it and spreads $\epsilon_{ls}$
# over the vocabulary. It hurts perplexity, the paper says, and improves BLEU.
#
# `smoothed_cross_entropy` spreads the mass over every column, as torch's `label_smoothing` does;
# with `zero_pad` (`train.smoothing_zeroes_pad`) it spreads it over the columns that are neither
# the reference token nor `<blank>`, as the Annotated Transformer does. `Loss` is what training
# calls: the generator's logits of the decoder's states, in float32 at least, against the target
# tokens. Padding is no token to predict, so a `<blank>` target adds nothing (`ignore_index`).
# The loss is a sum, not a mean: an update divides it once by all its target tokens, however many
# micro-batches and processes share them.

# %%
show(smoothed_cross_entropy)
show(Loss.forward)
criterion = Loss(PAD, smoothing=params.train.label_smoothing)
with torch.no_grad():
    hidden = model(tokens, tokens)  # the tiny batch as the input and as the target, (B, T, d_model)
    summed = criterion(model.generator, hidden, tokens)
    nll = criterion(model.generator, hidden, tokens, smoothing=0.0)
    other = hidden.masked_fill((tokens == PAD)[..., None], 7.0)  # other states where the target is <blank>
    unchanged = torch.equal(criterion(model.generator, other, tokens), summed)
real = int((tokens != PAD).sum())
print(f"{real} of the {tokens.numel()} targets are not <blank>; loss {summed:.3f} in all, {summed / real:.3f} a token")
print(f"smoothing 0, the NLL that validation measures: {nll / real:.3f} a token")
print("other states where the target is <blank>, the same loss:", unchanged)

# %% [markdown]
# The target distribution is not stored anywhere, but the loss's gradient with respect to the
# logits is the model's distribution minus the target, so the target can be read back from the
# loss itself:

# %%
vocab, smoothing = 8, 0.4  # a large smoothing, for the picture's sake
gold = torch.tensor([4, 5, 6, 3])
fig, axes = plt.subplots(1, 2, figsize=(10, 2.8))
for ax, zero_pad in zip(axes, (False, True)):
    logits = torch.zeros(len(gold), vocab, requires_grad=True)
    smoothed_cross_entropy(logits, gold, PAD, smoothing, zero_pad).backward()
    target = logits.softmax(-1) - logits.grad  # the gradient is softmax(logits) - target
    ax.imshow(target.detach(), cmap="Blues", vmin=0, vmax=1)
    ax.set(title=f"zero_pad={zero_pad}", xlabel="token id (2: <blank>)", ylabel="row")
    print(f"zero_pad={zero_pad}: row 0 =", [round(p, 3) + 0.0 for p in target[0].tolist()])  # + 0.0: no -0.0
fig.tight_layout()

# %% [markdown]
# What smoothing does to a confident model: say the model puts probability $p$ on the right token
# and spreads the rest evenly over the others. Without smoothing the loss, $-\log p$, falls all
# the way to $p = 1$. With it, the loss is lowest below 1 and rises again as the model grows surer,
# so a model is penalized for certainty it cannot have, which is how smoothing trades perplexity
# for BLEU. The package's loss over the default vocabulary's size, at the default's $\epsilon_{ls}$:

# %%
V, eps = params.vocab.size, params.train.label_smoothing
p = torch.linspace(0.6, 0.9999, 200)
logits = ((1 - p) / (V - 1)).log()[:, None].repeat(1, V)  # log-probabilities: softmax gives them back
logits[:, 4] = p.log()  # token 4 is the right one
fig, ax = plt.subplots(figsize=(6, 3))
for e in (0.0, eps):
    loss = torch.stack([smoothed_cross_entropy(row[None], torch.tensor([4]), PAD, e) for row in logits])
    best = int(loss.argmin())
    ax.plot(p, loss, label=f"smoothing {e}")
    ax.plot(p[best], loss[best], "ko")
    print(f"smoothing {e}: lowest loss {loss[best]:.3f} at p = {p[best]:.3f}; at p = {p[-1]:.4f}: {loss[-1]:.3f}")
ax.set(xlabel="p, the probability of the right token", ylabel="loss", title="smoothing penalizes certainty")
ax.legend()

# %% [markdown]
# The default recipe keeps the paper's $\epsilon_{ls}$; the en→de recipe smooths more
# (`params/multi30k_en_de.yaml`, and the "label_smoothing" rows of
# [the experiments](experiments.md)).
#
# ## R-Drop: two dropout passes that must agree
#
# The paper regularizes with dropout and label smoothing. This project adds R-Drop (Liang et al.,
# 2021): a sentence goes through the model twice, each pass with its own dropout masks, and the
# loss adds at every target position the symmetric KL divergence between the two passes'
# next-token distributions, weighted by R-Drop's $\alpha$ (`train.rdrop`). The model learns to
# predict the same whatever the mask, which is what inference, with dropout off, relies on. It
# costs a second pass for each sentence it covers, so `train.rdrop_share` draws the share of each
# batch's sentences that take one. On Multi30k it bought more than any other change ("R-Drop" and
# "train.rdrop" rows of [the experiments](experiments.md)). The loss with its consistency term, as
# the package defines it (on a CPU, training swaps in a twin that computes the same with its
# gradient written out for speed, `transformer/kernels/loss.py`):

# %%
show(Loss.rdrop)

# %% [markdown]
# Both passes of a batch go in as one batch of twice the rows. With dropout on, they differ and
# the term is positive; in evaluation mode the passes are equal and the term is 0:

# %%
noisy = make_model(src_vocab=10, tgt_vocab=10, pad=PAD, N=1, norm="pre", **tiny | {"dropout": 0.3})
alpha = params.train.rdrop
for mode in ("training", "evaluation"):
    noisy.train(mode == "training")
    with torch.no_grad():
        hidden = noisy(tokens.repeat(2, 1), tokens.repeat(2, 1))  # (2B, T, d_model), each row its masks
        plain = Loss(PAD, eps).rdrop(noisy.generator, hidden, tokens, alpha=0.0)
        both = Loss(PAD, eps).rdrop(noisy.generator, hidden, tokens, alpha=alpha)
    print(f"{mode}: summed cross-entropy {plain:.3f}, consistency term at alpha {alpha}: {both - plain:.4f}")

# %% [markdown]
# ## Mixed precision: bf16 autocast
#
# The paper says nothing of number formats. This project trains in bfloat16 where the hardware
# computes it natively (`train.precision: auto`): under `torch.autocast`, matrix products run in
# bf16, a float32 cut to 8 bits of mantissa but with its full exponent range, so no loss scaling
# is needed as with float16. Layer normalizations stay in float32, as do the weights, the
# optimizer's state and the loss. It makes updates faster on CPUs and GPUs with bf16 units
# ([speed](speed.md)), and the "check only" rows of [the experiments](experiments.md) compare
# scores across precisions.

# %%
with torch.autocast("cpu", dtype=torch.bfloat16):
    hidden = model(tokens, tokens)  # the stack's last LayerNorm hands back float32
    logits = model.generator(hidden)
    loss = Loss(PAD, eps)(model.generator, hidden, tokens)
print(f"weights {model.generator.weight.dtype}; under autocast: logits {logits.dtype}, loss {loss.dtype}")

# %% [markdown]
# ## A first example: learning to copy
#
# A task a small model learns in seconds: given a random sequence of symbols, output the same
# sequence. It exercises everything above: token batches, the schedule (with a cooldown, which
# lets this short run settle), the loss summed over target tokens and divided by their number,
# and the model's forward pass. The training loop below is the bare minimum; the pipeline's own
# (`transformer/training/`) adds gradient accumulation, several processes, mixed precision,
# checkpoints and validation.

# %%
torch.manual_seed(0)  # the same copier whatever the cells above drew
copies = random_corpus(pairs=4000, longest=6, words=8, seed=2)
vocab = len(SPECIALS) + 8
toy = dict(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, norm="pre", tie_embeddings=True)
copier = make_model(src_vocab=vocab, tgt_vocab=vocab, pad=PAD, **toy)
optimizer = torch.optim.Adam(copier.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)  # lr: set every update
updates, update, epoch = 500, 0, 0
while update < updates:
    for index in token_batches(copies.src_lens, copies.tgt_lens, max_tokens=600, seed=epoch)[: updates - update]:
        update += 1
        batch = copies.batch(index)
        for group in optimizer.param_groups:
            group["lr"] = rate(update, toy["d_model"], factor=1.0, warmup=100, total=updates, cooldown=0.5)
        loss = Loss(PAD, smoothing=0.0)(copier.generator, copier(batch.src, batch.tgt_in), batch.tgt_out)
        optimizer.zero_grad()
        (loss / batch.ntokens).backward()
        optimizer.step()
        if update % 100 == 0:
            print(f"update {update}: loss {loss.item() / batch.ntokens:.3f} per token")
    epoch += 1
print(f"the rate's peak, at update 100: {rate(100, toy['d_model'], factor=1.0, warmup=100):.4f}")

# %% [markdown]
# The optimizer's `lr=1.0` is never used: the loop writes each update's rate into it from the
# schedule, so the optimizer only multiplies its step by what `rate` says. The printed losses are
# one batch's each, and they need not fall steadily: the rate peaks at the end of the warmup, at
# update 100, where Adam's steps are largest, and a loss can rise for a while around there before
# the decay, and then the cooldown, let the weights settle.

# %% [markdown]
# ## Decoding (section 6.1)
#
# The model writes a translation token by token. Greedy search takes the most probable next token
# each time. Beam search keeps the `beam` best partial hypotheses, and ranks the finished ones by
# their log-probability divided by GNMT's length penalty $((5 + |Y|)/6)^\alpha$ (Wu et al.,
# 2016; the paper: beam 4, $\alpha = 0.6$). Both work on any model with `start` and `step`: the
# encoder runs once, and each step feeds the decoder only the last token, with every layer's keys
# and values of the earlier ones cached. Each output has a length limit, here its source's length
# (with `</s>`) plus 2.

# %%
show(greedy)
show(one_path)
copier.eval()
test = random_corpus(pairs=200, longest=6, words=8, seed=3)
batch = test.batch(list(range(len(test))))
limit = test.src_lens + 2
found = greedy(copier, batch.src, limit, BOS, EOS)
wanted = [row[row != PAD][:-1].tolist() for row in batch.tgt_out]  # each target without its </s>
print(f"greedy: {sum(f == w for f, w in zip(found, wanted))} of {len(test)} new sequences copied exactly")
for f, w in list(zip(found, wanted))[:3]:
    print("  source", w, "-> output", f)

# %% [markdown]
# ### Beam search
#
# `beam_search` leaves a beam of 1 to greedy search, and otherwise takes the best of the
# hypotheses that `_beam` finished. `_beam` searches a batch of sentences at once, with $K$ rows a
# sentence for its $K$ hypotheses (`beam`); the encoder runs once a sentence. The rows start as
# $K$ copies of `<s>`, all but the first at a score of $-\infty$, so that the first step does not
# pick one continuation $K$ times. At each step, every hypothesis is extended by every token, its
# score the sum of its tokens' log-probabilities, and the $2K$ best continuations of each sentence
# are kept: enough to hold $K$ that do not end in `</s>`. Those that end in `</s>` and rank among
# the first $K$ are finished, their score divided by the length penalty (`_finish_eos`); the $K$
# best of the others go on, and the decoder's cached keys and values follow them
# (`state.select`). A sentence is done when $K$ of its hypotheses have finished, or at its length
# limit, where the live ones are finished as they are (`_finish_long`). On the copier: beam 4 over
# the 200 new sequences, and the 4 best hypotheses of the first.

# %%
show(beam_search)
show(search._beam)
show(search._finish_eos)
show(search._finish_long)
beamed = beam_search(copier, batch.src, beam=4, alpha=0.6, max_len=limit, bos=BOS, eos=EOS)
print(f"beam 4: {sum(f == w for f, w in zip(beamed, wanted))} of {len(test)} new sequences copied exactly")
nbest = beam_search_nbest(copier, batch.src[:1], beam=4, alpha=0.6, max_len=limit[:1], bos=BOS, eos=EOS, nbest=4)
print("beam 4, the hypotheses of", wanted[0], "best first:")
for hypothesis in nbest[0]:
    print(f"  {hypothesis.tokens}  log P = {hypothesis.log_prob:.3f}")

# %% [markdown]
# An n-best list can hold an empty hypothesis, `[]`. `</s>` is a token like any other, and
# nothing stops the search from choosing it first: at every step, a continuation ending in `</s>`
# that ranks among the `beam` best finishes there, and a sentence is done once `beam` hypotheses
# have finished. A copier this sure of its first token leaves every other first token, `</s>`
# among them, nearly impossible, so the runners-up that finish can include the empty one. It
# ranks last or near it, and the best hypothesis is the one a translation uses. (The list above
# may or may not show one: a machine that rounds differently trains a slightly different copier.)
#
# The same rule can cost a sentence its best hypothesis. The search stops a sentence once `beam`
# hypotheses have finished, so when runners-up ending in `</s>` fill those places while the best
# one, far more probable, is still being written, the best is never finished and a shorter copy
# wins. Greedy search has no runners-up and cannot lose its one hypothesis that way, which is how
# beam search can copy fewer sequences than greedy search above.
#
# fairseq stops the same way, and so does Hugging Face with `early_stopping=True`. The exact rule
# would go on while a live hypothesis could still win: its log-probability so far over the length
# penalty at the length limit, the most it could score, above the best finished score. It was
# tried on the trained Multi30k model ("stopping rule" rows of [the experiments](experiments.md)),
# and it finds what the penalty rewards: with $\alpha$ 1.4 some sentences' best-scoring output is a
# phrase repeated until the length limit cuts it, which this rule never reaches, and at a smaller
# $\alpha$, where it does not, it scores the same at twice the decoding time.
#
# The length penalty is where this project departs from the paper: `decode.alpha` was tuned on
# Multi30k's validation set, and values well above the paper's 0.6 won ("decode α" rows of
# [the experiments](experiments.md)). Every token lowers a hypothesis's log-probability, so beam
# search left alone prefers short outputs; dividing by $lp(|Y|)$ offsets that, and a larger
# $\alpha$ offsets more. The penalty at a few lengths, and how much lower a 20-token hypothesis's
# log-probability may be than a 10-token one's and still tie:

# %%
for alpha in (0.6, params.decode.alpha):
    lps = ", ".join(f"lp({n}) = {length_penalty(n, alpha):.2f}" for n in (5, 10, 20))
    ratio = length_penalty(20, alpha) / length_penalty(10, alpha)
    print(f"alpha {alpha}: {lps}; 20 tokens tie 10 with {ratio:.2f} times the log P")

# %% [markdown]
# Source attention of the trained copier on one sequence: each output position looks at the
# source position it copies, so the weights form a diagonal.

# %%
last = copier.decoder.layers[-1].src_attn
last.keep_weights = True
with torch.no_grad():
    copier(batch.src[:1], batch.tgt_in[:1])
last.keep_weights = False
n = int(test.src_lens[0])
fig, axes = plt.subplots(1, toy["h"], figsize=(11, 2.8))
for head, ax in enumerate(axes):
    ax.imshow(last.weights[0, head, :n, :n], cmap="viridis", vmin=0, vmax=1)
    ax.set(title=f"head {head + 1}", xlabel="source position", ylabel="output position" if head == 0 else "")
fig.tight_layout()

# %% [markdown]
# ## Averaging checkpoints (section 6.1)
#
# The paper decodes with the average of its last 5 checkpoints, written every 10 minutes (the big
# model: 20). The weights of the last few checkpoints scatter around the point the optimizer is
# heading for, and their mean, weight by weight, tends to lie closer to it: an ensemble's smoothing
# at the cost of one model. This pipeline's `average_checkpoints` stage takes the mean of the last
# `average.last_k` epoch checkpoints (in float32, `transformer/checkpoints.py`). The cooldown also
# settles the weights at the end, so the two overlap: the default averages a few, the en→de recipe
# decodes its last checkpoint alone ("average the last" rows of [the experiments](experiments.md)).

# %% [markdown]
# ## The real run: Multi30k
#
# The pipeline (`dvc repro`) trains the same code on Multi30k with the default recipe of
# params.yaml, whose main choices are printed below, on 2 CPU cores. The repository commits that
# reference run's scores; each comes with its 95% bootstrap interval and its sacreBLEU signature,
# which says exactly how it was computed (tokenizer, casing, smoothing, sacreBLEU's version), so
# that it can be compared with another figure.

# %%
print(f"{params.data.corpus} {params.data.src_lang}->{params.data.tgt_lang}, {params.vocab.kind} {params.vocab.size}")
print(f"model: N={recipe.N}, d_model={recipe.d_model}, d_ff={recipe.d_ff}, h={recipe.h}, {recipe.norm}-norm")
print(f"train: {train.epochs} epochs of {train.max_tokens} tokens a batch, label smoothing {train.label_smoothing}")
print(f"last {params.average.last_k} checkpoints averaged, beam {params.decode.beam}, alpha {params.decode.alpha}")
print()
scores = json.loads(open("reports/scores.json").read())
signatures = json.loads(open("reports/signatures.json").read())
for testset, scored in scores.items():
    print(testset)
    for metric, value in values(scored).items():
        print(f"  {metric:12s} {with_interval(value, interval(scored, metric)):>13s}   {signatures[testset][metric]}")

# %% [markdown]
# Five test2016 sentences as that run translated them, the same lines the report shows, from the
# reference the repository commits for the recipe (its translations and what made them), against
# which `make repro` judges a run of it:

# %%
committed = json.loads((reference_dir(params) / RECORD).read_text())
for row in committed["examples"]:
    print(f"line {row['line']}")
    print(f"  source       {row['source']}")
    print(f"  reference    {row['reference']}")
    print(f"  translation  {row['translations'][0]}  (sentence BLEU {row['bleu'][0]})")

# %% [markdown]
# The `figures` stage draws the trained model's attention on sentences of the validation set.
# Encoder self-attention, decoder self-attention and source attention in the last layer, every
# head, for the first of them:
#
# ![Encoder self-attention of the trained Multi30k model](../reports/figures/attention_1_encoder.png)
#
# ![Decoder self-attention of the trained Multi30k model](../reports/figures/attention_1_decoder.png)
#
# ![Source attention of the trained Multi30k model](../reports/figures/attention_1_source.png)
#
# The last of them again, as an alignment: the mean of the heads, a row for each token the model
# writes over the source's tokens:
#
# ![Source attention of the trained Multi30k model, the mean of its heads](../reports/figures/alignment_1.png)
#
# And the reference run's learning rate and loss, as its training logged them:
#
# ![The reference run's learning rate](../reports/figures/lr_schedule.png)
#
# ![The reference run's training and validation loss](../reports/figures/loss.png)
#
# The training loss lies above the validation loss all the way, which is not a sign of trouble:
# training measures a model with dropout on, against label-smoothed targets and with R-Drop's
# consistency term added, while validation measures the plain negative log-likelihood of the
# model with dropout off.
#
# ## The Annotated Transformer's recipe in this pipeline
#
# The preset `params/annotated_transformer.yaml` trains the Annotated Transformer's Multi30k
# de→en recipe with this project's code: `make preset P=annotated_transformer` builds
# params.yaml from the default and the preset, and `dvc repro` runs it. It swaps the departures
# above back out: word vocabularies, the paper's base model with the Annotated Transformer's
# extra dropouts, its schedule, Adam without weight decay, no R-Drop, no averaging, greedy
# decoding. Pre-norm stays, as the Annotated Transformer normalizes that way too. What it keeps
# from this pipeline: token batches instead of its 32 sentences padded to 72, sized to about as
# many sentences an update. What the preset changes, and the two recipes' test2016 BLEU with
# their 95% intervals, as the ladder below ran them, at one seed on one host class:

# %%
default = yaml.safe_load(open("params.yaml"))
for section, changes in yaml.safe_load(open("params/annotated_transformer.yaml")).items():
    for key, value in changes.items():
        if section not in ("report", "export"):  # names, not the recipe
            print(f"  {section}.{key}: {default[section][key]} -> {value}")
ladder = json.load(open("reports/ladder.json"))
theirs, ours = (ladder["metrics"]["bleu"]["systems"][end] for end in (0, -1))
print(f"test2016 BLEU: annotated_transformer {theirs['score']} {theirs['ci95']}")
print(f"               default {ours['score']} {ours['ci95']}")

# %% [markdown]
# Both are single runs of one seed; the README says how far a seed alone moves a score.
#
# ### From that recipe to ours, one change at a time
#
# What is each departure worth? The ladder in `docs/ladder.yaml` starts from the preset and sets
# its keys back to the default a few at a time, one change a step, until the last step is the
# default recipe; every step trains at the default's seed on one host class, and
# `transformer compare --stepwise` compares each step with the one before it on test2016. A step
# that changes only the averaging or the search reuses the training of the step after it. Each
# row: the step's BLEU with its 95% bootstrap interval, the difference to the step above with the
# difference's interval, and the p-value of the paired approximate-randomization test; a change
# pays, or costs, where p is below 0.05.
# The ladder's two ends are single runs on that one host class, so they can differ from the
# README's rows of the same recipes, which come from runs of their own.
# `python docs/tools/ladder.py run` runs the steps (hours on a CPU) and
# `python docs/tools/ladder.py table` writes the table, `reports/ladder.json`, that this cell reads:

# %%
for k, (step, row) in enumerate(zip(ladder["steps"], ladder["metrics"]["bleu"]["systems"])):
    print(f"{k}. {step['change']}")
    line = f"   BLEU {row['score']:5.2f} {row['ci95']}"
    if "diff" in row:
        verdict = "no significant difference" if row["p_ar"] >= 0.05 else "pays" if row["diff"] > 0 else "costs"
        line += f"   {row['diff']:+.2f} {row['diff_ci95']}, p {row['p_ar']:.4f}: {verdict}"
    print(line)
print(f"signature: {ladder['metrics']['bleu']['signature']}")

# %% [markdown]
# And in sentences: five of test2016's, spread evenly over it, as the two ends of the ladder
# translate them, the Annotated Transformer's recipe (step 0) and ours (the last step). Each
# translation carries its sentence BLEU, a rough guide to one sentence: it counts shared n-grams,
# so a better sentence can score lower (the first line), and the corpus's BLEU above is the
# measure. The same table's rows, every step's translation of each line, are in
# `reports/ladder.json`.

# %%
last = len(ladder["steps"]) - 1
for row in ladder["examples"]:
    print(f"line {row['line']}")
    print(f"  source     {row['source']}")
    print(f"  reference  {row['reference']}")
    for k in (0, last):
        print(f"  step {k}     {row['translations'][k]}  (sentence BLEU {row['bleu'][k]})")

# %% [markdown]
# Where does the model look as it writes? Below, the last step's model translates the first of
# those lines greedily, one likeliest token at a time, and the map shows its last layer's source
# attention, the mean of its heads: a row for each token it writes, over the source's tokens, as
# the figures stage draws it for a validation sentence (`reports/figures/alignment_1.png`). A word
# that BPE splits shows its pieces after the first with a middle dot (`an`, `·st`, ...). The
# translation's start follows the source word by word. Then greedy search falls into a loop that
# beam search, in the table above, avoids: the three `seen` rows all look at the same place, the
# verb `an·st·ar·rt` (stares at); with its attention where it was, the model writes the same word
# again. `python docs/tools/ladder.py table` stores these weights in `reports/ladder.json`.

# %%
attention = ladder["attention"]
ax = draw_alignment(
    plt.figure(layout="constrained"), torch.tensor(attention["weights"]), attention["source"], attention["outputs"]
)
ax.set_title(f"Source attention of the last step's model, test2016 line {attention['line']}, greedy")
print("greedy:", " ".join(attention["outputs"]))

# %% [markdown]
# ## What the pipeline adds
#
# The cells above are the model; the pipeline around it makes a run repeatable and cheap to redo:
#
# - **Caching.** Every stage (download, tokenize, vocabulary, train, average, decode, score) is a
#   DVC stage whose inputs and params are hashed: change `decode.beam` and only decoding and
#   scoring run again. See [the pipeline and its params](pipeline.md).
# - **Resuming.** Training writes checkpoints as it goes; an interrupted run continues from the
#   last one to the same weights it would have reached uninterrupted. See [reliability](reliability.md).
# - **Tracking.** Every training is an MLflow run with its params, curves and model, every
#   evaluation a run nested under it; `dvc exp` compares recipes. See
#   [experiments and MLflow](tracking.md).
# - **Scale.** The same code trains under `torchrun` on several processes, GPUs and nodes, with
#   batches that do not depend on how they are split. See [training at scale](scale.md).
# - **Using the model.** `transformer translate` and the [Python API](reference.md) take raw text
#   and give raw text; the model file carries its vocabulary and params. See
#   [using a trained model](using-a-model.md).
