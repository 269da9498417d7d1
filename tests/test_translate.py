"""Translator: a model file in, detokenized translations out, in input order; vocabularies checked."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_model_file

from transformer import checkpoints
from transformer.config import load_params
from transformer.data.vocab import BOS, EOS, SPECIALS, WordVocab
from transformer.decoding.translate import Search, Translator, timed_translate
from transformer.io import DataError
from transformer.model.model import make_model

SRC_LINES = ["ein Hund läuft", "zwei Männer spielen Fußball", "eine Frau liest ein Buch", "ein Kind"]
TGT_LINES = ["a dog runs", "two men play football", "a woman reads a book", "a child"]


def word_vocabs() -> tuple[WordVocab, WordVocab]:
    return WordVocab.build(SRC_LINES, min_freq=1), WordVocab.build(TGT_LINES, min_freq=1)


def _search(**overrides) -> Search:
    """A search of the tests' own, not the model file's decode params, with `overrides`."""
    return Search(**{"beam": 2, "alpha": 0.6, "max_len_extra": 3, "batch_tokens": 6000} | overrides)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    """A tiny, untrained model saved the way average_checkpoints saves one."""
    params = load_params(ROOT / "params.yaml").to_dict()
    assert (params["data"]["src_lang"], params["data"]["tgt_lang"]) == ("de", "en")
    return tiny_model_file(tmp_path_factory.mktemp("model") / "model.pt", *word_vocabs(), params, dropout=0.1)


@pytest.fixture(scope="module")
def translator(model_file) -> Translator:
    return Translator(model_file, device="cpu")


def never_ending(weights: dict) -> dict:
    """Untrained weights changed so that the model never chooses a special token (</s> among them), and
    only the length bound ends a translation. The decoder's last LayerNorm gets a bias of 1, so its
    zero-mean output sums to d_model; each special's output row is -1 everywhere: its logit is -d_model,
    far below any other token's (some units)."""
    weights["decoder.norm.bias"] = torch.ones_like(weights["decoder.norm.bias"])
    weights["generator.weight"][: len(SPECIALS)] = -1.0
    return weights


@pytest.fixture(scope="module")
def never_ending_file(model_file, tmp_path_factory) -> Path:
    ckpt = checkpoints.load(model_file)
    ckpt["model"] = never_ending(ckpt["model"])
    path = tmp_path_factory.mktemp("never_ending") / "model.pt"
    checkpoints.save(path, ckpt)
    return path


@pytest.fixture(scope="module")
def never_ending_translator(never_ending_file) -> Translator:
    return Translator(never_ending_file, device="cpu")


def test_translator_rebuilds_the_saved_model(translator, model_file):
    saved = checkpoints.load(model_file)["model"]
    for key, value in translator.model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert not translator.model.training


def test_translations_keep_line_count_and_order(translator):
    lines = SRC_LINES + ["Hund Hund Hund Hund Hund Hund", "ein"]
    batched = translator.translate_tokenized(lines, _search(batch_tokens=8))  # several batches
    alone = [translator.translate_tokenized([line], _search())[0] for line in lines]
    assert len(batched) == len(lines)
    assert batched == alone
    assert len(set(batched)) > 1  # distinct inputs, distinct outputs: a shuffle would show


def test_empty_input_line_gives_an_empty_output_line(translator):
    out = translator.translate_tokenized(["ein Hund", "", "   ", "eine Frau"], _search(beam=2, max_len_extra=3))
    assert len(out) == 4
    assert out[1] == "" and out[2] == ""
    assert out[0] == translator.translate_tokenized(["ein Hund"], _search(beam=2, max_len_extra=3))[0]


@pytest.mark.parametrize("beam", [1, 2])
@pytest.mark.parametrize("extra", [0, 1, 7])
def test_a_translation_that_never_ends_stops_at_source_length_plus_extra(never_ending_translator, beam, extra):
    out = never_ending_translator.translate_tokenized(
        ["ein Hund", "eine Frau liest"], _search(beam=beam, max_len_extra=extra)
    )
    assert [len(line.split()) for line in out] == [2 + 1 + extra, 3 + 1 + extra]  # its words and </s>, plus extra


