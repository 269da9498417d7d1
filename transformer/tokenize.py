"""Reversible tokenization with spaCy's rule-based tokenizers (spacy.blank: no model download).

A token written right after the previous one, with no space between them, carries
the JOINER prefix ("Hello ￭, world"), so detokenize() can rebuild the original text."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from transformer.io import DataError, read_lines, write_lines

JOINER = "\uffed"  # ￭


class Tokenizer:
    def __init__(self, lang: str):
        import spacy

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
        return next(self.pipe([line]))


def detokenize(tokenized: str) -> str:
    pieces = []
    for token in tokenized.split():
        if token.startswith(JOINER):
            pieces.append(token[len(JOINER) :])
        else:
            pieces.append(" " + token if pieces else token)
    return "".join(pieces)


def tokenize_corpus(
    raw_dir: Path, out_dir: Path, splits: list[str], langs: tuple[str, str], train_split: str, max_len: int
) -> dict[str, int]:
    """Tokenizes every split into out_dir; filters empty and over-long pairs from train only."""
    tokenizers = {lang: Tokenizer(lang) for lang in langs}
    stats: dict[str, int] = {}
    for split in splits:
        paths = [raw_dir / f"{split}.{lang}" for lang in langs]
        src_raw, tgt_raw = (read_lines(p) for p in paths)
        if len(src_raw) != len(tgt_raw):
            raise DataError(
                f"{paths[0]}: has {len(src_raw)} lines, but {paths[1]} has {len(tgt_raw)}: the corpus is misaligned"
            )
        if not src_raw:
            raise DataError(f"{paths[0]}: empty file (split '{split}')")
        src = list(tokenizers[langs[0]].pipe(src_raw))
        tgt = list(tokenizers[langs[1]].pipe(tgt_raw))
        if split == train_split:
            src, tgt, dropped = _filter(src, tgt, max_len, paths[0])
            stats.update({f"{split}.dropped_{k}": v for k, v in dropped.items()})
        stats[f"{split}.pairs"] = len(src)
        write_lines(out_dir / f"{split}.{langs[0]}", src)
        write_lines(out_dir / f"{split}.{langs[1]}", tgt)
    return stats


def _filter(src: list[str], tgt: list[str], max_len: int, where: Path) -> tuple[list[str], list[str], dict[str, int]]:
    keep_src, keep_tgt, dropped = [], [], {"empty": 0, "long": 0}
    for s, t in zip(src, tgt):
        if not s or not t:
            dropped["empty"] += 1
        elif max(len(s.split()), len(t.split())) > max_len:
            dropped["long"] += 1
        else:
            keep_src.append(s)
            keep_tgt.append(t)
    if not keep_src:
        raise DataError(
            f"{where}: no training pair left after filtering ({dropped['empty']} empty, "
            f"{dropped['long']} longer than {max_len} tokens)"
        )
    return keep_src, keep_tgt, dropped
