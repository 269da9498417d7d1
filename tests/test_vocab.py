"""Word and BPE vocabularies: fixed special ids, reversible BPE, state round trips, build_vocabs outputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from transformer.data import vocab as vocab_module
from transformer.data.batching import ParallelCorpus
from transformer.data.tokenize import JOINER
from transformer.data.vocab import (
    BOS,
    EOS,
    PAD,
    SPECIALS,
    UNK,
    BpeDropout,
    BpeVocab,
    WordVocab,
    build_vocabs,
    encode_corpus,
    fingerprint,
    load_vocabs,
    sample_corpus,
    vocab_from_state,
)
from transformer.io import DataError

WORDS = "der die das ein eine Mann Frau Hund läuft spielt the a man woman dog runs plays football".split()


def _synthetic(n: int, seed: int) -> list[str]:
    """Tokenized lines with glued punctuation, like the tokenize stage writes."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        words += [JOINER + rng.choice(",.!?")] if rng.random() < 0.7 else []
        lines.append(" ".join(words))
    return lines


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> BpeVocab:
    return BpeVocab.train(_synthetic(300, seed=0), 60, seed=1)


def test_special_ids_are_fixed():
    assert SPECIALS == ("<s>", "</s>", "<blank>", "<unk>")
    assert (BOS, EOS, PAD, UNK) == (0, 1, 2, 3)


def test_word_vocab_puts_specials_first_and_ranks_by_frequency():
    vocab = WordVocab.build(["b a a", "c a b"], min_freq=1)
    assert vocab.itos == ["<s>", "</s>", "<blank>", "<unk>", "a", "b", "c"]


def test_word_vocab_respects_min_freq():
    vocab = WordVocab.build(["x x x y y z"], min_freq=2)
    assert "x" in vocab.stoi and "y" in vocab.stoi
    assert "z" not in vocab.stoi
    assert len(vocab) == 6


def test_word_vocab_maps_unknown_tokens_to_unk():
    vocab = WordVocab.build(["a dog runs", "a cat runs"], min_freq=1)
    ids = vocab.encode("a zebra runs")
    assert ids[1] == UNK
    assert ids[0] == vocab.stoi["a"] and ids[2] == vocab.stoi["runs"]


def test_word_vocab_decode_drops_specials():
    vocab = WordVocab.build(["a dog"], min_freq=1)
    assert vocab.decode([BOS, vocab.stoi["a"], PAD, vocab.stoi["dog"], EOS]) == "a dog"


def test_word_vocab_without_leading_specials_is_refused():
    with pytest.raises(DataError, match="must start with"):
        WordVocab(["a", "b", "c", "d"])


def test_bpe_respects_the_requested_size_and_special_ids(bpe):
    assert len(bpe) == 60
    assert [bpe.sp.id_to_piece(i) for i in range(4)] == list(SPECIALS)


def test_bpe_decode_inverts_encode_including_the_joiner(bpe):
    lines = _synthetic(50, seed=1)
    assert any(JOINER in line for line in lines)
    for line in lines:
        ids = bpe.encode(line)
        assert all(i != UNK for i in ids), line
        assert bpe.decode(ids) == line


def test_bpe_decode_drops_specials(bpe):
    ids = bpe.encode(f"der Hund {JOINER}.")
    assert bpe.decode([BOS] + ids + [EOS, PAD]) == f"der Hund {JOINER}."


def test_build_vocabs_leaves_only_its_outputs(tmp_path):
    # anything else left in the output directory would end up in the DVC output
    tok = tmp_path / "tok"
    tok.mkdir()
    for split in ("train", "val"):
        for lang in ("de", "en"):
            (tok / f"{split}.{lang}").write_text("\n".join(_synthetic(200, seed=2)) + "\n")
    build_vocabs(tok, tmp_path / "out", ("de", "en"), "bpe", 50, 1, "train", "val", seed=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "bpe.model",
        "bpe.vocab",
        "train.pt",
        "val.pt",
        "vocab.json",
        "vocab.pt",
    ]