def test_outputs_contain_only_target_words(translator):
    _, tgt = word_vocabs()
    words = set(tgt.itos[4:])
    out = translator.translate_tokenized(SRC_LINES, _search(beam=3, max_len_extra=4))
    assert sum(len(line.split()) for line in out) > 0, "an empty output proves nothing"
    for line in out:
        assert set(line.split()) <= words, line


def test_raw_text_is_tokenized_with_the_source_language(translator):
    raw = translator.translate(["ein Hund läuft."], _search(beam=2, max_len_extra=3))
    assert raw == translator.translate_tokenized(["ein Hund läuft \uffed."], _search(beam=2, max_len_extra=3))


def test_timed_translate_reports_the_time_it_took_and_the_rates(never_ending_translator):
    lines = SRC_LINES * 4
    start = time.perf_counter()
    out, speed = timed_translate(never_ending_translator, lines, _search(max_len_extra=50, batch_tokens=8))
    wall = time.perf_counter() - start
    tokens = sum(len(line.split()) + 1 for line in out)  # each translation's tokens and its </s>
    assert len(out) == len(lines) and wall > 0.1  # one sentence a batch: long enough for 0.01 s to tell
    assert speed["seconds"] == pytest.approx(wall, abs=0.01)
    assert speed["sentences_per_s"] == pytest.approx(len(lines) / wall, rel=0.05)
    assert speed["tokens_per_s"] == pytest.approx(tokens / wall, rel=0.05)


@pytest.mark.parametrize(
    "argument",
    [
        {"beam": 0},
        {"alpha": -1.0},
        {"nbest": 0},
        {"top_k": -1},
        {"top_p": 0.0},
        {"temperature": 0.0},
        {"max_len_extra": -1},
        {"batch_tokens": 0},
    ],
)
def test_out_of_range_search_arguments_are_value_errors_naming_them(translator, argument):
    ((name, value),) = argument.items()
    with pytest.raises(ValueError, match=f"^{name} = {value} must be"):
        translator.search(**argument)
    with pytest.raises(ValueError, match=f"^{name} = {value} must be"):
        _search(**argument)


def test_a_search_is_made_of_a_decode_section_with_changes_to_any_field(translator):
    decode = load_params(ROOT / "params.yaml").decode
    assert Search.of(decode) == Search.of(dataclasses.asdict(decode))  # params.yaml's, or a model file's dict
    assert Search.of(decode, beam=1) == Search(1, decode.alpha, decode.max_len_extra, decode.batch_tokens)
    model = translator.params["decode"]
    assert translator.search(nbest=2) == Search(
        model["beam"], model["alpha"], model["max_len_extra"], model["batch_tokens"], nbest=2
    )


def test_more_hypotheses_than_the_beam_are_refused_but_any_number_of_draws_is_not():
    with pytest.raises(ValueError, match=r"^nbest = 3 exceeds the beam size \(2\)$"):
        _search(nbest=3)
    assert _search(sample=True, nbest=3).rows == 3  # a decoder row a draw, whatever the beam


def test_a_timeout_stops_decoding_at_its_first_step_after_it(never_ending_translator, monkeypatch):
    steps, step = [], never_ending_translator.model.step

    def slow_step(*args):
        time.sleep(0.05)
        steps.append(args)
        return step(*args)

    monkeypatch.setattr(never_ending_translator.model, "step", slow_step)
    with pytest.raises(TimeoutError, match="translation stopped after 0.2 s"):
        never_ending_translator.translate(["ein Hund"], _search(beam=1, max_len_extra=50), timeout=0.2)
    assert len(steps) <= 5  # 0.2 s of 0.05 s steps, where the translation takes 2 + 1 + 50


def test_same_vocabulary_passes_the_check(translator, tmp_path):
    from transformer.data.vocab import fingerprint, load_vocabs, save_vocabs

    save_vocabs(tmp_path, *word_vocabs())  # as build_vocab writes it and decode reads it back
    src, tgt = load_vocabs(tmp_path)
    assert (fingerprint(src), fingerprint(tgt)) == (
        fingerprint(translator.src_vocab),
        fingerprint(translator.tgt_vocab),
    )
    translator.check_vocab(src, tgt, tmp_path)  # raises DataError on a mismatch


