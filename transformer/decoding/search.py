"""Decoding (section 6.1): greedy, sampling and batched beam search with cached keys and values.

All drive any model with `start(src, beam) -> state` (beam consecutive rows per sentence),
`step(state, last) -> log_probs` and `state.select(index)`, so tests can script the
probabilities by hand."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha."""
    return ((5 + length) / 6) ** alpha


@dataclass(frozen=True)
class Hypothesis:
    """A translation in token ids (no `<s>`, no `</s>`) and log P(tokens | source), summed over its
    tokens and the `</s>` that ended it (if one did)."""

    tokens: list[int]
    log_prob: float


class Ensemble:
    """Several models searching as one: the next token's probability is the mean of theirs.
    They must share the vocabularies; each keeps its own decoding state."""

    def __init__(self, models: Sequence):
        if not models:
            raise ValueError("an ensemble needs at least one model")
        self.models = list(models)

    def start(self, src: torch.Tensor, beam: int = 1) -> EnsembleState:
        return EnsembleState([m.start(src, beam=beam) for m in self.models])

    def step(self, state: EnsembleState, last: torch.Tensor) -> torch.Tensor:
        log_probs = torch.stack([m.step(s, last) for m, s in zip(self.models, state.members)])  # (M, B, V)
        return torch.logsumexp(log_probs, 0) - math.log(len(self.models))


@dataclass
class EnsembleState:
    members: list  # each model's decoding state

    def select(self, index: torch.Tensor) -> EnsembleState:
        return EnsembleState([s.select(index) for s in self.members])


def greedy(model, src: torch.Tensor, max_len: torch.Tensor, bos: int, eos: int) -> list[list[int]]:
    """The most probable next token at each step; finished sentences leave the batch."""
    return [h.tokens for h in one_path(model, src, max_len, bos, eos, lambda log_probs: log_probs.argmax(-1))]


def sample(
    model,
    src: torch.Tensor,
    max_len: torch.Tensor,
    bos: int,
    eos: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Hypothesis]:
    """Ancestral sampling: each next token drawn from the model's distribution, sharpened or
    flattened by `temperature` and cut to the `top_k` most probable tokens and to the smallest
    set holding `top_p` of the mass (nucleus sampling). 0 and 1.0 switch either cut off."""

    def choose(log_probs: torch.Tensor) -> torch.Tensor:
        logits = log_probs / temperature  # (B, V)
        if 0 < top_k < logits.size(-1):
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            ranked, order = logits.sort(dim=-1, descending=True)
            probs = ranked.softmax(-1)
            beyond = probs.cumsum(-1) - probs >= top_p  # the mass before a token already reaches top_p
            logits = logits.scatter(-1, order, ranked.masked_fill(beyond, float("-inf")))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)

    return one_path(model, src, max_len, bos, eos, choose)


@torch.no_grad()
def one_path(
    model, src: torch.Tensor, max_len: torch.Tensor, bos: int, eos: int, choose: Callable[[torch.Tensor], torch.Tensor]
) -> list[Hypothesis]:
    """One hypothesis per sentence, extended by `choose(log_probs) -> next tokens` (greedy, sampling)."""
    state = model.start(src)
    out: list[Hypothesis] = [Hypothesis([], 0.0)] * src.size(0)
    alive = torch.arange(src.size(0), device=src.device)  # sentence of each row
    last = torch.full_like(alive, bos)
    tokens = torch.empty(len(alive), 0, dtype=torch.long, device=src.device)
    total = torch.zeros(len(alive), device=src.device)  # log-probability so far
    for t in range(1, int(max_len.max()) + 1):
        log_probs = model.step(state, last)
        last = choose(log_probs)
        total = total + log_probs.gather(1, last[:, None]).squeeze(1)
        tokens = torch.cat([tokens, last[:, None]], 1)
        done = (last == eos) | (max_len[alive] <= t)
        if done.any():
            for row in done.nonzero().flatten().tolist():
                seq = tokens[row].tolist()
                out[alive[row]] = Hypothesis(seq[:-1] if seq[-1] == eos else seq, float(total[row]))
            keep = (~done).nonzero().flatten()
            if len(keep) == 0:
                break
            state, alive, last, tokens, total = state.select(keep), alive[keep], last[keep], tokens[keep], total[keep]
    return out


@torch.no_grad()
def forced(model, src: torch.Tensor, targets: list[list[int]], bos: int, eos: int) -> list[float]:
    """log P(target | source) of given outputs (ids without <s> and </s>), summed over their tokens and the
    </s> after them: the log_prob a search reports for that output when it ends in </s>. The targets go
    through start and step a token at a time, as a search feeds its own choices, so an ensemble scores
    as it searches."""
    state = model.start(src)
    rows = len(targets)
    gold = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor([*t, eos]) for t in targets], batch_first=True, padding_value=eos
    ).to(src.device)  # (B, T + 1)
    last_position = torch.tensor([len(t) for t in targets], device=src.device)  # where each </s> is
    total = torch.zeros(rows, device=src.device)
    last = torch.full((rows,), bos, device=src.device)
    for t in range(gold.size(1)):
        picked = model.step(state, last).gather(1, gold[:, t : t + 1]).squeeze(1)  # (B,)
        total = total + torch.where(t <= last_position, picked, 0.0)
        last = gold[:, t]
    return total.tolist()


