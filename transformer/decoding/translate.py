"""From a model file to translations: tokenize, encode, batch by length, search, detokenize."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transformer.config import DecodeConfig
from transformer.data.tokenize import Tokenizer, detokenize
from transformer.data.vocab import BOS, EOS, PAD, fingerprint, model_vocabs
from transformer.decoding.search import Ensemble, Hypothesis, beam_search_nbest, forced
from transformer.decoding.search import sample as draw_samples
from transformer.io import DataError
from transformer.model.model import load_members


@dataclass(frozen=True)
class Translation:
    """A detokenized translation and its score (n-best lists rank beam search's way, by
    score / lp(length), so a longer hypothesis may rank above a shorter one with a higher score)."""

    text: str
    """The translation as raw text, detokenized."""
    score: float
    """log P(translation | source) under the model, in nats, summed over its tokens and the `</s>`
    that ended it."""


@dataclass(frozen=True)
class Scored:
    """A given translation's score under the model (log P(translation | source), in nats, as Translation's)
    and the tokens it sums over: the target's subwords and the </s> that ends it."""

    score: float
    tokens: int


@dataclass(frozen=True)
class Search:
    """How translations are searched for: the decode params (a params file's `decode` section) and
    what a caller may add, n-best lists and sampling. It is checked as it is made, where the settings
    come in (the decode params, the command line's options, a Python call), so the code that searches
    with it trusts every value. `Translator.search` makes one from the model's own decode params."""

    beam: int
    """The beam size (§6.1: 4); 1 is greedy search."""
    alpha: float
    """The length penalty's α: beam search ranks a hypothesis by log P / ((5 + length) / 6)^α (§6.1: 0.6)."""
    max_len_extra: int
    """A translation is at most its source's length plus this many tokens (§6.1: 50)."""
    batch_tokens: int
    """Source tokens times decoder rows per sentence (the beam, or the draws) in one batch: it bounds memory."""
    nbest: int = 1
    """The translations returned for each sentence, best first: at most the beam, or with sampling the draws."""
    sample: bool = False
    """Whether translations are drawn from the model's distribution instead of searched for (the beam unused)."""
    top_k: int = 0
    """Sampling draws from the k most probable next tokens; 0 keeps them all."""
    top_p: float = 1.0
    """Sampling draws from the smallest set of next tokens holding this much probability; 1.0 keeps them all."""
    temperature: float = 1.0
    """Sampling divides the log-probabilities by it: below 1 sharpens the distribution, above 1 flattens it."""
    seed: int | None = None
    """Sampling's random seed: the same lines, seed and batch_tokens draw the same translations."""

    def __post_init__(self) -> None:
        """A ValueError naming the first field out of range, as the command line's options refuse it."""
        checks = [
            (self.beam >= 1, f"beam = {self.beam} must be >= 1"),
            (self.alpha >= 0, f"alpha = {self.alpha} must be >= 0"),
            (self.nbest >= 1, f"nbest = {self.nbest} must be >= 1"),
            (self.sample or self.nbest <= self.beam, f"nbest = {self.nbest} exceeds the beam size ({self.beam})"),
            (self.top_k >= 0, f"top_k = {self.top_k} must be >= 0 (0: no cut)"),
            (0 < self.top_p <= 1, f"top_p = {self.top_p} must be in (0, 1]"),
            (self.temperature > 0, f"temperature = {self.temperature} must be > 0"),
            (self.max_len_extra >= 0, f"max_len_extra = {self.max_len_extra} must be >= 0"),
            (self.batch_tokens >= 1, f"batch_tokens = {self.batch_tokens} must be >= 1"),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(why)

    @classmethod
    def of(cls, decode: DecodeConfig | Mapping[str, Any], **changes: Any) -> Search:
        """The search a `decode` section describes, params.yaml's (a DecodeConfig) or a model file's (a
        dict), with `changes` to any of the fields: `Search.of(decode, beam=1)` is its greedy search."""
        values = decode if isinstance(decode, Mapping) else dataclasses.asdict(decode)
        return cls(**{name: values[name] for name in ("beam", "alpha", "max_len_extra", "batch_tokens")} | changes)

    @property
    def rows(self) -> int:
        """The decoder rows a sentence takes in a batch: a row for each hypothesis of the beam, or for each draw."""
        return self.nbest if self.sample else self.beam


class LongSourceWarning(UserWarning):
    """A source line longer than any the model was trained on: its translation is bounded shorter."""


class Translator:
    """Translates with one model file, or with several as an ensemble (their next-token probabilities
    averaged at every step of the search): checkpoints of one run, or runs trained on one vocabulary.
    A file of train.members > 1 is an ensemble by itself; its members join those of the other files.
    The first file's params give the tokenizer and the default search."""

    def __init__(self, model_path: Path | str | Sequence[Path | str], device: str | None = None):
        paths = [Path(model_path)] if isinstance(model_path, (str, Path)) else [Path(p) for p in model_path]
        if not paths:
            raise ValueError("no model file given")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        members, ckpt = load_members(paths[0], self.device)
        self.src_vocab, self.tgt_vocab = model_vocabs(ckpt)
        self.params = ckpt["params"]
        self.path = paths[0]
        self.tokens_out = 0
        for path in paths[1:]:
            more, other = load_members(path, self.device)
            self.check_vocab(*model_vocabs(other), path)
            members += more
        self.model = members[0] if len(members) == 1 else Ensemble(members)

    def check_vocab(self, src_vocab, tgt_vocab, where: Path) -> None:
        """Refuses a vocabulary other than the one the model was trained with."""
        for side, mine, theirs in (("source", self.src_vocab, src_vocab), ("target", self.tgt_vocab, tgt_vocab)):
            if fingerprint(mine) != fingerprint(theirs):
                raise DataError(
                    f"{where}: {side} vocabulary ({len(theirs)} entries, fingerprint {fingerprint(theirs)}) "
                    f"does not match the one {self.path} was trained with ({len(mine)}, {fingerprint(mine)}); "
                    f"rebuild the vocabulary or retrain"
                )

    @classmethod
    def load(cls, model_path: Path | str | Sequence[Path | str], device: str | None = None) -> Translator:
        """The model in `model_path` (averaged by the pipeline, or any checkpoint), or the ensemble of
        several such files, ready to translate."""
        return cls(model_path, device)

    def search(self, **changes: Any) -> Search:
        """The search the model's decode params describe (the first file's), with `changes` to any of
        Search's fields: `search(beam=1)` is greedy. A value out of range is a ValueError naming it."""
        return Search.of(self.params["decode"], **changes)

    def translate(
        self,
        raw_lines: list[str],
        search: Search | None = None,
        *,
        return_scores: bool = False,
        progress: bool = False,
        timeout: float | None = None,
    ) -> list:
        """Raw text in, raw text out. Each line's translation, or with search.nbest > 1 a list of them,
        best first; with return_scores, (text, score) pairs, score = log P(text | line) (see
        Translation). The search defaults to the model's decode params; `progress` and `timeout`
        are as hypotheses takes them."""
        search = self.search() if search is None else search
        found = self.hypotheses(self.tokenize(raw_lines), search, progress=progress, timeout=timeout)
        shaped = [[(h.text, h.score) if return_scores else h.text for h in hyps] for hyps in found]
        return [hyps[0] for hyps in shaped] if search.nbest == 1 else shaped

    def tokenize(self, raw_lines: list[str]) -> list[str]:
        """Raw lines split into the words the source vocabulary encodes (see transformer.data.tokenize)."""
        return list(self._tokenizer.pipe(raw_lines))

    @functools.cached_property
    def _tokenizer(self) -> Tokenizer:
        """Built once: spaCy's rules take tens of milliseconds to load, more than a short request's search."""
        return Tokenizer(self.params["data"]["src_lang"])

    def translate_tokenized(
        self, lines: list[str], search: Search | None = None, *, progress: bool = False, timeout: float | None = None
    ) -> list[str]:
        """Detokenized translations of tokenized lines, in input order; an empty line gives an empty line."""
        return [hyps[0].text for hyps in self.hypotheses(lines, search, progress=progress, timeout=timeout)]

    def hypotheses(
        self, lines: list[str], search: Search | None = None, *, progress: bool = False, timeout: float | None = None
    ) -> list[list[Translation]]:
        """The search.nbest best translations of each tokenized line, best first, searched as `search`
        says (default: the model's decode params). Beam search ranks by log P / lp(length); sampling
        draws its translations and sorts them by score. `progress` shows a progress bar on stderr.
        With `timeout`, decoding stops with a TimeoutError at its first step after that many seconds,
        so that a caller who has given up waiting does not keep the cores busy."""
        search = self.search() if search is None else search
        model = self.model if timeout is None else _Timed(self.model, timeout)
        return self._decode(lines, search, _searcher(model, search, self.device), progress)

    def score(self, sources: list[str], targets: list[str], batch_tokens: int | None = None) -> list[Scored]:
        """Forced decoding: each raw target's log-probability given its raw source, the score beam search
        gives a translation it finds (Translation.score), for translations the model did not choose: a
        reference, another system's output. Batched by source length, `batch_tokens` source tokens a
        batch (default: the model's decode params). An empty source scores only an empty target (0.0),
        as translate gives an empty line an empty translation."""
        src = _encoded(self.src_vocab, self.tokenize(sources))
        tgt = [self.tgt_vocab.encode(line) for line in Tokenizer(self.params["data"]["tgt_lang"]).pipe(targets)]
        found = forced_batches(self.model, src, tgt, batch_tokens or self.params["decode"]["batch_tokens"], self.device)
        return [Scored(log_prob, len(t) + 1) if s else Scored(0.0, 0) for s, t, log_prob in zip(src, tgt, found)]

    def _decode(self, lines: list[str], search: Search, run, progress: bool) -> list[list[Translation]]:
        from tqdm import tqdm

        encoded = _encoded(self.src_vocab, lines)
        bound = functools.partial(
            _length_bound, max_len_extra=search.max_len_extra, longest=self.params["tokenize"]["max_len"]
        )
        limits = [bound(line, len(ids), index=i) for i, (line, ids) in enumerate(zip(lines, encoded))]
        out = [[Translation("", 0.0)] for _ in lines]
        bar = tqdm(
            total=sum(1 for e in encoded if e), unit="sent", disable=not progress, file=sys.stderr, mininterval=1
        )
        for batch, found in batched_search(encoded, limits, search, self.device, run):
            for i, hyps in zip(batch, found):
                out[i] = [Translation(to_text(self.tgt_vocab, h.tokens), h.log_prob) for h in hyps]
                self.tokens_out += len(hyps[0].tokens) + 1  # + </s>
            bar.update(len(batch))
        bar.close()
        return out


def _length_bound(line: str, length: int, *, index: int, max_len_extra: int, longest: int) -> int:
    """Source length + max_len_extra; a source longer than training's longest (tokenize.max_len tokens,
    `longest`) gets the bound of its first `longest` tokens, and a LongSourceWarning."""
    words = len(line.split())
    if words <= longest:
        return length + max_len_extra
    bound = math.ceil(length * longest / words) + max_len_extra
    warnings.warn(
        f"line {index + 1}: {words} tokens, longer than any source the model was trained on "
        f"(tokenize.max_len = {longest}); its translation stops at {bound} tokens",
        LongSourceWarning,
        stacklevel=2,
    )
    return bound


def _encoded(src_vocab, lines: list[str]) -> list[list[int]]:
    """Tokenized source lines as the encoder reads them, each ended by </s>; an empty line stays empty."""
    return [src_vocab.encode(line) + [EOS] if line.strip() else [] for line in lines]


def forced_batches(
    model, src: list[list[int]], tgt: list[list[int]], batch_tokens: int, device: torch.device
) -> list[float]:
    """search.forced's log P(tgt | src) of each pair, in batches of about batch_tokens source tokens, shortest
    sources first, as the decode stage batches its search; 0.0 for an empty source, which nothing scores."""
    if len(src) != len(tgt):
        raise DataError(f"{len(src)} sources but {len(tgt)} targets")
    for i, (s, t) in enumerate(zip(src, tgt)):
        if not s and t:
            raise DataError(f"line {i + 1}: an empty source has no translation but an empty one")
    out = [0.0] * len(src)
    order = sorted((i for i, e in enumerate(src) if e), key=lambda i: len(src[i]))
    for batch in _batches(order, src, batch_tokens):
        found = forced(model, _padded(src, batch, device), [tgt[i] for i in batch], BOS, EOS)
        for i, log_prob in zip(batch, found):
            out[i] = log_prob
    return out


def _searcher(model, search: Search, device: torch.device) -> Callable[..., list[list[Hypothesis]]]:
    """The search `search` describes as one function of a batch, (src, max_len) -> each sentence's
    hypotheses, best first. Sampling's generator is made here, once for all the batches, so that a
    seed gives the same draws however the sentences are batched."""
    if not search.sample:
        return functools.partial(
            beam_search_nbest, model, beam=search.beam, alpha=search.alpha, bos=BOS, eos=EOS, nbest=search.nbest
        )
    generator = None if search.seed is None else torch.Generator(device).manual_seed(search.seed)
    return functools.partial(_sample, model, search=search, generator=generator)


def _sample(
    model, src: torch.Tensor, max_len: torch.Tensor, *, search: Search, generator: torch.Generator | None
) -> list[list[Hypothesis]]:
    """search.nbest draws of each sentence, most probable first."""
    nbest = search.nbest
    rows = torch.arange(src.size(0), device=src.device).repeat_interleave(nbest)  # nbest draws per sentence
    drawn = draw_samples(
        model,
        src[rows],
        max_len[rows],
        BOS,
        EOS,
        temperature=search.temperature,
        top_k=search.top_k,
        top_p=search.top_p,
        generator=generator,
    )
    return [sorted(drawn[i : i + nbest], key=lambda h: -h.log_prob) for i in range(0, len(drawn), nbest)]


class _Timed:
    """The model, refusing another decoding step once `seconds` have passed: a time cap that stops
    the work itself, not only the wait for it."""

    def __init__(self, model, seconds: float):
        self.model, self.seconds, self.until = model, seconds, time.monotonic() + seconds

    def start(self, src: torch.Tensor, beam: int = 1):
        return self.model.start(src, beam=beam)

    def step(self, state, last: torch.Tensor) -> torch.Tensor:
        if time.monotonic() > self.until:
            raise TimeoutError(f"translation stopped after {self.seconds:.3g} s")
        return self.model.step(state, last)


def search_batches(
    model, encoded: list[list[int]], search: Search, device: torch.device
) -> Iterator[tuple[list[int], list[list[int]]]]:
    """(sentence indices, best output ids) batch by batch, shortest sources first; each source ends in
    `</s>`; empty sources are skipped. Validation during training uses it, as the decode stage searches."""
    limits = [len(ids) + search.max_len_extra for ids in encoded]
    for batch, found in batched_search(encoded, limits, search, device, _searcher(model, search, device)):
        yield batch, [hyps[0].tokens for hyps in found]


def to_text(tgt_vocab, ids: list[int]) -> str:
    """Output ids to detokenized text: what the decode stage writes and BLEU scores."""
    return detokenize(tgt_vocab.decode(ids))


def batched_search(
    encoded: list[list[int]], limits: list[int], search: Search, device: torch.device, run
) -> Iterator[tuple[list[int], list[list[Hypothesis]]]]:
    """`run`'s hypotheses for the non-empty sources, shortest sources first, in batches of about
    search.batch_tokens decoder tokens (search.rows decoder rows a sentence); `limits` holds each
    sentence's longest translation."""
    order = sorted((i for i, e in enumerate(encoded) if e), key=lambda i: len(encoded[i]))
    for batch in _batches(order, encoded, max(1, search.batch_tokens // search.rows)):
        max_len = torch.tensor([limits[i] for i in batch], device=device)
        yield batch, run(src=_padded(encoded, batch, device), max_len=max_len)


def _padded(encoded: list[list[int]], batch: list[int], device: torch.device) -> torch.Tensor:
    """The batch's sources as one (B, S) tensor, padded at the end."""
    return torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(encoded[i]) for i in batch], batch_first=True, padding_value=PAD
    ).to(device)


def _batches(order: list[int], encoded: list[list[int]], max_tokens: int) -> list[list[int]]:
    batches, current = [], []
    for i in order:  # ascending length: the last sentence of a batch is its longest
        if current and len(encoded[i]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def timed_translate(
    translator: Translator, lines: list[str], search: Search, *, progress: bool = False
) -> tuple[list[str], dict[str, float]]:
    """The translations of tokenized lines, and how fast they came: seconds, sentences and target
    tokens (each translation's `</s>` included) per second."""
    translator.tokens_out = 0
    start = time.perf_counter()
    out = translator.translate_tokenized(lines, search, progress=progress)
    seconds = time.perf_counter() - start
    return out, {
        "seconds": round(seconds, 2),
        "sentences_per_s": round(len(lines) / seconds, 1),
        "tokens_per_s": round(translator.tokens_out / seconds, 1),
    }