def test_other_vocabulary_is_refused(translator, tmp_path):
    src, tgt = word_vocabs()
    other = WordVocab.build(TGT_LINES + ["a cat"], min_freq=1)
    with pytest.raises(DataError, match="does not match") as e:
        translator.check_vocab(src, other, tmp_path / "vocab")
    assert "target" in str(e.value) and str(tmp_path / "vocab") in str(e.value)
    with pytest.raises(DataError, match="source vocabulary"):
        translator.check_vocab(tgt, tgt, tmp_path / "vocab")


def test_weights_that_do_not_fit_the_config_are_refused(model_file, tmp_path):
    ckpt = checkpoints.load(model_file)
    ckpt["model_config"] = ckpt["model_config"] | {"d_ff": 64}
    checkpoints.save(tmp_path / "bad.pt", ckpt)
    with pytest.raises(DataError, match="do not fit the model config"):
        Translator(tmp_path / "bad.pt", device="cpu")


def _other_model_file(model_file: Path, path: Path, tgt=None, seed: int = 1) -> Path:
    """model_file's config and vocabularies (or `tgt` as the target one) with other weights."""
    ckpt = checkpoints.load(model_file)
    if tgt is not None:
        ckpt["vocab"]["tgt"], ckpt["model_config"] = tgt.state(), ckpt["model_config"] | {"tgt_vocab": len(tgt)}
    torch.manual_seed(seed)
    ckpt["model"] = make_model(**ckpt["model_config"]).state_dict()
    checkpoints.save(path, ckpt)
    return path


def test_a_file_ensembled_with_itself_translates_as_the_file(model_file):
    from transformer.decoding.search import Ensemble

    alone = Translator(model_file, device="cpu")
    twice = Translator([model_file, model_file], device="cpu")
    assert isinstance(twice.model, Ensemble) and len(twice.model.models) == 2
    found, expected = (t.translate(SRC_LINES, t.search(beam=3), return_scores=True) for t in (twice, alone))
    assert [text for text, _ in found] == [text for text, _ in expected]
    assert [score for _, score in found] == pytest.approx([score for _, score in expected], abs=1e-4)


def test_an_ensemble_scores_by_the_mean_of_its_members_probabilities(model_file, tmp_path):
    from transformer.decoding.search import beam_search_nbest

    other = _other_model_file(model_file, tmp_path / "other.pt")
    members = [Translator(f, device="cpu").model for f in (model_file, other)]
    ensemble = Translator([model_file, other], device="cpu")
    src = torch.tensor([ensemble.src_vocab.encode(SRC_LINES[1]) + [EOS]])
    best = beam_search_nbest(
        ensemble.model, src, beam=2, alpha=0.6, max_len=torch.tensor([6]), bos=BOS, eos=EOS, nbest=1
    )[0][0]
    tokens = best.tokens + ([EOS] if len(best.tokens) < 6 else [])
    per_member = []  # each member's log-probability of the ensemble's best hypothesis, token by token
    with torch.no_grad():
        for model in members:
            state = model.start(src)
            per_member.append(
                torch.stack(
                    [model.step(state, torch.tensor([last]))[0, t] for last, t in zip([BOS] + tokens[:-1], tokens)]
                )
            )
    mean = torch.logsumexp(torch.stack(per_member), 0) - math.log(2)
    assert best.log_prob == pytest.approx(float(mean.sum()), abs=1e-4)
    assert all(abs(float(p.sum()) - best.log_prob) > 1e-3 for p in per_member)  # neither member alone


def test_an_ensemble_member_with_another_vocabulary_is_refused(model_file, tmp_path):
    other_tgt = WordVocab.build(TGT_LINES + ["a cat"], min_freq=1)
    other = _other_model_file(model_file, tmp_path / "other.pt", tgt=other_tgt)
    with pytest.raises(DataError, match="target vocabulary") as e:
        Translator([model_file, other], device="cpu")
    assert str(other) in str(e.value)
    with pytest.raises(ValueError, match="no model file"):
        Translator([], device="cpu")


