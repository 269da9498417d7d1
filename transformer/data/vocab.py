"""Vocabularies: word-level (the Annotated Transformer's) or joint sentencepiece BPE.

Both put the specials at the same ids: <s>=0, </s>=1, <blank>=2 (padding), <unk>=3."""

from __future__ import annotations

import atexit
import functools
import hashlib
import heapq
import io
import itertools
import math
import pickle
import random
import sys
from array import array
from collections import Counter
from collections.abc import Iterable, Sized
from pathlib import Path
from typing import Any

import torch

from transformer.io import (
    DataError,
    atomic_path,
    check_aligned,
    count_lines,
    iter_lines,
    save_torch,
    write_json,
    write_lines,
)

SPECIALS = ("<s>", "</s>", "<blank>", "<unk>")
BOS, EOS, PAD, UNK = range(4)
SAMPLE = 5_000_000  # training lines sentencepiece learns BPE from; a larger corpus is sampled (seeded)


class WordVocab:
    kind = "word"

    def __init__(self, itos: list[str]):
        if tuple(itos[:4]) != SPECIALS:
            raise DataError(f"word vocabulary must start with {SPECIALS}, got {itos[:4]}")
        self.itos = itos
        self.stoi = {s: i for i, s in enumerate(itos)}

    @classmethod
    def build(cls, lines: Iterable[str], min_freq: int) -> WordVocab:
        counts = Counter(token for line in lines for token in line.split())
        ranked = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], t))
        return cls(list(SPECIALS) + ranked)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokenized: str) -> list[int]:
        return [self.stoi.get(t, UNK) for t in tokenized.split()]

    def encode_many(self, lines: list[str], threads: int = 1) -> list[list[int]]:
        return [self.encode(line) for line in lines]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.itos[i] for i in ids if i >= len(SPECIALS))

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "itos": self.itos}


class BpeVocab:
    kind = "bpe"

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self.proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)

    @classmethod
    def train(
        cls, lines: Iterable[str], size: int, seed: int, sample: int = SAMPLE, count: int | None = None
    ) -> BpeVocab:
        """Learns `size` pieces from `lines`, or from `sample` of them drawn with `seed`. `lines` may be
        a stream (iter_lines) read once, with its `count` of lines given: then only sentencepiece
        holds the sampled lines, never a list of str besides.

        The sample is ours: sentencepiece's (input_sentence_size) ignores any seed and draws
        other lines in every process. Lines go in, and the model comes out, through memory,
        so no temporary path is recorded in it; nor is the thread count, which does not
        change the pieces: the same lines and seed give the same bytes on any machine."""
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2

        if count is None:
            lines = list(lines)
            count = len(lines)
        stream = _Sampled(lines, count, sample, seed)
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=stream,
                model_writer=model,
                vocab_size=size,
                model_type="bpe",
                character_coverage=1.0,
                normalization_rule_name="identity",  # keep text (and JOINER) reversible
                bos_id=BOS,
                eos_id=EOS,
                pad_id=PAD,
                unk_id=UNK,
                bos_piece="<s>",
                eos_piece="</s>",
                pad_piece="<blank>",
                unk_piece="<unk>",
                minloglevel=2,
                num_threads=max(1, torch.get_num_threads()),
                hard_vocab_limit=False,
            )
        except RuntimeError:
            if stream.error:  # sentencepiece wraps what the stream raised (a line not UTF-8) in its own error
                raise stream.error from None
            raise
        proto = sentencepiece_model_pb2.ModelProto.FromString(model.getvalue())
        proto.trainer_spec.ClearField("num_threads")
        return cls(proto.SerializeToString())

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, tokenized: str) -> list[int]:
        return self.sp.encode(tokenized)

    def encode_many(self, lines: list[str], threads: int = 1) -> list[list[int]]:
        return self.sp.encode(lines, num_threads=threads)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i >= len(SPECIALS)])

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": torch.frombuffer(bytearray(self.proto), dtype=torch.uint8)}


Vocab = WordVocab | BpeVocab
WORD_START = "\u2581"  # sentencepiece's mark for a space