@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_vocab_state_round_trips_through_torch_save(kind, bpe, tmp_path):
    vocab = bpe if kind == "bpe" else WordVocab.build(_synthetic(50, seed=3), min_freq=1)
    torch.save(vocab.state(), tmp_path / "state.pt")
    restored = vocab_from_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert type(restored) is type(vocab)
    assert len(restored) == len(vocab)
    assert fingerprint(restored) == fingerprint(vocab)
    line = _synthetic(1, seed=4)[0]
    assert restored.encode(line) == vocab.encode(line)


def test_fingerprint_tells_vocabularies_apart(bpe):
    a = WordVocab.build(["a b c"], min_freq=1)
    b = WordVocab.build(["a b d"], min_freq=1)
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(WordVocab(list(a.itos)))
    assert fingerprint(bpe) != fingerprint(a)


def test_encode_corpus_offsets_delimit_each_line():
    vocab = WordVocab.build(["a b c"], min_freq=1)
    ids, offsets = encode_corpus(vocab, ["a b", "", "c a b"])
    assert offsets.tolist() == [0, 2, 2, 5]
    assert ids[offsets[2] : offsets[3]].tolist() == vocab.encode("c a b")
    assert ids.dtype == torch.int32


def test_encode_corpus_encodes_a_chunk_of_lines_at_a_time(monkeypatch):
    """Only one chunk's ids are ever Python ints (~36 bytes an id), never the whole corpus's."""
    vocab, seen = WordVocab.build(["a b c"], min_freq=1), []
    monkeypatch.setattr(vocab_module, "ENCODE_CHUNK", 2)
    monkeypatch.setattr(WordVocab, "encode_many", _counting(WordVocab.encode_many, seen))
    ids, offsets = encode_corpus(vocab, ["a b", "", "c a b", "c", "b"])
    assert seen == [2, 2, 1]
    assert offsets.tolist() == [0, 2, 2, 5, 6, 7] and ids.tolist() == vocab.encode("a b c a b c b")


def _counting(encode_many, seen: list[int]):
    def counted(self, lines: list[str], threads: int = 1) -> list[list[int]]:
        seen.append(len(lines))
        return encode_many(self, lines, threads)

    return counted


