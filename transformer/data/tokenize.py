"""Reversible tokenization with spaCy's rule-based tokenizers (spacy.blank: no model download).

A token written right after the previous one, with no space between them, carries
the JOINER prefix ("Hello ￭, world"), so detokenize() can rebuild the original text."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer.io import DataError, check_aligned, read_lines, write_lines

JOINER = "\uffed"  # ￭


class Tokenizer:
    """spaCy's rule-based tokenizer for one language (`lang`: "de", "en", ...), made reversible: a token
    written right after the previous one, with no space between them, carries the joiner `￭` in front
    ("Hello ￭, world"), so `detokenize` rebuilds the original text."""

    def __init__(self, lang: str):
        import spacy

        self.lang = lang
        try:
            self._tokenizer = spacy.blank(lang).tokenizer
        except (ImportError, KeyError) as e:
            raise DataError(f"spaCy has no tokenizer for language '{lang}' ({e})") from None

    def pipe(self, lines: Iterable[str]) -> Iterator[str]:
        """Tokenizes a stream of lines, one tokenized line per input line."""
        for doc in self._tokenizer.pipe((line.strip() for line in lines), batch_size=1000):
            out, glue = [], False
            for token in doc:
                if token.is_space:  # runs of extra whitespace: not reproduced
                    glue = False
                    continue
                out.append(JOINER + token.text if glue else token.text)
                glue = not token.whitespace_
            yield " ".join(out)

    def __call__(self, line: str) -> str:
        """Tokenizes one line."""
        return next(self.pipe([line]))


def detokenize(tokenized: str) -> str:
    pieces = []
    for token in tokenized.split():
        if token.startswith(JOINER):
            pieces.append(token[len(JOINER) :])
        else:
            pieces.append(" " + token if pieces else token)
    return "".join(pieces)


CHUNK = 10_000  # lines a worker tokenizes at a time


def tokenize_corpus(
    raw_dir: Path,
    out_dir: Path,
    splits: list[str],
    langs: tuple[str, str],
    train_split: str,
    max_len: int,
    workers: int = 1,
    *,
    max_ratio: float = 0.0,
    dedupe: bool = False,
) -> dict[str, int]:
    """Tokenizes every split into out_dir; filters train only (see _filter), counting each reason a
    pair left it as `<train_split>.dropped_<reason>`. `workers` processes tokenize chunks of lines;
    the output is the same for any number."""
    tokenizers = [Tokenizer(lang) for lang in langs]  # an unknown language fails here, in one process
    stats: dict[str, int] = {}
    with _pool(langs, workers) as pool:
        for split in splits:
            paths = [raw_dir / f"{split}.{lang}" for lang in langs]
            src, tgt = _tokenized_pair(paths, tokenizers, pool, split)
            if split == train_split:
                src, tgt, dropped = _filter(src, tgt, Filters(max_len, max_ratio, dedupe), paths[0])
                stats.update({f"{split}.dropped_{k}": v for k, v in dropped.items()})
            stats[f"{split}.pairs"] = len(src)
            write_lines(out_dir / f"{split}.{langs[0]}", src)
            write_lines(out_dir / f"{split}.{langs[1]}", tgt)
    return stats


def _tokenized_pair(paths: list[Path], tokenizers: list[Tokenizer], pool: Any, split: str) -> list[list[str]]:
    """Both sides of a split, tokenized; its raw text is let go on return."""
    raw = [read_lines(p) for p in paths]
    check_aligned(paths, [len(side) for side in raw], "corpus")
    if not raw[0]:
        raise DataError(f"{paths[0]}: empty file (split '{split}')")
    return [_tokenized(tokenizer, pool, lines, path) for tokenizer, lines, path in zip(tokenizers, raw, paths)]


@contextlib.contextmanager
def _pool(langs: tuple[str, str], workers: int) -> Iterator[Any]:
    """A pool of `workers` processes with a tokenizer of each language, or None for one process."""
    if workers <= 1:
        yield None
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # fork: the workers run spaCy's tokenizers only, never torch. An executor, not a Pool: a worker
    # killed (out of memory) breaks it with an error, where a Pool waits for the lost chunk forever.
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_load_tokenizers, initargs=(langs,)) as pool:
        yield pool


def _tokenized(tokenizer: Tokenizer, pool: Any, lines: list[str], path: Path) -> list[str]:
    """The lines tokenized, in their order, a chunk at a time (by the pool's workers, if any)."""
    from tqdm import tqdm

    chunks = [(tokenizer.lang, lines[i : i + CHUNK]) for i in range(0, len(lines), CHUNK)]
    parts = pool.map(_tokenize_chunk, chunks) if pool else (list(tokenizer.pipe(chunk)) for _, chunk in chunks)
    out: list[str] = []
    with tqdm(total=len(lines), desc=path.name, unit="line", file=sys.stderr, mininterval=2, delay=5) as bar:
        for part in parts:
            out += part
            bar.update(len(part))
    return out


_tokenizers: dict[str, Tokenizer] = {}  # a pool worker's, one a language


def _load_tokenizers(langs: tuple[str, str]) -> None:
    _tokenizers.update({lang: Tokenizer(lang) for lang in langs})


def _tokenize_chunk(task: tuple[str, list[str]]) -> list[str]:
    lang, lines = task
    return list(_tokenizers[lang].pipe(lines))


@dataclass(frozen=True)
class Filters:
    """What drops a training pair besides an empty side: a side longer than `max_len` tokens; a longer
    side of more than `max_ratio` times the shorter side's tokens (0: off), the usual look of a sentence
    paired with the wrong translation; with `dedupe`, being the same pair, token for token, as an
    earlier one."""

    max_len: int
    max_ratio: float
    dedupe: bool

    def reasons(self) -> dict[str, str]:
        """Each reason a pair may be dropped for (a pair with an empty side always is), worded for an error."""
        on = {"ratio": self.max_ratio > 0, "duplicate": self.dedupe}
        words = {
            "empty": "with an empty side",
            "long": f"longer than {self.max_len} tokens",
            "ratio": f"of a length ratio above {self.max_ratio}",
            "duplicate": "repeating an earlier pair",
        }
        return {reason: said for reason, said in words.items() if on.get(reason, True)}

    def reason(self, src: str, tgt: str) -> str | None:
        """Why the tokenized pair is dropped, before duplicates are looked for; None if it is not."""
        if not src or not tgt:
            return "empty"
        shorter, longer = sorted((len(src.split()), len(tgt.split())))
        if longer > self.max_len:
            return "long"
        if self.max_ratio and longer > self.max_ratio * shorter:
            return "ratio"
        return None


def _filter(
    src: list[str], tgt: list[str], filters: Filters, where: Path
) -> tuple[list[str], list[str], dict[str, int]]:
    """The pairs `filters` keep, in their order, and how many each reason dropped (the first that applies)."""
    keep_src, keep_tgt, seen = [], [], set()
    dropped = dict.fromkeys(filters.reasons(), 0)
    for s, t in zip(src, tgt):
        reason = filters.reason(s, t)
        if reason is None and filters.dedupe:
            reason = "duplicate" if (s, t) in seen else None
            seen.add((s, t))
        if reason:
            dropped[reason] += 1
        else:
            keep_src.append(s)
            keep_tgt.append(t)
    if not keep_src:
        counts = ", ".join(f"{dropped[reason]} {said}" for reason, said in filters.reasons().items())
        raise DataError(f"{where}: no training pair left after filtering ({counts})")
    return keep_src, keep_tgt, dropped