class BpeDropout:
    """BPE-dropout (Provilkov et al., 2020): segments like `BpeVocab.encode`, but skips each merge
    with probability `dropout`. It replays sentencepiece's merge order (highest score first, then
    leftmost) with Python's seeded generator: sentencepiece's own sampler salts its seed afresh in
    every process, so another rank or a resumed run could not repeat its draws."""

    def __init__(self, vocab: BpeVocab):
        sp = vocab.sp
        normal = [i for i in range(len(vocab)) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))]
        self.ids = {sp.id_to_piece(i): i for i in normal}
        self.scores = {sp.id_to_piece(i): sp.get_score(i) for i in normal}

    def encode(self, line: str, dropout: float, rng: random.Random) -> list[int]:
        ids: list[int] = []
        log_keep = math.log(1.0 - dropout)
        for word in line.split(" "):
            if not word:  # sentencepiece drops repeated and outer spaces
                continue
            fixed, merges, agenda = self._word(WORD_START + word)
            # The merges before the first skip are the fixed ones: draw where that skip falls
            # (geometric), and replay the merge loop only for the words it reaches.
            first_skip = 1 + int(math.log(1.0 - rng.random()) / log_keep) if dropout else merges + 1
            if first_skip > merges:
                ids.extend(fixed)
            else:
                ids.extend(self._ids(self._segment(WORD_START + word, list(agenda), dropout, rng, first_skip)))
        return ids

    def encode_many(self, lines: list[str], dropout: float, rng: random.Random) -> list[list[int]]:
        return [self.encode(line, dropout, rng) for line in lines]

    @functools.lru_cache(maxsize=1 << 18)  # noqa: B019 (a vocabulary lives as long as its process)
    def _word(self, word: str) -> tuple[tuple[int, ...], int, tuple]:
        """A word type's fixed ids, its number of merges and its first agenda (heap-ordered)."""
        agenda: list = []
        for i in range(len(word) - 1):
            self._push(agenda, list(word), i, i + 1)
        pieces = self._segment(word, list(agenda), 0.0, None, len(word))
        return tuple(self._ids(pieces)), len(word) - len(pieces), tuple(agenda)

    def _segment(
        self, word: str, agenda: list, dropout: float, rng: random.Random | None, first_skip: int
    ) -> list[str]:
        """sentencepiece's merge loop; the pair popped `first_skip`-th is skipped, later ones with
        probability `dropout`."""
        pieces, popped, score_of, pop, push = list(word), 0, self.scores.get, heapq.heappop, heapq.heappush
        after, before = list(range(1, len(word))) + [-1], list(range(-1, len(word) - 1))
        while agenda:
            _, left, right, size = pop(agenda)
            merged = pieces[left] + pieces[right]
            if not pieces[left] or not pieces[right] or len(merged) != size:
                continue  # one side has merged since this pair was queued
            popped += 1
            if popped == first_skip or (popped > first_skip and rng.random() < dropout):
                continue
            pieces[left], pieces[right], after[left] = merged, "", after[right]
            for a, b in ((before[left], left), (left, after[left])):  # the new neighbours (-1: none)
                if a >= 0 and b >= 0 and (score := score_of(pieces[a] + pieces[b])) is not None:
                    push(agenda, (-score, a, b, len(pieces[a]) + len(pieces[b])))
            if after[left] >= 0:
                before[after[left]] = left
        return [piece for piece in pieces if piece]

    def _push(self, agenda: list, pieces: list[str], left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            score = self.scores.get(pieces[left] + pieces[right])
            if score is not None:
                heapq.heappush(agenda, (-score, left, right, len(pieces[left]) + len(pieces[right])))

    def _ids(self, pieces: list[str]) -> list[int]:
        ids: list[int] = []
        for piece in pieces:
            i = self.ids.get(piece, UNK)
            if not (i == UNK and ids and ids[-1] == UNK):  # sentencepiece: a run of unknown characters is one <unk>
                ids.append(i)
        return ids


class _Sampled:
    """The lines sentencepiece learns from: every one of `count` lines, or `sample` of them drawn with
    `seed`, in their order, taken in one pass over `lines`. What the pass raises is kept in `error`."""

    def __init__(self, lines: Iterable[str], count: int, sample: int, seed: int):
        if count > sample:
            picked = bytearray(count)  # a byte a line: 9 MB for WMT14's 9M lines, where a set of indices takes ~300
            for i in random.Random(seed).sample(range(count), sample):
                picked[i] = 1
            lines = (line for line, keep in zip(lines, picked) if keep)
        self._lines, self.error = iter(lines), None

    def __iter__(self) -> _Sampled:
        return self

    def __next__(self) -> str:
        try:
            return next(self._lines)
        except StopIteration:
            raise
        except Exception as e:
            self.error = e
            raise


def vocab_from_state(state: dict[str, Any]) -> Vocab:
    if state["kind"] == "word":
        return WordVocab(list(state["itos"]))
    return BpeVocab(state["model"].numpy().tobytes())


def model_vocabs(checkpoint: dict[str, Any]) -> tuple[Vocab, Vocab]:
    """The source and target vocabularies a model file or checkpoint was trained with."""
    return vocab_from_state(checkpoint["vocab"]["src"]), vocab_from_state(checkpoint["vocab"]["tgt"])


def fingerprint(vocab: Vocab) -> str:
    if isinstance(vocab, WordVocab):
        data = "\n".join(vocab.itos).encode()
    else:
        data = vocab.proto
    return hashlib.sha256(data).hexdigest()[:16]


def save_vocabs(out_dir: Path, src: Vocab, tgt: Vocab) -> None:
    """Human-readable files plus vocab.pt, the form checkpoints and decoding load."""
    if isinstance(src, BpeVocab):
        with atomic_path(out_dir / "bpe.model") as tmp:
            tmp.write_bytes(src.proto)
        write_lines(out_dir / "bpe.vocab", [src.sp.id_to_piece(i) for i in range(len(src))])
    else:
        write_lines(out_dir / "src.vocab", src.itos)
        write_lines(out_dir / "tgt.vocab", tgt.itos)
    save_torch({"src": src.state(), "tgt": tgt.state()}, out_dir / "vocab.pt")
    write_json(
        out_dir / "vocab.json",
        {
            "kind": src.kind,
            "src_size": len(src),
            "tgt_size": len(tgt),
            "src_fingerprint": fingerprint(src),
            "tgt_fingerprint": fingerprint(tgt),
        },
    )


def load_vocabs(vocab_dir: Path | str) -> tuple[Vocab, Vocab]:
    path = Path(vocab_dir) / "vocab.pt"
    if not path.exists():
        raise DataError(f"{path}: vocabulary not found (run the build_vocab stage)")
    try:
        state = torch.load(path, weights_only=True)
        return vocab_from_state(state["src"]), vocab_from_state(state["tgt"])
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, TypeError, ValueError, AttributeError) as e:
        # truncated, not a vocabulary, pickled code: one line naming the file, never a traceback
        raise DataError(
            f"{path}: not a vocabulary of this project ({(str(e).splitlines() or [type(e).__name__])[0]})"
        ) from None


