"""Export to Hugging Face transformers: our model file as a directory that stock
`AutoModelForSeq2SeqLM.from_pretrained` loads, with no code of ours. A post-norm model (the paper's)
becomes a MarianMTModel, a pre-norm one (a final LayerNorm per stack) a PegasusForConditionalGeneration;
both are the paper's encoder-decoder with sinusoidal positions, ReLU and embeddings scaled by sqrt(d_model).

The one difference in layout: our positional encoding interleaves sin and cos (section 3.5), theirs puts
every sin first and every cos after. Reordering the d_model coordinates of the residual stream by
PERMUTATION makes the two the same function: every weight that reads the stream (embeddings, q, k, v,
the first feed-forward matrix, the generator) is permuted along its input, every weight that writes it
(attention outputs, the second feed-forward matrix) along its output, and every LayerNorm's gain and
bias too; LayerNorm's mean and variance, heads, ReLU and softmax do not depend on the order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from transformer import checkpoints
from transformer.data.vocab import BOS, EOS
from transformer.errors import DataError
from transformer.io import atomic_dir
from transformer.model.embeddings import PositionalEncoding
from transformer.model.model import decoder_layers

POSITIONS = 1024  # the longest source or translation the exported model takes, as CTranslate2's default
TABLE_TOLERANCE = 1e-4  # Marian recomputes its position table in float64 on load; ours is float32


def export_hf(model_path: Path, out: Path) -> None:
    """Writes the transformers model directory `out` from a model file (see write_hf)."""
    write_hf(checkpoints.load(model_path), out)


def write_hf(checkpoint: dict[str, Any], out: Path) -> None:
    """Writes `out` (atomically): config.json, generation_config.json and float32 model.safetensors, the
    model only; the tokenizer is not exported yet, so a user maps text to our ids with our vocabulary.
    Of an ensemble's file, the first member is written. After writing, the directory is loaded back and
    its position tables compared with ours, since transformers rebuilds or keeps them by its own rules."""
    config = checkpoint["model_config"]
    model = hf_model(config)
    missing, unexpected = model.load_state_dict(hf_state(checkpoint["model"], config), strict=False)
    if unexpected or any("embed_positions" not in key for key in missing):
        raise DataError(f"the model file's weights do not fit {type(model).__name__} ({missing + unexpected})")
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        check_positions(tmp, config["d_model"])


def hf_model(config: dict[str, Any]):
    """The transformers model (random weights) whose shape is our model config's: MarianMTModel for
    post-norm, PegasusForConditionalGeneration for pre-norm. Pegasus has one embedding matrix for the
    encoder and the decoder, so a pre-norm model with untied embeddings fits no stock class."""
    from transformers import MarianConfig, MarianMTModel, PegasusConfig, PegasusForConditionalGeneration

    tie = config["tie_embeddings"]
    if config["norm"] == "pre" and not tie:
        raise DataError(
            "a pre-norm model with untied embeddings (tie_embeddings: false) cannot be exported to transformers: "
            "its pre-norm class, Pegasus, shares one embedding matrix between the encoder and the decoder"
        )
    fields = {
        "vocab_size": config["src_vocab"],
        "d_model": config["d_model"],
        "encoder_layers": config["N"],
        "decoder_layers": decoder_layers(config),
        "encoder_attention_heads": config["h"],
        "decoder_attention_heads": config["h"],
        "encoder_ffn_dim": config["d_ff"],
        "decoder_ffn_dim": config["d_ff"],
        "dropout": config["dropout"],
        "attention_dropout": config.get("attn_dropout", 0.0),
        "activation_dropout": config.get("ff_dropout", 0.0),
        "activation_function": "relu",  # the defaults, gelu and unscaled embeddings, are not the paper's
        "scale_embedding": True,
        "max_position_embeddings": POSITIONS,
        "pad_token_id": config["pad"],
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "decoder_start_token_id": BOS,  # our decoder starts at <s>
        "forced_eos_token_id": None,  # a translation that reaches the length bound ends there, without </s>
        "tie_word_embeddings": tie,
    }
    if config["norm"] == "pre":
        return PegasusForConditionalGeneration(PegasusConfig(**fields))
    marian = {"decoder_vocab_size": config["tgt_vocab"], "share_encoder_decoder_embeddings": tie}
    return MarianMTModel(MarianConfig(**fields | marian))


def permutation(d_model: int) -> torch.Tensor:
    """Our coordinate of each transformers coordinate: the sin coordinates 0, 2, ... first, then the cos ones."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def positions(d_model: int) -> torch.Tensor:
    """Our position table for POSITIONS positions, in transformers' coordinate order."""
    return PositionalEncoding(d_model)._table(POSITIONS)[:, permutation(d_model)]


