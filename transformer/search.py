"""Decoding (section 6.1): greedy and batched beam search with cached keys and values.

Both drive any model with `start(src) -> state`, `step(state, last) -> log_probs` and
`state.select(index)`, so tests can script the probabilities by hand."""

from __future__ import annotations

import torch


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha."""
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def greedy(model, src: torch.Tensor, max_len: torch.Tensor, bos: int, eos: int) -> list[list[int]]:
    """The most probable next token at each step; finished sentences leave the batch."""
    state = model.start(src)
    out: list[list[int]] = [[] for _ in range(src.size(0))]
    alive = torch.arange(src.size(0), device=src.device)  # sentence of each row
    last = torch.full_like(alive, bos)
    tokens = torch.empty(len(alive), 0, dtype=torch.long, device=src.device)
    for t in range(1, int(max_len.max()) + 1):
        last = model.step(state, last).argmax(-1)
        tokens = torch.cat([tokens, last[:, None]], 1)
        done = (last == eos) | (max_len[alive] <= t)
        if done.any():
            for row in done.nonzero().flatten().tolist():
                seq = tokens[row].tolist()
                out[alive[row]] = seq[:-1] if seq[-1] == eos else seq
            keep = (~done).nonzero().flatten()
            if len(keep) == 0:
                break
            state, alive, last, tokens = state.select(keep), alive[keep], last[keep], tokens[keep]
    return out


@torch.no_grad()
def beam_search(model, src: torch.Tensor, beam: int, alpha: float, max_len: torch.Tensor, bos: int, eos: int) -> list[list[int]]:
    """Batched beam search. Each step expands every live hypothesis, keeps the 2K best
    continuations per sentence, finishes those ending in EOS among the top K, and carries
    the K best others on. A sentence is done with K finished hypotheses or at its max
    length; the best finished hypothesis by score / lp(length) is returned."""
    if beam == 1:
        return greedy(model, src, max_len, bos, eos)
    B, K, device = src.size(0), beam, src.device
    state = model.start(src).select(torch.arange(B, device=device).repeat_interleave(K))  # encode once, K copies
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # the K copies start identical: expand only the first
    tokens = torch.full((B * K, 1), bos, dtype=torch.long, device=device)
    alive = torch.arange(B, device=device)  # sentence of each live block of K rows
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    for t in range(1, int(max_len.max()) + 1):
        n = len(alive)
        log_probs = model.step(state, tokens[:, -1]).view(n, K, -1)  # (n, K, V)
        V = log_probs.size(-1)
        top, index = (scores[:, :, None] + log_probs).view(n, K * V).topk(min(2 * K, K * V), dim=1)  # (n, 2K)
        origin, token = index // V, index % V
        is_eos = token == eos
        _finish_eos(finished, alive, tokens, top, origin, is_eos, K, t, alpha)
        # The K best continuations that do not end here; EOS candidates sort last.
        rank = torch.arange(top.size(1), device=device).expand_as(top) + is_eos * top.size(1)
        pick = rank.argsort(dim=1)[:, :K]  # (n, K)
        scores, origin, token = top.gather(1, pick), origin.gather(1, pick), token.gather(1, pick)
        rows = (torch.arange(n, device=device)[:, None] * K + origin).flatten()
        tokens = torch.cat([tokens[rows], token.flatten()[:, None]], 1)
        done = _finish_long(finished, alive, tokens, scores, max_len, K, t, alpha)
        keep = (~done).nonzero().flatten()
        if len(keep) == 0:
            break
        keep_rows = (keep[:, None] * K + torch.arange(K, device=device)).flatten()
        state = state.select(rows[keep_rows])
        tokens, scores, alive = tokens[keep_rows], scores[keep], alive[keep]
    return [max(hyps, key=lambda h: h[0])[1] for hyps in finished]


def _finish_eos(finished, alive, tokens, top, origin, is_eos, K, t, alpha) -> None:
    """Hypotheses whose EOS ranks among the top K of their sentence are complete."""
    for i, j in (is_eos[:, :K] & torch.isfinite(top[:, :K])).nonzero().tolist():
        hyps = finished[alive[i]]
        if len(hyps) < K:
            seq = tokens[i * K + origin[i, j]].tolist()[1:]
            hyps.append((float(top[i, j]) / length_penalty(t, alpha), seq))


def _finish_long(finished, alive, tokens, scores, max_len, K, t, alpha) -> torch.Tensor:
    """Marks sentences done: K finished hypotheses, or max length reached (live ones are finished as they are)."""
    done = torch.tensor([len(finished[s]) >= K for s in alive.tolist()], device=alive.device)
    at_limit = (max_len[alive] <= t) & ~done
    for i in at_limit.nonzero().flatten().tolist():
        for j in range(K):
            if torch.isfinite(scores[i, j]):
                finished[alive[i]].append((float(scores[i, j]) / length_penalty(t, alpha), tokens[i * K + j].tolist()[1:]))
    return done | at_limit