ENCODE_CHUNK = 20_000  # lines encoded at a time: only their ids are ever Python ints (~36 bytes an id)


def encode_corpus(
    vocab: Vocab, lines: Iterable[str], threads: int = 1, label: str | None = None, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of every line, flat, with offsets: line i is ids[offsets[i]:offsets[i + 1]].

    `lines` may be a stream (iter_lines): a chunk of lines at a time is read, encoded and turned into
    int32, so memory follows the ids at 4 bytes an id (twice that while the chunks are joined);
    `threads` encode a BPE chunk, `label` names the progress bar, which shows once encoding has taken
    a few seconds, and `count` (the lines there are, where `lines` cannot tell) its total."""
    from tqdm import tqdm

    total = len(lines) if count is None and isinstance(lines, Sized) else count
    stream = iter(lines)
    chunks = iter(lambda: list(itertools.islice(stream, ENCODE_CHUNK)), [])  # until an empty chunk
    lengths, parts = [torch.zeros(1, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int32)]
    with tqdm(total=total, desc=label, unit="line", file=sys.stderr, mininterval=2, delay=5) as bar:
        for chunk in chunks:
            encoded = vocab.encode_many(chunk, threads)
            lengths.append(torch.tensor([len(e) for e in encoded], dtype=torch.int64))
            flat = array("i", itertools.chain.from_iterable(encoded))
            parts += [torch.frombuffer(flat, dtype=torch.int32)] if flat else []
            bar.update(len(encoded))
    return torch.cat(parts), torch.cumsum(torch.cat(lengths), 0)


SAMPLE_CHUNK = 10_000  # lines per seeded piece of work


def sample_corpus(
    vocab: BpeVocab, lines: list[str], dropout: float, key: str, workers: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_corpus with BPE-dropout. Each chunk of lines has its own seed, made from `key` and the
    chunk's index, so the ids depend neither on `workers` nor on which process runs a chunk."""
    chunks = [
        (lines[i : i + SAMPLE_CHUNK], dropout, _chunk_seed(key, i // SAMPLE_CHUNK))
        for i in range(0, len(lines), SAMPLE_CHUNK)
    ]
    if workers > 1 and len(chunks) > 1:
        parts = _pool(vocab.proto, workers).map(_sample_chunk, chunks, chunksize=1)
    else:
        _load_sampler(vocab.proto)
        parts = [_sample_chunk(chunk) for chunk in chunks]
    lengths = torch.tensor([0] + [n for _, chunk_lengths in parts for n in chunk_lengths])
    ids = torch.cat(
        [torch.zeros(0, dtype=torch.int32)] + [torch.frombuffer(a, dtype=torch.int32) for a, _ in parts if a]
    )
    return ids, torch.cumsum(lengths, 0)


def _chunk_seed(key: str, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}/{index}".encode()).digest()[:8], "little")


_sampler: tuple[bytes, BpeDropout] | None = None  # one per process, with its cache of word types
_workers: tuple[bytes, int, Any] | None = None  # a pool kept across epochs, so its workers keep their caches


def _pool(proto: bytes, workers: int):
    global _workers
    if _workers is None or _workers[:2] != (proto, workers):
        import multiprocessing

        _close_pool()
        # fork: the workers run plain Python and sentencepiece, never torch or the GPU
        _workers = (proto, workers, multiprocessing.get_context("fork").Pool(workers, _load_sampler, (proto,)))
    return _workers[2]


@atexit.register
def _close_pool() -> None:
    """Stops the kept pool's workers; at exit too, as a pool left to the interpreter's teardown
    prints a traceback when it is collected after the modules it needs are gone."""
    global _workers
    if _workers is not None:
        _workers[2].terminate()
        _workers = None


def _load_sampler(proto: bytes) -> None:
    global _sampler
    if _sampler is None or _sampler[0] != proto:
        _sampler = (proto, BpeDropout(BpeVocab(proto)))


def _sample_chunk(chunk: tuple[list[str], float, int]) -> tuple[array, array]:
    """Flat ids and line lengths as int32 arrays: they cross the process boundary as bytes."""
    lines, dropout, seed = chunk
    encoded = _sampler[1].encode_many(lines, dropout, random.Random(seed))
    return array("i", [i for e in encoded for i in e]), array("i", [len(e) for e in encoded])


def build_vocabs(
    tok_dir: Path,
    out_dir: Path,
    langs: tuple[str, str],
    kind: str,
    size: int,
    min_freq: int,
    train: str,
    valid: str,
    seed: int,
    threads: int = 1,
) -> dict[str, int]:
    """Builds the vocabularies from the tokenized train split and writes train/valid as id arrays;
    `threads` encode with BPE (they do not change the ids). The text is streamed from the files, for
    sentencepiece's sample and then for encoding, never held whole: at WMT14's size it would take
    several GB as str objects."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, count = _pair(tok_dir, train, langs)
    if kind == "bpe":
        both = itertools.chain.from_iterable(map(iter_lines, paths))
        src = tgt = BpeVocab.train(both, size, seed, SAMPLE, count=2 * count)
    else:
        src, tgt = (WordVocab.build(iter_lines(path), min_freq) for path in paths)
    save_vocabs(out_dir, src, tgt)
    for split in (train, valid):
        _save_ids(out_dir / f"{split}.pt", *_pair(tok_dir, split, langs), (src, tgt), langs, threads)
    return {"src_size": len(src), "tgt_size": len(tgt)}


def _pair(tok_dir: Path, split: str, langs: tuple[str, str]) -> tuple[list[Path], int]:
    """A split's two tokenized files, and the lines each has (the same, or DataError)."""
    paths = [tok_dir / f"{split}.{lang}" for lang in langs]
    counts = [count_lines(path) for path in paths]
    check_aligned(paths, counts, "split")
    return paths, counts[0]


def _save_ids(
    path: Path, sides: list[Path], count: int, vocabs: tuple[Vocab, Vocab], langs: tuple[str, str], threads: int
) -> None:
    (src_ids, src_off), (tgt_ids, tgt_off) = (
        encode_corpus(vocab, iter_lines(side), threads, f"{path.stem}.{lang}", count)
        for vocab, side, lang in zip(vocabs, sides, langs)
    )
    save_torch({"src": src_ids, "src_offsets": src_off, "tgt": tgt_ids, "tgt_offsets": tgt_off}, path)
