"""Greedy and beam search against a scripted decoder whose probabilities are written by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

from transformer.decoding.search import Ensemble, beam_search, greedy, length_penalty

BOS, EOS, PAD, A, B, C = range(6)
V = 6
FLOOR = 1e-4  # probability of every token a script does not name...
EOS_FLOOR = 1e-9  # ...but </s>: an unscripted end must never outrank a scripted hypothesis


class ScriptedState:
    """Each row remembers its sentence and the tokens it has produced after <s>."""

    def __init__(self, sentence: list[int], prefix: list[tuple[int, ...]]):
        self.sentence, self.prefix = sentence, prefix

    def select(self, index: torch.Tensor) -> ScriptedState:
        rows = index.tolist()
        return ScriptedState([self.sentence[r] for r in rows], [self.prefix[r] for r in rows])


class ScriptedDecoder:
    """scripts[sentence][prefix] = {token: probability}. An unscripted prefix never ends:
    it spreads its mass over A, B, C (so junk hypotheses do not finish early)."""

    def __init__(self, *scripts: dict[tuple[int, ...], dict[int, float]]):
        self.scripts = scripts
        self.calls = 0

    def start(self, src: torch.Tensor, beam: int = 1) -> ScriptedState:
        assert src.size(0) == len(self.scripts)
        sentences = [s for s in range(src.size(0)) for _ in range(beam)]
        return ScriptedState(sentences, [() for _ in sentences])

    def step(self, state: ScriptedState, last: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rows = []
        for r, token in enumerate(last.tolist()):
            if token != BOS:
                state.prefix[r] = state.prefix[r] + (token,)
            dist = self.scripts[state.sentence[r]].get(state.prefix[r], {A: 1 / 3, B: 1 / 3, C: 1 / 3})
            probs = torch.full((V,), FLOOR, dtype=torch.float64)
            probs[EOS] = EOS_FLOOR
            for t, p in dist.items():
                probs[t] = p
            probs[BOS] = probs[PAD] = 0.0
            rows.append((probs / probs.sum()).log().float())
        return torch.stack(rows)


# Greedy takes A (0.6), then A (0.4), then must stop: P = 0.24. The best sentence is B C: P = 0.36.
GREEDY_TRAP = {
    (): {A: 0.6, B: 0.4},
    (A,): {A: 0.4, C: 0.3, EOS: 0.3},
    (A, A): {EOS: 1.0},
    (A, C): {EOS: 1.0},
    (B,): {C: 0.9, EOS: 0.1},
    (B, C): {EOS: 1.0},
}

# "A" ends at once (P = 0.5); "B C C C" is less probable (0.45) but longer.
SHORT_OR_LONG = {
    (): {A: 0.5, B: 0.45},
    (A,): {EOS: 1.0},
    (B,): {C: 1.0},
    (B, C): {C: 1.0},
    (B, C, C): {C: 1.0},
    (B, C, C, C): {EOS: 1.0},
}

NEVER_ENDS = {}  # every prefix unscripted: EOS only at the floor

# Beam 2: A </s> (0.3) finishes at step 2 and A C </s> (0.1) at step 3, both ranking among the top 2 while
# B C C (0.48), the most probable, is still being written; it would end at step 4.
LATE_BEST = {
    (): {A: 0.4, B: 0.6},
    (A,): {EOS: 0.75, C: 0.25},
    (B,): {C: 0.8, EOS: 0.2},
    (A, C): {EOS: 1.0},
    (B, C): {C: 1.0},
    (B, C, C): {EOS: 1.0},
}


def _src(n: int) -> torch.Tensor:
    return torch.full((n, 3), 7)


def _max_len(*lengths: int) -> torch.Tensor:
    return torch.tensor(lengths)


def test_length_penalty_is_gnmts():
    assert length_penalty(7, 0.0) == 1.0
    assert length_penalty(1, 1.0) == pytest.approx(1.0)
    assert length_penalty(7, 1.0) == pytest.approx(2.0)
    assert length_penalty(13, 0.5) == pytest.approx(math.sqrt(3.0))


def test_greedy_takes_the_locally_best_token():
    assert greedy(ScriptedDecoder(GREEDY_TRAP), _src(1), _max_len(10), BOS, EOS) == [[A, A]]


def test_beam_search_finds_the_best_sentence_where_greedy_fails():
    out = beam_search(ScriptedDecoder(GREEDY_TRAP), _src(1), beam=2, alpha=0.0, max_len=_max_len(10), bos=BOS, eos=EOS)
    assert out == [[B, C]]


def test_beam_one_is_greedy():
    out = beam_search(ScriptedDecoder(GREEDY_TRAP), _src(1), beam=1, alpha=0.0, max_len=_max_len(10), bos=BOS, eos=EOS)
    assert out == [[A, A]]


def test_hypotheses_are_returned_without_bos_and_eos():
    for out in (
        greedy(ScriptedDecoder(SHORT_OR_LONG), _src(1), _max_len(10), BOS, EOS),
        beam_search(ScriptedDecoder(SHORT_OR_LONG), _src(1), 3, 0.0, _max_len(10), BOS, EOS),
    ):
        assert out == [[A]]


def test_search_stops_once_every_sentence_is_finished():
    decoder = ScriptedDecoder(GREEDY_TRAP)
    beam_search(decoder, _src(1), 2, 0.0, _max_len(50), BOS, EOS)
    assert decoder.calls == 3  # B C </s> and A A </s> finish at step 3; no step 4 is asked for
    decoder = ScriptedDecoder(GREEDY_TRAP)
    greedy(decoder, _src(1), _max_len(50), BOS, EOS)
    assert decoder.calls == 3


def test_a_sentence_ends_once_beam_hypotheses_have_finished():
    """fairseq's rule, kept because the exact one (go on while a live hypothesis could still win under the
    length penalty) finds runaway repetitions cut at the length limit that a large alpha rewards; its price
    is a best hypothesis still being written when `beam` others have finished, as here."""
    decoder = ScriptedDecoder(LATE_BEST)
    assert beam_search(decoder, _src(1), 2, 0.0, _max_len(10), BOS, EOS) == [[A]]
    assert decoder.calls == 3


@pytest.mark.parametrize("beam", [1, 2, 3])
def test_max_length_is_respected_per_sentence(beam):
    decoder = ScriptedDecoder(NEVER_ENDS, NEVER_ENDS)
    out = beam_search(decoder, _src(2), beam, 0.6, _max_len(3, 5), BOS, EOS)
    assert [len(h) for h in out] == [3, 5]
    assert all(EOS not in h for h in out)
    assert decoder.calls == 5


def test_length_penalty_alpha_changes_the_winner():
    # alpha = 0: log 0.5 > log 0.45, the short one wins. alpha = 2: log 0.5 / (7/6)^2 = -0.51
    # is worse than log 0.45 / (10/6)^2 = -0.29, the long one wins.
    def search(alpha):
        return beam_search(ScriptedDecoder(SHORT_OR_LONG), _src(1), 2, alpha, _max_len(8), BOS, EOS)

    assert search(0.0) == [[A]]
    assert search(2.0) == [[B, C, C, C]]


def test_batched_scripted_sentences_are_searched_independently():
    decoder = ScriptedDecoder(SHORT_OR_LONG, GREEDY_TRAP, NEVER_ENDS)
    out = beam_search(decoder, _src(3), 2, 2.0, _max_len(8, 8, 4), BOS, EOS)
    alone = beam_search(ScriptedDecoder(NEVER_ENDS), _src(1), 2, 2.0, _max_len(4), BOS, EOS)[0]
    assert out == [[B, C, C, C], [B, C], alone]  # the third searched alone: the same, whatever its ties picked
    assert len(alone) == 4 and set(alone) <= {A, B, C}
    decoder = ScriptedDecoder(GREEDY_TRAP, SHORT_OR_LONG, NEVER_ENDS)
    assert greedy(decoder, _src(3), _max_len(8, 8, 2), BOS, EOS)[:2] == [[A, A], [A]]


def test_eos_at_the_first_step_gives_an_empty_hypothesis():
    script = {(): {EOS: 0.9, A: 0.1}, (A,): {EOS: 1.0}}
    assert greedy(ScriptedDecoder(script), _src(1), _max_len(5), BOS, EOS) == [[]]
    assert beam_search(ScriptedDecoder(script), _src(1), 2, 0.0, _max_len(5), BOS, EOS) == [[]]


def _random_model():
    torch.manual_seed(0)
    return tiny_model(src_vocab=14, tgt_vocab=14).eval()


def _sentences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.cat([torch.randint(4, 14, (n,), generator=g), torch.tensor([EOS])]) for n in (5, 2, 8, 3)]


@pytest.mark.parametrize("beam", [1, 3])
def test_batched_search_equals_one_sentence_at_a_time(beam):
    model, sentences = _random_model(), _sentences()
    src = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True, padding_value=PAD)
    max_len = torch.tensor([len(s) + 4 for s in sentences])
    batched = beam_search(model, src, beam, 0.6, max_len, BOS, EOS)
    alone = [beam_search(model, s[None], beam, 0.6, max_len[i : i + 1], BOS, EOS)[0] for i, s in enumerate(sentences)]
    assert batched == alone
    assert len({tuple(h) for h in batched}) > 1  # the sentences get different translations
    assert all(len(h) <= m for h, m in zip(batched, max_len.tolist()))


# Members that disagree: the first prefers A A (0.6 x 0.4 ... as GREEDY_TRAP), the second B C strongly.
B_FIRST = {(): {A: 0.1, B: 0.9}, (A,): {EOS: 1.0}, (B,): {C: 0.9, EOS: 0.1}, (B, C): {EOS: 1.0}}


def test_an_ensemble_of_one_model_searches_as_the_model():
    for beam in (1, 2):
        alone = beam_search(ScriptedDecoder(GREEDY_TRAP), _src(1), beam, 0.0, _max_len(10), BOS, EOS)
        assert (
            beam_search(Ensemble([ScriptedDecoder(GREEDY_TRAP)]), _src(1), beam, 0.0, _max_len(10), BOS, EOS) == alone
        )


def test_an_ensemble_averages_its_members_probabilities():
    # First token: A (0.6 + 0.1) / 2 = 0.35, B (0.4 + 0.9) / 2 = 0.65: greedy now takes B, then C.
    ensemble = Ensemble([ScriptedDecoder(GREEDY_TRAP), ScriptedDecoder(B_FIRST)])
    assert greedy(ensemble, _src(1), _max_len(10), BOS, EOS) == [[B, C]]
    assert greedy(ScriptedDecoder(GREEDY_TRAP), _src(1), _max_len(10), BOS, EOS) == [[A, A]]
    state = ensemble.start(_src(1))
    log_probs = ensemble.step(state, torch.tensor([BOS]))
    assert log_probs.exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    assert log_probs[0, B].exp().item() == pytest.approx(0.65, abs=1e-3)


def test_an_ensemble_of_identical_models_translates_as_one():
    model, sentences = _random_model(), _sentences()
    src = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True, padding_value=PAD)
    max_len = torch.tensor([len(s) + 4 for s in sentences])
    assert beam_search(Ensemble([model, model]), src, 3, 0.6, max_len, BOS, EOS) == beam_search(
        model, src, 3, 0.6, max_len, BOS, EOS
    )


def test_an_ensemble_needs_a_model():
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble([])