def _tokenized_corpus(tok: Path) -> None:
    tok.mkdir()
    for split, n, seed in (("train", 300, 10), ("val", 12, 20)):
        for lang, offset in (("de", 0), ("en", 1)):
            lines = _synthetic(n, seed + offset)
            (tok / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_build_vocabs_bpe_writes_vocab_and_id_arrays(tmp_path):
    tok, out = tmp_path / "tok", tmp_path / "vocab"
    _tokenized_corpus(tok)
    sizes = build_vocabs(tok, out, ("de", "en"), "bpe", 60, 2, "train", "val", seed=1)
    assert sizes == {"src_size": 60, "tgt_size": 60}
    for name in ("bpe.model", "bpe.vocab", "vocab.json", "vocab.pt", "train.pt", "val.pt"):
        assert (out / name).exists(), name
    assert not (out / ".bpe-train.txt").exists()
    src, tgt = load_vocabs(out)
    assert fingerprint(src) == fingerprint(tgt)  # one joint vocabulary
    val = ParallelCorpus(out / "val.pt")
    assert len(val) == 12
    first_de = (tok / "val.de").read_text(encoding="utf-8").split("\n")[0]
    assert src.decode(val.src[val.src_off[0] : val.src_off[1]].tolist()) == first_de


def test_build_vocabs_streams_the_sample_sentencepiece_would_take_from_the_lines_in_memory(tmp_path, monkeypatch):
    # The files are read a line at a time, never held: the sampled lines must be those drawn from a list.
    tok, out = tmp_path / "tok", tmp_path / "vocab"
    _tokenized_corpus(tok)
    monkeypatch.setattr(vocab_module, "SAMPLE", 250)  # of the 600 lines of both sides
    build_vocabs(tok, out, ("de", "en"), "bpe", 60, 2, "train", "val", seed=3)
    lines = [line for lang in ("de", "en") for line in (tok / f"train.{lang}").read_text(encoding="utf-8").splitlines()]
    in_memory = BpeVocab.train(lines, 60, seed=3, sample=250)
    assert (out / "bpe.model").read_bytes() == in_memory.proto
    assert in_memory.proto != BpeVocab.train(lines, 60, seed=3, sample=600).proto  # the sample makes a difference


def test_a_line_not_utf8_stops_build_vocab_naming_the_file_and_line(tmp_path):
    tok = tmp_path / "tok"
    _tokenized_corpus(tok)
    with open(tok / "train.en", "ab") as f:
        f.write(b"caf\xe9\n")
    lines = len((tok / "train.de").read_bytes().splitlines())
    (tok / "train.de").write_bytes((tok / "train.de").read_bytes() + b"ok\n")
    for kind in ("bpe", "word"):
        with pytest.raises(DataError, match=rf"train\.en:{lines + 1}: not valid UTF-8"):
            build_vocabs(tok, tmp_path / kind, ("de", "en"), kind, 60, 2, "train", "val", seed=1)


def test_build_vocabs_word_writes_separate_vocabularies(tmp_path):
    tok, out = tmp_path / "tok", tmp_path / "vocab"
    _tokenized_corpus(tok)
    build_vocabs(tok, out, ("de", "en"), "word", 60, 1, "train", "val", seed=1)
    for name in ("src.vocab", "tgt.vocab", "vocab.pt", "vocab.json", "train.pt", "val.pt"):
        assert (out / name).exists(), name
    src, tgt = load_vocabs(out)
    assert isinstance(src, WordVocab) and isinstance(tgt, WordVocab)
    assert len(ParallelCorpus(out / "train.pt")) == 300


def test_load_vocabs_without_vocab_file_names_the_stage(tmp_path):
    with pytest.raises(DataError, match="build_vocab"):
        load_vocabs(tmp_path)


def test_bpe_dropout_samples_other_segmentations_of_the_same_text(bpe):
    lines = _synthetic(200, seed=5)
    dropout, rng = BpeDropout(bpe), random.Random(11)
    sampled = [dropout.encode(line, 0.3, rng) for line in lines]
    changed = sum(s != bpe.encode(line) for s, line in zip(sampled, lines))
    assert changed > 100  # most lines hold several merges; p = 0.3 skips some of them
    assert all(len(s) >= len(bpe.encode(line)) for s, line in zip(sampled, lines))  # skipped merges: more pieces
    assert [bpe.decode(s) for s in sampled] == lines  # the same text, cut elsewhere
    assert all(UNK not in s for s in sampled)


def test_bpe_dropout_zero_segments_exactly_as_sentencepiece(bpe):
    """Our merge loop replays sentencepiece's: also on unknown characters and stray spaces."""
    lines = _synthetic(300, seed=9) + ["der ☃☃ Hund ☃", "  die  Frau ", "", "x"]
    dropout = BpeDropout(bpe)
    assert [dropout.encode(line, 0.0, random.Random(0)) for line in lines] == [bpe.encode(line) for line in lines]


def test_bpe_dropout_rate_matches_sentencepieces_sampler(bpe):
    """Skipping merges with sentencepiece's own sampler lengthens the text as much as ours."""
    lines = _synthetic(2000, seed=10)
    fixed = sum(len(bpe.encode(line)) for line in lines)
    ours = sum(len(ids) for ids in BpeDropout(bpe).encode_many(lines, 0.2, random.Random(3)))
    theirs = sum(len(ids) for ids in bpe.sp.encode(lines, enable_sampling=True, alpha=0.2, nbest_size=-1))
    assert ours > 1.1 * fixed and abs(ours - theirs) < 0.02 * theirs


def test_bpe_dropout_zero_gives_build_vocabs_ids_byte_for_byte(bpe):
    lines = _synthetic(300, seed=6) + [""]
    ids, offsets = encode_corpus(bpe, lines)
    sampled_ids, sampled_offsets = sample_corpus(bpe, lines, 0.0, "seed 1 epoch 3 src")
    assert sampled_ids.dtype == ids.dtype and sampled_offsets.dtype == offsets.dtype
    assert torch.equal(sampled_ids, ids) and torch.equal(sampled_offsets, offsets)


def test_sampled_ids_follow_the_key_and_not_the_number_of_processes(bpe, monkeypatch):
    monkeypatch.setattr(vocab_module, "SAMPLE_CHUNK", 64)  # 5 chunks, each with its own seed
    lines = _synthetic(300, seed=7)
    one = sample_corpus(bpe, lines, 0.2, "seed 1 epoch 0 src")
    again = sample_corpus(bpe, lines, 0.2, "seed 1 epoch 0 src")
    pool = sample_corpus(bpe, lines, 0.2, "seed 1 epoch 0 src", workers=3)
    other = sample_corpus(bpe, lines, 0.2, "seed 1 epoch 1 src")
    assert all(torch.equal(a, b) for a, b in zip(one, again))
    assert all(torch.equal(a, b) for a, b in zip(one, pool))
    assert not torch.equal(one[1], other[1])  # another epoch: other segmentations
    assert bpe.decode(one[0][one[1][-2] : one[1][-1]].tolist()) == lines[-1]  # offsets line up across chunks


def _in_a_fresh_process(code: str, bpe: BpeVocab, lines: list[str], tmp_path: Path) -> str:
    """Runs `code` in a new interpreter at the repository's root, with `bpe` and `lines` written to
    tmp_path (bpe.model, lines.txt; `d` names it there); returns what it printed."""
    import subprocess
    import sys

    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "bpe.model").write_bytes(bpe.proto)
    code = "import sys; from pathlib import Path; d = Path(sys.argv[1]); " + code
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout


def test_sampled_ids_are_the_same_in_a_fresh_process(bpe, tmp_path):
    """Every rank segments the split itself: a new interpreter must cut it as this one does."""
    lines = _synthetic(200, seed=8)
    _in_a_fresh_process(
        "import torch; from transformer.data.vocab import BpeVocab, sample_corpus; "
        "v = BpeVocab((d / 'bpe.model').read_bytes()); "
        "ids, off = sample_corpus(v, (d / 'lines.txt').read_text().splitlines(), 0.2, 'seed 4 epoch 2 tgt'); "
        "torch.save({'ids': ids, 'off': off}, d / 'out.pt')",
        bpe,
        lines,
        tmp_path,
    )
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    ids, off = sample_corpus(bpe, lines, 0.2, "seed 4 epoch 2 tgt")
    assert torch.equal(theirs["ids"], ids) and torch.equal(theirs["off"], off)


def test_the_sampling_pool_is_stopped_at_exit(bpe, tmp_path):
    """Its workers are kept across epochs; at exit the pool is terminated, not left to teardown."""
    printed = _in_a_fresh_process(
        "import atexit; from transformer.data import vocab; vocab.SAMPLE_CHUNK = 64; "
        "v = vocab.BpeVocab((d / 'bpe.model').read_bytes()); "
        "vocab.sample_corpus(v, (d / 'lines.txt').read_text().splitlines(), 0.2, 'k', workers=2); "
        "pool = vocab._workers[2]; atexit._run_exitfuncs(); print(vocab._workers is None, pool._state)",
        bpe,
        _synthetic(200, seed=9),
        tmp_path,
    )
    assert printed.split() == ["True", "TERMINATE"]
