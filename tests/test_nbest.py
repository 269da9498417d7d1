"""n-best lists with scores: from beam search, through the Python API and the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_search import BOS, EOS, GREEDY_TRAP, PAD, A, B, C, ScriptedDecoder, _max_len, _random_model, _src
from test_translate import SRC_LINES, model_file  # noqa: F401 (a fixture)

from transformer import Translator, checkpoints
from transformer.cli import main
from transformer.data.vocab import BOS as BOS_ID
from transformer.data.vocab import PAD as PAD_ID
from transformer.data.vocab import UNK as UNK_ID
from transformer.decoding.search import beam_search, beam_search_nbest, forced
from transformer.io import DataError


def test_nbest_lists_the_finished_hypotheses_best_first_with_their_log_probabilities():
    # GREEDY_TRAP: B C </s> (P = 0.4 * 0.9) and A A </s> (0.6 * 0.4) both finish at step 3.
    out = beam_search_nbest(ScriptedDecoder(GREEDY_TRAP), _src(1), 2, 0.0, _max_len(10), BOS, EOS, nbest=2)
    assert [h.tokens for h in out[0]] == [[B, C], [A, A]]
    assert [h.log_prob for h in out[0]] == pytest.approx([math.log(0.36), math.log(0.24)], rel=1e-3)


def test_nbest_above_the_beam_size_is_refused():
    with pytest.raises(ValueError, match="beam size"):
        beam_search_nbest(ScriptedDecoder(GREEDY_TRAP), _src(1), 2, 0.0, _max_len(10), BOS, EOS, nbest=3)


@pytest.mark.parametrize("beam", [1, 3])
def test_nbest_first_is_beam_searchs_answer_and_scores_are_the_models_log_probabilities(beam):
    model, g = _random_model(), torch.Generator().manual_seed(1)
    sentences = [torch.cat([torch.randint(4, 14, (n,), generator=g), torch.tensor([EOS])]) for n in (5, 2, 8)]
    src = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True, padding_value=PAD)
    max_len = torch.tensor([len(s) + 3 for s in sentences])
    found = beam_search_nbest(model, src, beam, 0.6, max_len, BOS, EOS, nbest=beam)
    assert [hyps[0].tokens for hyps in found] == beam_search(model, src, beam, 0.6, max_len, BOS, EOS)
    for i, hyps in enumerate(found):
        assert len(hyps) == beam and len({tuple(h.tokens) for h in hyps}) == beam
        for h in hyps:  # teacher-force the hypothesis (and its </s>, unless cut at max length)
            target = h.tokens + ([EOS] if len(h.tokens) < max_len[i] else [])
            tgt_in = torch.tensor([[BOS] + target[:-1]])
            with torch.no_grad():
                log_probs = torch.log_softmax(model.generator(model(src[i : i + 1], tgt_in)), -1)[0]
            expected = float(log_probs[torch.arange(len(target)), torch.tensor(target)].sum())
            assert h.log_prob == pytest.approx(expected, abs=1e-4)


def test_translator_nbest_returns_best_first_lists_whose_head_is_the_plain_translation(model_file):
    translator = Translator.load(model_file, device="cpu")
    plain = translator.translate(SRC_LINES, translator.search(beam=3, max_len_extra=3))
    lists = translator.translate(SRC_LINES, translator.search(beam=3, nbest=3, max_len_extra=3), return_scores=True)
    assert [hyps[0][0] for hyps in lists] == plain
    assert all(len(hyps) == 3 and all(isinstance(s, float) and s <= 0 for _, s in hyps) for hyps in lists)
    pairs = translator.translate(SRC_LINES, translator.search(beam=3, max_len_extra=3), return_scores=True)
    assert pairs == [hyps[0] for hyps in lists]


def test_cli_nbest_writes_one_json_line_per_hypothesis(model_file):
    runner = CliRunner()
    args = ["translate", "--model", str(model_file), "--beam", "3"]
    plain = runner.invoke(main, args, input="\n".join(SRC_LINES) + "\n")
    listed = runner.invoke(main, args + ["--nbest", "2"], input="\n".join(SRC_LINES) + "\n")
    assert plain.exit_code == 0 and listed.exit_code == 0, listed.output
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["line"], r["rank"]) for r in rows] == [(i, k) for i in range(1, 5) for k in (1, 2)]
    assert [r["translation"] for r in rows if r["rank"] == 1] == plain.stdout.splitlines()
    assert all(r["score"] <= 0 for r in rows)


def test_cli_scores_alone_write_one_json_line_per_sentence(model_file):
    result = CliRunner().invoke(
        main, ["translate", "--model", str(model_file), "--beam", "2", "--scores"], input="ein Hund\n\n"
    )
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["line"], r["rank"]) for r in rows] == [(1, 1), (2, 1)]
    assert rows[1] == {"line": 2, "rank": 1, "score": 0.0, "translation": ""}  # an empty line: nothing to score


def test_cli_nbest_above_beam_is_a_usage_error(model_file):
    result = CliRunner().invoke(
        main, ["translate", "--model", str(model_file), "--beam", "2", "--nbest", "3"], input="ein Hund\n"
    )
    assert result.exit_code == 2 and "--nbest" in result.output


@pytest.mark.parametrize("beam", [1, 3])
def test_forced_decoding_of_the_searchs_own_hypotheses_gives_its_log_probabilities(beam):
    model, g = _random_model(), torch.Generator().manual_seed(2)
    sentences = [torch.cat([torch.randint(4, 14, (n,), generator=g), torch.tensor([EOS])]) for n in (5, 2, 8, 3)]
    src = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True, padding_value=PAD)
    max_len = torch.tensor([len(s) + 20 for s in sentences])
    found = beam_search_nbest(model, src, beam, 2.0, max_len, BOS, EOS, nbest=beam)  # a strong length penalty
    compared = 0
    for k in range(beam):  # the k-th best of every sentence, forced in one batch
        targets = [hyps[k].tokens for hyps in found]
        forced_scores = forced(model, src, targets, BOS, EOS)
        for i, hyps in enumerate(found):
            if len(hyps[k].tokens) < max_len[i]:  # ended in </s>, not cut at the length bound
                assert forced_scores[i] == pytest.approx(hyps[k].log_prob, abs=1e-4), (beam, k, i)
                compared += 1
    assert compared >= 2 * beam


def test_forced_decoding_scores_every_token_of_a_scripted_decoder():
    # GREEDY_TRAP scripts B C </s> at 0.4 * 0.9 * P(</s>) and A A </s> at 0.6 * 0.4 * P(</s>).
    found = beam_search_nbest(ScriptedDecoder(GREEDY_TRAP), _src(1), 2, 0.0, _max_len(10), BOS, EOS, nbest=2)
    for h in found[0]:
        (score,) = forced(ScriptedDecoder(GREEDY_TRAP), _src(1), [h.tokens], BOS, EOS)
        assert score == pytest.approx(h.log_prob, abs=1e-6)
    (worse,) = forced(ScriptedDecoder(GREEDY_TRAP), _src(1), [[C, C]], BOS, EOS)
    assert worse < min(h.log_prob for h in found[0])  # an output the script gives the floor probability


@pytest.fixture(scope="module")
def wordy_file(model_file, tmp_path_factory) -> Path:
    """The tiny model changed so that it never chooses <s>, <blank> or <unk>, which a translation's text
    leaves out: each token of its output is a word of the text or the </s> that ends it. never_ending's
    change, with </s> given a logit of about 0.05 × d_model instead, so that beam search ends some
    hypotheses in it within the bound and cuts others there."""
    ckpt = checkpoints.load(model_file)
    ckpt["model"]["decoder.norm.bias"] = torch.ones_like(ckpt["model"]["decoder.norm.bias"])
    ckpt["model"]["generator.weight"][[BOS_ID, PAD_ID, UNK_ID]] = -1.0
    ckpt["model"]["generator.weight"][EOS] = 0.05
    path = tmp_path_factory.mktemp("wordy") / "model.pt"
    checkpoints.save(path, ckpt)
    return path


def test_translator_score_gives_each_translation_the_score_translate_gave_it(wordy_file):
    translator, extra = Translator.load(wordy_file, device="cpu"), 4
    lists = translator.translate(SRC_LINES, translator.search(beam=4, nbest=4, max_len_extra=extra), return_scores=True)
    # the hypotheses that ended in </s>, shorter than the bound (the source's words, its </s>, extra)
    ended = [
        (source, text, score)
        for source, hyps in zip(SRC_LINES, lists)
        for text, score in hyps
        if len(text.split()) < len(source.split()) + 1 + extra
    ]
    assert 4 <= len(ended) < 16, lists  # some ended, some were cut
    sources, texts, scores = zip(*ended)
    scored = translator.score(list(sources), list(texts), batch_tokens=8)  # several batches
    assert [s.score for s in scored] == pytest.approx(list(scores), abs=1e-4)
    assert [s.tokens for s in scored] == [len(text.split()) + 1 for text in texts]  # words and </s>


def test_cli_score_model_prints_a_score_a_line_and_the_total_per_token(wordy_file, tmp_path):
    translator = Translator.load(wordy_file, device="cpu")
    targets = ["a dog runs", "two men play football", "", "a child"]
    sources = SRC_LINES[:2] + [SRC_LINES[2], SRC_LINES[3]]
    (tmp_path / "src.de").write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    (tmp_path / "tgt.en").write_text("".join(t + "\n" for t in targets), encoding="utf-8")
    args = ["score-model", "--model", str(wordy_file), "--source", str(tmp_path / "src.de")]
    result = CliRunner().invoke(main, args + ["--target", str(tmp_path / "tgt.en")])
    assert result.exit_code == 0, result.output
    expected = translator.score(sources, targets)
    assert [float(x) for x in result.stdout.splitlines()] == pytest.approx([s.score for s in expected], abs=1e-4)
    total, tokens = sum(s.score for s in expected), 3 + 4 + 0 + 2 + 4  # words, and a </s> a line
    assert f"total {total:.4f} over {tokens} tokens, {total / tokens:.4f} per token" in result.stderr
    assert expected[2].score < 0  # an empty translation of a sentence still has its </s> to score


@pytest.mark.parametrize(
    "source, target, says",
    [
        ("ein Hund\nein Kind\n", "a dog\n", "{tgt}: has 1 lines but the source {src} has 2"),
        ("ein Hund\n\n", "a dog\na child\n", "{src}, {tgt}: line 2: an empty source"),
    ],
    ids=["different lengths, naming both", "a translation of an empty line"],
)
def test_cli_score_model_refuses_pairs_it_cannot_score(model_file, tmp_path, source, target, says):
    src, tgt = tmp_path / "src.de", tmp_path / "tgt.en"
    src.write_text(source, encoding="utf-8")
    tgt.write_text(target, encoding="utf-8")
    args = ["score-model", "--model", str(model_file), "--source", str(src), "--target", str(tgt)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and result.stdout == ""
    assert "error: " + says.format(src=src, tgt=tgt) in result.output


def test_translator_score_refuses_sources_and_targets_of_different_counts(model_file):
    with pytest.raises(DataError, match="2 sources but 1 targets"):
        Translator.load(model_file, device="cpu").score(SRC_LINES[:2], ["a dog"])