def hf_state(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names, float32, with the residual stream's coordinates permuted."""
    w = {k: v.float() for k, v in weights.items()}
    p = permutation(config["d_model"])
    state = {"lm_head.weight": w["generator.weight"][:, p], "final_logits_bias": torch.zeros(1, config["tgt_vocab"])}
    source, target = w["src_embed.lut.weight"][:, p], w["tgt_embed.lut.weight"][:, p]
    state |= {"model.encoder.embed_tokens.weight": source, "model.decoder.embed_tokens.weight": target}
    if config["tie_embeddings"]:
        state["model.shared.weight"] = source
    if config["norm"] == "pre":  # Pegasus keeps the position tables it is given; Marian rebuilds its own
        table = positions(config["d_model"])
        state |= {f"model.{side}.embed_positions.weight": table for side in ("encoder", "decoder")}
        for side in ("encoder", "decoder"):
            state |= _norm(w, f"{side}.norm.", f"model.{side}.layer_norm.", p)
    for i in range(config["N"]):
        state |= _encoder_layer(w, f"encoder.layers.{i}.", f"model.encoder.layers.{i}.", p)
    for i in range(decoder_layers(config)):
        state |= _decoder_layer(w, f"decoder.layers.{i}.", f"model.decoder.layers.{i}.", p)
    return state


def _encoder_layer(
    w: dict[str, torch.Tensor], ours: str, theirs: str, p: torch.Tensor, ff_sublayer: int = 1
) -> dict[str, torch.Tensor]:
    """Self-attention and the feed-forward network: an encoder layer whole, and of a decoder layer the
    first sub-layer and the last (its `ff_sublayer`)."""
    state = _attention(w, ours + "self_attn.", theirs + "self_attn.", p)
    state |= _norm(w, ours + "sublayers.0.norm.", theirs + "self_attn_layer_norm.", p)
    state |= _feed_forward(w, ours + "ff.", theirs, p)
    return state | _norm(w, f"{ours}sublayers.{ff_sublayer}.norm.", theirs + "final_layer_norm.", p)


def _decoder_layer(w: dict[str, torch.Tensor], ours: str, theirs: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    state = _encoder_layer(w, ours, theirs, p, ff_sublayer=2)
    state |= _attention(w, ours + "src_attn.", theirs + "encoder_attn.", p)
    return state | _norm(w, ours + "sublayers.1.norm.", theirs + "encoder_attn_layer_norm.", p)


def _attention(w: dict[str, torch.Tensor], ours: str, theirs: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """q, k and v apart from our fused projections, whose heads are contiguous d_k blocks as theirs are."""
    if ours + "qkv.weight" in w:  # self-attention: q, k and v in one projection
        fused = {"qkv": ("q", "k", "v")}
    else:  # source attention: q of the decoder's states, k and v of the memory
        fused = {"q": ("q",), "kv": ("k", "v")}
    state = {}
    for name, parts in fused.items():
        weights, biases = w[f"{ours}{name}.weight"].chunk(len(parts)), w[f"{ours}{name}.bias"].chunk(len(parts))
        for part, weight, bias in zip(parts, weights, biases):
            state |= {f"{theirs}{part}_proj.weight": weight[:, p], f"{theirs}{part}_proj.bias": bias}
    out = {f"{theirs}out_proj.weight": w[ours + "out.weight"][p], f"{theirs}out_proj.bias": w[ours + "out.bias"][p]}
    return state | out


def _feed_forward(w: dict[str, torch.Tensor], ours: str, theirs: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        theirs + "fc1.weight": w[ours + "w_1.weight"][:, p],
        theirs + "fc1.bias": w[ours + "w_1.bias"],
        theirs + "fc2.weight": w[ours + "w_2.weight"][p],
        theirs + "fc2.bias": w[ours + "w_2.bias"][p],
    }


def _norm(w: dict[str, torch.Tensor], ours: str, theirs: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {theirs + "weight": w[ours + "weight"][p], theirs + "bias": w[ours + "bias"][p]}


def check_positions(model_dir: Path, d_model: int) -> None:
    """Raises DataError unless the model that `model_dir` loads holds our position table, permuted."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    ours = positions(d_model)
    for side in (model.model.encoder, model.model.decoder):
        gap = float((side.embed_positions.weight.detach() - ours).abs().max())
        if gap > TABLE_TOLERANCE:
            raise DataError(f"{model_dir}: transformers loads a position table {gap:.2g} away from ours")