# `transformer translate` as a new user tries it: in-process (click's runner), with the model above.


def _cli(model_file, *args, input=None):
    from click.testing import CliRunner

    from transformer.cli import main

    return CliRunner().invoke(main, ["translate", "--model", str(model_file), "--beam", "2", *args], input=input)


def _one_error_line(result, *needles):
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    for needle in needles:
        assert needle in lines[0]
    assert result.stdout == ""


def test_cli_latin1_input_names_the_file_and_line(model_file, tmp_path):
    source = tmp_path / "latin1.de"
    source.write_bytes(b"ein Hund\n" + "Stra\xdfe f\xfcr M\xe4nner\n".encode("latin-1"))
    _one_error_line(_cli(model_file, "--input", str(source)), f"{source}:2:", "UTF-8")


def test_cli_text_file_as_model_is_not_a_model_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("these are not weights\n")
    _one_error_line(_cli(text, input="ein Hund\n"), str(text), "not a model file of this project")


@pytest.mark.parametrize(
    "option", [["--beam", "0"], ["--alpha", "-1"], ["--nbest", "0"], ["--top-p", "0"], ["--temperature", "0"]]
)
def test_cli_out_of_range_search_options_are_usage_errors(model_file, option):
    result = _cli(model_file, *option, input="ein Hund\n")
    assert result.exit_code == 2 and option[0] in result.stderr and result.stdout == ""


def test_cli_missing_input_file_is_a_usage_error(model_file, tmp_path):
    result = _cli(model_file, "--input", str(tmp_path / "absent.de"))
    assert result.exit_code == 2 and "absent.de" in result.stderr


def test_cli_empty_blank_emoji_and_cjk_lines_keep_their_places(model_file, tmp_path):
    assert _cli(model_file, input="").stdout == ""
    result = _cli(model_file, input="ein Hund\n\n   \n🐕 läuft 🐈\n狗在跑\n")
    assert result.exit_code == 0, result.output
    out = result.stdout.split("\n")
    assert len(out) == 6 and out[-1] == "" and out[1] == out[2] == ""
    assert out[0] != ""  # the model's own words: an untrained model may end at once on unknown ones
    translator = Translator(model_file, device="cpu")
    assert out[:5] == translator.translate(["ein Hund", "", "", "🐕 läuft 🐈", "狗在跑"], translator.search(beam=2))


def test_cli_model_given_twice_translates_as_an_ensemble(model_file, tmp_path):
    other = _other_model_file(model_file, tmp_path / "other.pt")
    result = _cli(model_file, "--model", str(other), input="ein Hund\nzwei Männer\n")
    assert result.exit_code == 0, result.output
    ensemble = Translator([model_file, other], device="cpu")
    assert result.stdout.splitlines() == ensemble.translate(["ein Hund", "zwei Männer"], ensemble.search(beam=2))


def test_cli_long_source_is_bounded_and_warned_about(model_file, never_ending_file):
    params = checkpoints.load(model_file)["params"]
    longest, extra = params["tokenize"]["max_len"], params["decode"]["max_len_extra"]
    result = _cli(never_ending_file, input="ein Hund\n" + " ".join(["Hund"] * (4 * longest)) + "\n")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 2
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "line 2" in warning[0] and f"tokenize.max_len = {longest}" in warning[0]
    # a translation that never ends stops as its first tokenize.max_len tokens' would: those, </s> and extra ...
    assert len(result.stdout.splitlines()[1].split()) == longest + 1 + extra
    # ... where a source of the training's longest length runs unbounded and unwarned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        translator = Translator(model_file, device="cpu")
        translator.translate([" ".join(["Hund"] * longest)], translator.search(beam=1, max_len_extra=0))


def test_importing_the_package_stays_light_and_translator_loads_on_first_use():
    import subprocess
    import sys

    code = (
        "import sys, transformer; assert 'torch' not in sys.modules, 'torch imported'; "
        "from transformer import Translator; assert 'torch' in sys.modules; print(Translator.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "transformer.decoding.translate"
