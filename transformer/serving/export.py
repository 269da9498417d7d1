"""Export to CTranslate2: our model file mapped onto CTranslate2's TransformerSpec by a converter of
our own (CTranslate2's Converter base class, our weight layout). Greedy decoding of the exported
model in float32 gives our greedy translations (tests/test_export.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from transformer import checkpoints
from transformer.config import CHOICES
from transformer.data.vocab import BpeVocab, Vocab, vocab_from_state
from transformer.decoding.translate import Search
from transformer.errors import DataError
from transformer.io import atomic_dir
from transformer.model.embeddings import PositionalEncoding
from transformer.model.model import decoder_layers

QUANTIZATIONS = CHOICES["export.quantization"]
POSITIONS = 1024  # rows of the position table written out: CTranslate2's default max_input_length
LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which our layers use


def export_ctranslate2(model_path: Path, out: Path, quantization: str = "none") -> None:
    """Writes the CTranslate2 model directory `out` from a model file (see write_ctranslate2)."""
    write_ctranslate2(checkpoints.load(model_path), out, quantization)


def write_ctranslate2(checkpoint: dict[str, Any], out: Path, quantization: str = "none") -> None:
    """Writes the CTranslate2 model directory `out` (atomically); quantization "none" keeps float32.
    CTranslate2 has no ensembles: of a file with train.members > 1, the first member is written."""
    import ctranslate2.converters

    if quantization not in QUANTIZATIONS:
        raise DataError(f"quantization '{quantization}' is not one of {', '.join(QUANTIZATIONS)}")

    class OurConverter(ctranslate2.converters.Converter):
        def _load(self):
            return transformer_spec(checkpoint)

    with atomic_dir(out) as tmp:
        OurConverter().convert(str(tmp), quantization=None if quantization == "none" else quantization, force=True)


def transformer_spec(checkpoint: dict[str, Any]):
    """CTranslate2's TransformerSpec holding the checkpoint's weights and vocabularies."""
    from ctranslate2.specs import TransformerSpec

    config, state = checkpoint["model_config"], {k: v.float().numpy() for k, v in checkpoint["model"].items()}
    pre = config["norm"] == "pre"
    spec = TransformerSpec.from_config((config["N"], decoder_layers(config)), config["h"], pre_norm=pre)
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    table = PositionalEncoding(config["d_model"])._table(POSITIONS).numpy()  # ours interleaves sin and cos
    for side, stack, embed in (("encoder", spec.encoder, "src_embed"), ("decoder", spec.decoder, "tgt_embed")):
        (stack.embeddings[0] if side == "encoder" else stack.embeddings).weight = state[f"{embed}.lut.weight"]
        stack.position_encodings.encodings = table
        if pre:  # a pre-norm stack ends with a LayerNorm of its own
            _norm(stack.layer_norm, state, f"{side}.norm.")
        for i, layer in enumerate(stack.layer):
            _layer(layer, state, f"{side}.layers.{i}.", side == "decoder")
    spec.decoder.projection.weight = state["generator.weight"]
    vocabs = {side: vocab_from_state(checkpoint["vocab"][side]) for side in ("src", "tgt")}
    spec.register_source_vocabulary(tokens(vocabs["src"]))
    spec.register_target_vocabulary(tokens(vocabs["tgt"]))
    return spec


def _layer(layer, state: dict[str, np.ndarray], prefix: str, decoder: bool) -> None:
    """One encoder or decoder layer: its attention(s), feed-forward network and their LayerNorms."""
    _linear(layer.self_attention.linear[0], state, prefix + "self_attn.qkv.")  # q, k, v fused, in that order
    _linear(layer.self_attention.linear[1], state, prefix + "self_attn.out.")
    _norm(layer.self_attention.layer_norm, state, prefix + "sublayers.0.norm.")
    if decoder:
        _linear(layer.attention.linear[0], state, prefix + "src_attn.q.")
        _linear(layer.attention.linear[1], state, prefix + "src_attn.kv.")  # k, v fused
        _linear(layer.attention.linear[2], state, prefix + "src_attn.out.")
        _norm(layer.attention.layer_norm, state, prefix + "sublayers.1.norm.")
    _linear(layer.ffn.linear_0, state, prefix + "ff.w_1.")
    _linear(layer.ffn.linear_1, state, prefix + "ff.w_2.")
    _norm(layer.ffn.layer_norm, state, prefix + f"sublayers.{2 if decoder else 1}.norm.")


def _linear(spec, state: dict[str, np.ndarray], prefix: str) -> None:
    spec.weight, spec.bias = state[prefix + "weight"], state[prefix + "bias"]


def _norm(spec, state: dict[str, np.ndarray], prefix: str) -> None:
    spec.gamma, spec.beta = state[prefix + "weight"], state[prefix + "bias"]


def tokens(vocab: Vocab) -> list[str]:
    """Every id's token string, in id order: what CTranslate2 maps back to the same ids."""
    if isinstance(vocab, BpeVocab):
        return [vocab.sp.id_to_piece(i) for i in range(len(vocab))]
    return list(vocab.itos)


def source_tokens(vocab: Vocab, tokenized: str) -> list[str]:
    """A tokenized line as the token strings our encoder reads, `</s>` included."""
    from transformer.data.vocab import EOS

    names = tokens(vocab)
    return [names[i] for i in vocab.encode(tokenized) + [EOS]]


def load_ctranslate2(model_dir: Path, threads: int = 1):
    """An exported model ready to translate on CPU, computing in its weights' own type."""
    import ctranslate2

    return ctranslate2.Translator(str(model_dir), device="cpu", intra_threads=threads)


def ctranslate2_translate(
    translator, src_vocab: Vocab, tgt_vocab: Vocab, lines: list[str], search: Search
) -> list[list[int]]:
    """Target ids CTranslate2 decodes for tokenized lines by the beam search `search` describes (a
    Translator's `search()` gives the model's), batched by source length as ours batches. A
    translation is at most the longest source's length + search.max_len_extra: CTranslate2 takes
    one bound for a batch, where ours bounds each sentence. Sampling and n-best lists are ours alone."""
    if search.sample or search.nbest > 1:
        raise ValueError("CTranslate2 translates here by beam search, one translation a line")
    stoi = {t: i for i, t in enumerate(tokens(tgt_vocab))}
    batch = [source_tokens(src_vocab, line) for line in lines]
    out = [[] for _ in lines]
    live = [i for i, b in enumerate(batch) if lines[i].strip()]
    for i, result in zip(
        live,
        translator.translate_batch(
            [batch[i] for i in live],
            beam_size=search.beam,
            length_penalty=search.alpha,
            min_decoding_length=0,
            max_batch_size=max(1, search.batch_tokens // search.beam),
            batch_type="tokens",
            max_decoding_length=max(len(batch[i]) for i in live) + search.max_len_extra if live else 1,
        ),
    ):
        out[i] = [stoi[t] for t in result.hypotheses[0]]
    return out
