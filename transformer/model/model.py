"""The encoder-decoder model (Figure 1), its composition root make_model, and load_model for a saved one."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from transformer import checkpoints
from transformer.config import ModelConfig, model_problems
from transformer.io import DataError
from transformer.model.attention import Mask
from transformer.model.embeddings import Embeddings, PositionalEncoding
from transformer.model.layers import Cache, Decoder, DecoderLayer, Encoder, EncoderLayer


@dataclass
class DecodeState:
    """What incremental decoding carries from one step to the next. Rows come in blocks of `beam`
    that decode one sentence (a beam's hypotheses): what depends on the source alone, its mask and
    source attention's keys and values, is the same in every row of a block."""

    src_mask: torch.Tensor  # (B, 1, 1, S)
    targets: list[Cache]  # per decoder layer: self-attention keys and values of the prefix, (B, h, T, d_k)
    sources: list[Cache]  # per decoder layer: source attention's keys and values of the memory, (B, h, S, d_k)
    beam: int = 1
    step: int = 0

    def select(self, index: torch.Tensor) -> DecodeState:
        """Keeps (and reorders) the rows in `index`: beam reordering and dropping finished sentences.
        Each block of `beam` rows of the result must come from one block of this state."""
        targets = [_rows(c, index) for c in self.targets]
        src_mask, sources = self.src_mask, self.sources
        blocks = torch.arange(len(index), device=index.device) // self.beam
        if len(index) != len(src_mask) or not bool((index // self.beam == blocks).all()):
            # Sentences left or moved; a beam's reordering alone leaves the source side as it is.
            src_mask = src_mask.index_select(0, index)
            sources = [_rows(c, index) for c in sources]
        return DecodeState(src_mask, targets, sources, self.beam, self.step)


def _rows(cache: Cache, index: torch.Tensor) -> Cache:
    return {k: v.index_select(0, index) for k, v in cache.items()}


class Transformer(nn.Module):
    """The encoder-decoder of Figure 1: the encoder maps source tokens to states (the `memory`), the
    decoder predicts each target token from the ones before it and the memory, and the generator
    projects its states to next-token logits. forward gives the decoder's states for training;
    start and step decode one token at a time."""

    # Keyword-only: the names are params.yaml's model keys (plus the vocabularies' sizes and pad id),
    # and a model file's model_config is exactly these keyword arguments.
    def __init__(
        self,
        *,
        src_vocab: int,
        tgt_vocab: int,
        pad: int,
        N: int,
        d_model: int,
        d_ff: int,
        h: int,
        dropout: float,
        norm: str,
        tie_embeddings: bool,
        attn_dropout: float = 0.0,
        ff_dropout: float = 0.0,
        word_dropout: float = 0.0,
        decoder_N: int = 0,
    ):
        super().__init__()
        self.pad, self.word_dropout = pad, word_dropout
        layer = {"d_model": d_model, "d_ff": d_ff, "h": h, "dropout": dropout, "norm": norm}
        layer |= {"attn_dropout": attn_dropout, "ff_dropout": ff_dropout}
        self.encoder = Encoder([EncoderLayer(**layer) for _ in range(N)], d_model, norm)
        self.decoder = Decoder([DecoderLayer(**layer) for _ in range(decoder_N or N)], d_model, norm)
        self.src_embed = Embeddings(src_vocab, d_model)
        self.tgt_embed = self.src_embed if tie_embeddings else Embeddings(tgt_vocab, d_model)
        self.position = PositionalEncoding(d_model)
        self.dropout = nn.Dropout(dropout)  # on the sums of embeddings and positional encodings (section 5.4)
        self.generator = nn.Linear(d_model, tgt_vocab, bias=False)  # the pre-softmax projection (section 3.4)
        if tie_embeddings:
            self.generator.weight = self.tgt_embed.lut.weight

    def src_mask(self, src: torch.Tensor) -> Mask:
        """Attention over the source sees its tokens, never its padding: keys (B, 1, 1, S)."""
        return Mask(keys=(src != self.pad)[:, None, None, :])

    def source_embeddings(self, src: torch.Tensor) -> torch.Tensor:
        """The source's embeddings plus positional encodings (B, S, d_model), before dropout. In training,
        word dropout zeroes each token's embedding with chance `word_dropout`, unscaled: its position
        is still encoded, its identity is not."""
        x = self.src_embed(src)
        if self.training and self.word_dropout:
            x = x * (torch.rand(src.shape, device=src.device) >= self.word_dropout).unsqueeze(-1).to(x.dtype)
        return self.position(x)

    def target_embeddings(self, tgt: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The target's embeddings plus the positional encodings of positions start, start + 1, ..., before dropout."""
        return self.position(self.tgt_embed(tgt), start)

    def encode(self, src: torch.Tensor, src_mask: Mask) -> torch.Tensor:
        """The memory (B, S, d_model)."""
        return self.encoder(self.dropout(self.source_embeddings(src)), src_mask)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: Mask, tgt_mask: Mask) -> torch.Tensor:
        """The decoder's states (B, T, d_model) of the whole target at once, as training sees it."""
        return self.decoder(self.dropout(self.target_embeddings(tgt)), memory, src_mask, tgt_mask)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, copies: int = 1) -> torch.Tensor:
        """The decoder's states (B, T, d_model) of `tgt_in`, each from the target tokens before it.

        `copies` > 1 decodes the batch that many times over one encoding of src, copy after copy
        along the batch dimension, (copies * B, T, d_model): in training each copy draws its own
        decoder dropout and all share the encoder's."""
        src_mask = self.src_mask(src)
        memory = self.encode(src, src_mask)
        if copies > 1:
            memory, tgt_in = memory.repeat(copies, 1, 1), tgt_in.repeat(copies, 1)
            src_mask = Mask(keys=src_mask.keys.repeat(copies, 1, 1, 1))
        # Right-padded targets need no padding mask: a real query never sees a later (pad) key
        # through the causal mask, and the loss ignores the pad queries.
        return self.decode(tgt_in, memory, src_mask, Mask(causal=True))

    def start(self, src: torch.Tensor, beam: int = 1) -> DecodeState:
        """Encodes src and projects source attention's keys and values once per sentence;
        `beam` > 1 gives each sentence that many consecutive rows."""
        src_mask = self.src_mask(src)
        memory = self.encode(src, src_mask)
        sources = [dict(zip("kv", layer.src_attn.memory_heads(memory))) for layer in self.decoder.layers]
        state = DecodeState(src_mask.keys, [{} for _ in self.decoder.layers], sources)
        if beam == 1:
            return state
        return replace(state.select(torch.arange(len(src), device=src.device).repeat_interleave(beam)), beam=beam)

    def step(self, state: DecodeState, last: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the next token (B, V), given the previous one (B,); updates `state`.
        One token attends to every token before it, so its self-attention needs no mask."""
        x = self.dropout(self.target_embeddings(last[:, None], state.step))
        caches = list(zip(state.targets, state.sources))
        x = self.decoder(x, None, Mask(keys=state.src_mask), Mask(), caches)
        state.step += 1
        return torch.log_softmax(self.generator(x[:, -1]).float(), dim=-1)


def count_parameters(model: nn.Module) -> int:
    """Numbers the model learns; a weight shared by several modules (tied embeddings) counts once."""
    return sum(p.numel() for p in model.parameters())


def decoder_layers(config: dict[str, Any]) -> int:
    """The decoder's depth of a model config: decoder_N, or N where it is 0 or absent (older files)."""
    return config.get("decoder_N") or config["N"]


def make_model(config: ModelConfig | None = None, **args: Any) -> Transformer:
    """Builds the model, Xavier-uniform on every matrix, from Transformer's keyword arguments: a
    ModelConfig (params.yaml's `model` section) with src_vocab, tgt_vocab and pad, or all of them
    as keywords (a model file's model_config). N encoder layers and decoder_N decoder layers (0: N);
    the three extra dropouts and decoder_N default to 0, as in model files written before them."""
    model = Transformer(**(dataclasses.asdict(config) if config else {}) | args)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


def load_model(path: Path | str, device: torch.device | str = "cpu") -> tuple[Transformer, dict[str, Any]]:
    """The model a file holds, built from its model_config with its weights, in eval mode, and the
    checkpoint itself (vocabularies, params); weights that do not fit the config raise DataError."""
    checkpoint = checkpoints.load(path)
    return _built(checkpoint["model_config"], checkpoint["model"], str(path), device), checkpoint


def load_members(path: Path | str, device: torch.device | str = "cpu") -> tuple[list[Transformer], dict[str, Any]]:
    """Every model a file holds (an ensemble's members, in member order; else the one), and the file.
    load_model gives an ensemble's first member alone."""
    model, checkpoint = load_model(path, device)
    members = checkpoint.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, dict) and "model" in m for m in members):
        raise DataError(f"{path}: 'members' is not a list of member weights")
    return [model] + [
        _built(checkpoint["model_config"], m["model"], f"{path} (member seed {m.get('seed')})", device) for m in members
    ], checkpoint


def _built(config: Any, weights: dict[str, Any], source: str, device: torch.device | str) -> Transformer:
    model = make_model(**check_model_config(config, weights, source))
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise DataError(f"{source}: weights do not fit the model config ({str(e).splitlines()[0]})") from None
    return model.to(device).eval()


def check_model_config(config: Any, weights: dict[str, Any], source: str) -> dict[str, Any]:
    """make_model's arguments from a model file, checked before anything is allocated.

    Types and ranges first; then the model they describe, built on the meta device (no
    memory), must have exactly the shapes of the file's weights: a file can never make
    us build a model larger than itself."""
    args = _checked_args(config, source)
    found = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in weights.items()}
    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in Transformer(**args).state_dict().items()}
    except RuntimeError:  # sizes so large that even their shapes overflow
        expected = {}
    if found != expected:
        key = min(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        raise DataError(
            f"{source}: weights do not fit the model config ('{key}' is {found.get(key)} in the file, "
            f"{expected.get(key)} by the config)"
        )
    return args


def _checked_args(config: Any, source: str) -> dict[str, Any]:
    signature = {k: p for k, p in inspect.signature(Transformer.__init__).parameters.items() if k != "self"}
    if not isinstance(config, dict):
        raise DataError(f"{source}: model config is a {type(config).__name__}, not a mapping")
    unknown = sorted(set(config) - set(signature))
    missing = sorted(k for k, p in signature.items() if p.default is p.empty and k not in config)
    if unknown or missing:
        raise DataError(f"{source}: model config has unknown keys {unknown} or lacks {missing}")
    c = {k: p.default for k, p in signature.items()} | config
    for key, value in c.items():
        kind = signature[key].annotation  # the annotations are strings (from __future__ import annotations)
        if not (type(value).__name__ == kind or (kind == "float" and type(value) is int)):
            raise DataError(f"{source}: model config '{key}' = {value!r} is not {kind}")
    problems = model_problems(c)
    if problems:
        raise DataError(
            f"{source}: model config out of range: {config}; " + "; ".join(f"{key} {why}" for key, why in problems)
        )
    return c