def beam_search(
    model, src: torch.Tensor, beam: int, alpha: float, max_len: torch.Tensor, bos: int, eos: int
) -> list[list[int]]:
    """The best hypothesis of each sentence by log P / lp(length); beam 1 is greedy."""
    if beam == 1:
        return greedy(model, src, max_len, bos, eos)
    return [max(hyps, key=lambda h: h[0])[2] for hyps in _beam(model, src, beam, alpha, max_len, bos=bos, eos=eos)]


def beam_search_nbest(
    model, src: torch.Tensor, beam: int, alpha: float, max_len: torch.Tensor, bos: int, eos: int, nbest: int
) -> list[list[Hypothesis]]:
    """The `nbest` (<= beam) best hypotheses of each sentence, best first, ranked as beam_search ranks them."""
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest = {nbest} must be between 1 and the beam size ({beam})")
    if beam == 1:
        return [[h] for h in one_path(model, src, max_len, bos, eos, lambda log_probs: log_probs.argmax(-1))]
    finished = _beam(model, src, beam, alpha, max_len, bos=bos, eos=eos)
    return [[Hypothesis(seq, raw) for _, raw, seq in sorted(hyps, key=lambda h: -h[0])[:nbest]] for hyps in finished]


@torch.no_grad()
def _beam(
    model, src: torch.Tensor, beam: int, alpha: float, max_len: torch.Tensor, *, bos: int, eos: int
) -> list[list[tuple]]:
    """Batched beam search. Each step expands every live hypothesis, keeps the 2K best
    continuations per sentence, finishes those ending in EOS among the top K, and carries
    the K best others on. A sentence is done with K finished hypotheses or at its max
    length. Returns each sentence's finished (log P / lp(length), log P, tokens), in finishing order."""
    B, K, device = src.size(0), beam, src.device
    state = model.start(src, beam=K)  # encoded once, K rows per sentence
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # the K copies start identical: expand only the first
    tokens = torch.full((B * K, 1), bos, dtype=torch.long, device=device)
    alive = torch.arange(B, device=device)  # sentence of each live block of K rows
    finished: list[list[tuple[float, float, list[int]]]] = [[] for _ in range(B)]
    for t in range(1, int(max_len.max()) + 1):
        n = len(alive)
        log_probs = model.step(state, tokens[:, -1]).view(n, K, -1)  # (n, K, V)
        V = log_probs.size(-1)
        top, index = (scores[:, :, None] + log_probs).view(n, K * V).topk(min(2 * K, K * V), dim=1)  # (n, 2K)
        origin, token = index // V, index % V
        is_eos = token == eos
        _finish_eos(finished, alive, tokens, top=top, origin=origin, is_eos=is_eos, K=K, t=t, alpha=alpha)
        # The K best continuations that do not end here; EOS candidates sort last.
        rank = torch.arange(top.size(1), device=device).expand_as(top) + is_eos * top.size(1)
        pick = rank.argsort(dim=1)[:, :K]  # (n, K)
        scores, origin, token = top.gather(1, pick), origin.gather(1, pick), token.gather(1, pick)
        rows = (torch.arange(n, device=device)[:, None] * K + origin).flatten()
        tokens = torch.cat([tokens[rows], token.flatten()[:, None]], 1)
        done = _finish_long(finished, alive, tokens, scores=scores, max_len=max_len, K=K, t=t, alpha=alpha)
        keep = (~done).nonzero().flatten()
        if len(keep) == 0:
            break
        keep_rows = (keep[:, None] * K + torch.arange(K, device=device)).flatten()
        state = state.select(rows[keep_rows])
        tokens, scores, alive = tokens[keep_rows], scores[keep], alive[keep]
    return finished


def _finish_eos(finished, alive, tokens, *, top, origin, is_eos, K, t, alpha) -> None:
    """Hypotheses whose EOS ranks among the top K of their sentence are complete."""
    for i, j in (is_eos[:, :K] & torch.isfinite(top[:, :K])).nonzero().tolist():
        hyps = finished[alive[i]]
        if len(hyps) < K:
            seq = tokens[i * K + origin[i, j]].tolist()[1:]
            hyps.append((float(top[i, j]) / length_penalty(t, alpha), float(top[i, j]), seq))


def _finish_long(finished, alive, tokens, *, scores, max_len, K, t, alpha) -> torch.Tensor:
    """Marks sentences done: K finished hypotheses, or max length reached (live ones are finished as they are)."""
    done = torch.tensor([len(finished[s]) >= K for s in alive.tolist()], device=alive.device)
    at_limit = (max_len[alive] <= t) & ~done
    for i in at_limit.nonzero().flatten().tolist():
        for j in range(K):
            if torch.isfinite(scores[i, j]):
                raw = float(scores[i, j])
                finished[alive[i]].append((raw / length_penalty(t, alpha), raw, tokens[i * K + j].tolist()[1:]))
    return done | at_limit
