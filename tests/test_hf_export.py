"""Export to Hugging Face transformers: the loaded model's log-probabilities, greedy and α=0 beam
translations equal ours (post-norm as Marian, pre-norm as Pegasus, tied and untied embeddings), a model
no stock class fits is one error, and `transformer export --format hf` writes what from_pretrained loads."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model_file
from test_translate import word_vocabs

from transformer.cli import main
from transformer.data.vocab import BOS, EOS, PAD
from transformer.decoding.search import beam_search, greedy
from transformer.errors import DataError
from transformer.model.embeddings import PositionalEncoding
from transformer.model.model import make_model
from transformer.serving.hf import POSITIONS, TABLE_TOLERANCE, permutation, write_hf

SIZES = {"d_model": 16, "d_ff": 32, "h": 2, "dropout": 0.0, "pad": PAD}
# (norm, tie_embeddings, N, decoder_N, source vocabulary, target vocabulary): every shape a stock class holds.
CASES = {
    "post-tied": ("post", True, 2, 0, 30, 30),
    "post-untied": ("post", False, 2, 1, 30, 27),
    "pre-tied": ("pre", True, 2, 1, 30, 30),
    "pre-tied-one-layer": ("pre", True, 1, 0, 30, 30),
}
# Random weights rarely end a translation: each case's seed and its </s> row's scale are picked so that
# some translations end on </s> and some at the length bound, and beam search keeps some non-empty ones.
DRAWS = {"post-tied": (7, 3.0), "post-untied": (0, 3.0), "pre-tied": (2, 2.0), "pre-tied-one-layer": (1, 3.0)}
MAX_EXTRA = 6  # a translation is at most its source's length + MAX_EXTRA tokens, in both searches


def _config(norm, tie, N, decoder_N, src_vocab, tgt_vocab) -> dict:
    return (
        {"norm": norm, "tie_embeddings": tie, "N": N, "decoder_N": decoder_N}
        | SIZES
        | {
            "src_vocab": src_vocab,
            "tgt_vocab": tgt_vocab,
        }
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    """Ours (random weights, seeded) and the transformers model that its exported directory loads."""
    from transformers import AutoModelForSeq2SeqLM

    config = _config(*CASES[request.param])
    seed, eos_scale = DRAWS[request.param]
    torch.manual_seed(seed)
    ours = make_model(**config).eval()
    with torch.no_grad():
        ours.generator.weight[EOS] *= eos_scale
    out = tmp_path_factory.mktemp("hf") / request.param
    write_hf({"model_config": config, "model": ours.state_dict()}, out)
    return ours, AutoModelForSeq2SeqLM.from_pretrained(out).eval(), config


def _sources(vocab: int, count: int, seed: int) -> list[torch.Tensor]:
    """Random sentences of ordinary tokens (no special ids), each ending in </s>, of lengths 3 to 8."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (count,), generator=g).tolist()
    return [torch.cat([torch.randint(4, vocab, (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths]


def _theirs(generated: torch.Tensor) -> list[int]:
    """A transformers translation as ours reads: no decoder start, nothing from </s> on."""
    ids = generated[1:].tolist()
    return ids[: ids.index(EOS)] if EOS in ids else ids


@torch.no_grad()
def test_teacher_forced_log_probabilities_equal_ours(exported):
    ours, theirs, config = exported
    src = torch.nn.utils.rnn.pad_sequence(_sources(config["src_vocab"], 6, seed=1), batch_first=True, padding_value=PAD)
    g = torch.Generator().manual_seed(2)
    tgt_in = torch.cat([torch.full((6, 1), BOS), torch.randint(4, config["tgt_vocab"], (6, 9), generator=g)], 1)
    expected = torch.log_softmax(ours.generator(ours(src, tgt_in)), -1)
    logits = theirs(input_ids=src, attention_mask=src != PAD, decoder_input_ids=tgt_in).logits
    assert (torch.log_softmax(logits, -1) - expected).abs().max() < 1e-4


def test_greedy_translations_equal_ours(exported):
    ours, theirs, config = exported
    ended = 0
    for src in _sources(config["src_vocab"], 12, seed=3):
        max_len = len(src) + MAX_EXTRA
        expected = greedy(ours, src[None], torch.tensor([max_len]), BOS, EOS)[0]
        generated = theirs.generate(src[None], num_beams=1, do_sample=False, max_new_tokens=max_len)
        assert _theirs(generated[0]) == expected, src.tolist()
        ended += len(expected) < max_len
    assert 0 < ended < 12  # some end on </s>, some at the length bound: both rules are compared


def test_beam_translations_at_alpha_zero_equal_ours(exported):
    """Both searches finish a hypothesis whose </s> ranks among the top K of the 2K candidates and stop
    at K finished (early_stopping=True); transformers keeps the best K finished where ours keeps the
    first K, but it stops at the same step, so the best is the same in both. With α > 0 they differ:
    transformers divides by length^α, ours by GNMT's ((5 + length) / 6)^α."""
    ours, theirs, config = exported
    ended = 0
    for src in _sources(config["src_vocab"], 8, seed=4):
        max_len = len(src) + MAX_EXTRA
        expected = beam_search(ours, src[None], 4, 0.0, torch.tensor([max_len]), BOS, EOS)[0]
        ended += 0 < len(expected) < max_len
        generated = theirs.generate(
            src[None], num_beams=4, do_sample=False, length_penalty=0.0, early_stopping=True, max_new_tokens=max_len
        )
        assert _theirs(generated[0]) == expected, src.tolist()
    assert ended > 1  # not only empty translations (α = 0 favours them) or unfinished ones


def test_the_loaded_position_tables_are_ours_permuted(exported):
    """Pegasus keeps the table it is given (ours, exactly); Marian rebuilds its own on load, from float64
    sines: within float32 rounding of arguments up to 1023 radians."""
    _, theirs, config = exported
    table = PositionalEncoding(config["d_model"])._table(POSITIONS)[:, permutation(config["d_model"])]
    for stack in (theirs.model.encoder, theirs.model.decoder):
        if config["norm"] == "pre":
            assert torch.equal(stack.embed_positions.weight, table)
        else:
            assert (stack.embed_positions.weight - table).abs().max() < TABLE_TOLERANCE


def test_the_config_holds_the_papers_choices_not_the_defaults(exported):
    _, theirs, config = exported
    c = theirs.config
    assert (c.model_type, c.activation_function, c.scale_embedding) == (
        {"post": "marian", "pre": "pegasus"}[config["norm"]],
        "relu",
        True,
    )
    assert (c.decoder_start_token_id, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (BOS, BOS, EOS, PAD)
    assert c.forced_eos_token_id is None and theirs.generation_config.forced_eos_token_id is None
    assert (c.encoder_layers, c.decoder_layers) == (config["N"], config["decoder_N"] or config["N"])
    assert not theirs.final_logits_bias.any()


def test_a_pre_norm_model_with_untied_embeddings_is_refused_with_the_reason(tmp_path):
    config = _config("pre", False, 1, 0, 30, 27)
    with pytest.raises(DataError, match="pre-norm model with untied embeddings") as error:
        write_hf({"model_config": config, "model": make_model(**config).state_dict()}, tmp_path / "hf")
    assert "shares one embedding matrix" in str(error.value)
    assert not (tmp_path / "hf").exists()


def test_cli_writes_a_float32_safetensors_model_that_from_pretrained_loads_and_no_tokenizer(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM, MarianMTModel

    model = tiny_model_file(tmp_path / "model.pt", *word_vocabs(), norm="post")
    result = CliRunner().invoke(
        main, ["export", "--format", "hf", "--model", str(model), "--out", str(tmp_path / "hf")]
    )
    assert result.exit_code == 0, result.output
    assert isinstance(AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf"), MarianMTModel)
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.float32}
    assert not list((tmp_path / "hf").glob("*token*")) and not list((tmp_path / "hf").glob("*.spm"))


def test_cli_refuses_quantization_for_hf_with_one_error_line(tmp_path):
    model = tiny_model_file(tmp_path / "model.pt", *word_vocabs(), norm="post")
    args = ["export", "--format", "hf", "--model", str(model), "--out", str(tmp_path / "hf"), "--quantization", "int8"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "is for ctranslate2" in result.output
    assert not (tmp_path / "hf").exists()
