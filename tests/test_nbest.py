"""n-best lists with scores: from beam search, through the Python API and the command line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from test_search import BOS, EOS, GREEDY_TRAP, PAD, A, B, C, ScriptedDecoder, _max_len, _random_model, _src
from test_translate import SRC_LINES, model_file  # noqa: F401 (a fixture)

from transformer import Translator
from transformer.cli import main
from transformer.decoding.search import beam_search, beam_search_nbest


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
    plain = translator.translate(SRC_LINES, beam=3, max_len_extra=3)
    lists = translator.translate(SRC_LINES, beam=3, nbest=3, return_scores=True, max_len_extra=3)
    assert [hyps[0][0] for hyps in lists] == plain
    assert all(len(hyps) == 3 and all(isinstance(s, float) and s <= 0 for _, s in hyps) for hyps in lists)
    pairs = translator.translate(SRC_LINES, beam=3, return_scores=True, max_len_extra=3)
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
