"""Sampling: draws follow the model's distribution (temperature, top-k, top-p), and a seed repeats them."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from test_search import BOS, EOS, A, B, ScriptedDecoder, _max_len, _random_model, _src
from test_translate import SRC_LINES, model_file  # noqa: F401 (a fixture)

from transformer import Translator
from transformer.cli import main
from transformer.decoding.search import greedy, sample

# First token A (0.75) or B (0.25), then the end.
COIN = {(): {A: 0.75, B: 0.25}, (A,): {EOS: 1.0}, (B,): {EOS: 1.0}}
DRAWS = 4000


def _share_of_a(**how) -> float:
    decoder = ScriptedDecoder(*[COIN] * DRAWS)
    hyps = sample(
        decoder, _src(DRAWS), _max_len(*[3] * DRAWS), BOS, EOS, generator=torch.Generator().manual_seed(0), **how
    )
    assert sum(h.tokens[:1] in ([A], [B]) for h in hyps) > 0.98 * DRAWS  # the script's floor lets a rare other through
    return sum(h.tokens[:1] == [A] for h in hyps) / DRAWS


def test_samples_follow_the_models_distribution():
    assert _share_of_a() == pytest.approx(0.75, abs=0.03)


def test_temperature_flattens_the_distribution():
    # At temperature 2, p ~ sqrt(P): 0.75^0.5 / (0.75^0.5 + 0.25^0.5) = 0.634.
    assert _share_of_a(temperature=2.0) == pytest.approx(0.634, abs=0.03)


def test_top_k_and_top_p_cut_the_tail():
    assert _share_of_a(top_k=1) == 1.0
    assert _share_of_a(top_p=0.7) == 1.0  # A alone holds 0.75 >= 0.7
    assert _share_of_a(top_p=0.8) < 1.0  # A is not enough: B stays in


def test_sampling_with_top_k_one_is_greedy():
    model, g = _random_model(), torch.Generator().manual_seed(1)
    src = torch.randint(4, 14, (4, 6), generator=g)
    max_len = _max_len(9, 9, 9, 9)
    drawn = sample(model, src, max_len, BOS, EOS, top_k=1, generator=torch.Generator().manual_seed(5))
    assert [h.tokens for h in drawn] == greedy(model, src, max_len, BOS, EOS)


def test_seeded_sampling_is_reproducible_and_the_seed_matters(model_file):
    translator = Translator.load(model_file, device="cpu")

    def draw(seed: int) -> list[str]:
        return translator.translate(SRC_LINES * 3, translator.search(sample=True, seed=seed, max_len_extra=4))

    first = draw(1)
    assert draw(1) == first
    assert draw(2) != first
    greedy_search = translator.search(beam=1, max_len_extra=4)
    assert first != translator.translate(SRC_LINES * 3, greedy_search)  # not greedy in disguise


def test_nbest_samples_come_sorted_by_score(model_file):
    translator = Translator.load(model_file, device="cpu")
    sampling = translator.search(sample=True, nbest=4, seed=3, max_len_extra=4)
    lists = translator.translate(SRC_LINES, sampling, return_scores=True)
    assert all(len(hyps) == 4 for hyps in lists)
    for hyps in lists:
        scores = [s for _, s in hyps]
        assert scores == sorted(scores, reverse=True)


def test_cli_seeded_sample_repeats(model_file):
    args = ["translate", "--model", str(model_file), "--sample", "--seed", "7", "--top-p", "0.9"]
    text = "\n".join(SRC_LINES) + "\n"
    runs = [CliRunner().invoke(main, args, input=text) for _ in range(2)]
    assert runs[0].exit_code == 0, runs[0].output
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout.splitlines()) == len(SRC_LINES)
