"""Vocabularies: word-level (the Annotated Transformer's) or joint sentencepiece BPE.

Both put the specials at the same ids: <s>=0, </s>=1, <blank>=2 (padding), <unk>=3."""

from __future__ import annotations

import hashlib
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from transformer.io import DataError, atomic_path, read_lines, write_json, write_lines

SPECIALS = ("<s>", "</s>", "<blank>", "<unk>")
BOS, EOS, PAD, UNK = range(4)


class WordVocab:
    kind = "word"

    def __init__(self, itos: list[str]):
        if tuple(itos[:4]) != SPECIALS:
            raise DataError(f"word vocabulary must start with {SPECIALS}, got {itos[:4]}")
        self.itos = itos
        self.stoi = {s: i for i, s in enumerate(itos)}

    @classmethod
    def build(cls, lines: list[str], min_freq: int) -> WordVocab:
        counts = Counter(token for line in lines for token in line.split())
        ranked = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], t))
        return cls(list(SPECIALS) + ranked)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokenized: str) -> list[int]:
        return [self.stoi.get(t, UNK) for t in tokenized.split()]

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
    def train(cls, lines: list[str], size: int) -> BpeVocab:
        import sentencepiece as spm

        with tempfile.TemporaryDirectory(prefix="bpe-") as work:
            seed_file = Path(work) / "train.txt"
            write_lines(seed_file, lines)
            spm.SentencePieceTrainer.train(
                input=str(seed_file), model_prefix=str(Path(work) / "bpe"), vocab_size=size, model_type="bpe",
                character_coverage=1.0, normalization_rule_name="identity",  # keep text (and JOINER) reversible
                bos_id=BOS, eos_id=EOS, pad_id=PAD, unk_id=UNK, bos_piece="<s>", eos_piece="</s>",
                pad_piece="<blank>", unk_piece="<unk>", input_sentence_size=5_000_000, shuffle_input_sentence=True,
                minloglevel=2, num_threads=max(1, torch.get_num_threads()), hard_vocab_limit=False,
            )
            return cls((Path(work) / "bpe.model").read_bytes())

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, tokenized: str) -> list[int]:
        return self.sp.encode(tokenized)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i >= len(SPECIALS)])

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": torch.frombuffer(bytearray(self.proto), dtype=torch.uint8)}


Vocab = WordVocab | BpeVocab


def vocab_from_state(state: dict[str, Any]) -> Vocab:
    if state["kind"] == "word":
        return WordVocab(list(state["itos"]))
    return BpeVocab(state["model"].numpy().tobytes())


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
    with atomic_path(out_dir / "vocab.pt") as tmp:
        torch.save({"src": src.state(), "tgt": tgt.state()}, tmp)
    write_json(out_dir / "vocab.json", {"kind": src.kind, "src_size": len(src), "tgt_size": len(tgt),
                                        "src_fingerprint": fingerprint(src), "tgt_fingerprint": fingerprint(tgt)})


def load_vocabs(vocab_dir: Path | str) -> tuple[Vocab, Vocab]:
    path = Path(vocab_dir) / "vocab.pt"
    if not path.exists():
        raise DataError(f"{path}: vocabulary not found (run the build_vocab stage)")
    state = torch.load(path, weights_only=True)
    return vocab_from_state(state["src"]), vocab_from_state(state["tgt"])


def encode_corpus(vocab: Vocab, lines: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of every line, flat, with offsets: line i is ids[offsets[i]:offsets[i + 1]]."""
    encoded = [vocab.encode(line) for line in lines]
    lengths = torch.tensor([0] + [len(e) for e in encoded])
    ids = torch.tensor([i for e in encoded for i in e], dtype=torch.int32)
    return ids, torch.cumsum(lengths, 0)


def build_vocabs(
    tok_dir: Path, out_dir: Path, langs: tuple[str, str], kind: str, size: int, min_freq: int, train: str, valid: str
) -> dict[str, int]:
    """Builds the vocabularies from the tokenized train split and writes train/valid as id arrays."""
    src_lang, tgt_lang = langs
    train_src, train_tgt = (read_lines(tok_dir / f"{train}.{lang}") for lang in langs)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "bpe":
        src = tgt = BpeVocab.train(train_src + train_tgt, size)
    else:
        src, tgt = WordVocab.build(train_src, min_freq), WordVocab.build(train_tgt, min_freq)
    save_vocabs(out_dir, src, tgt)
    for split in (train, valid):
        src_ids, src_off = encode_corpus(src, read_lines(tok_dir / f"{split}.{src_lang}"))
        tgt_ids, tgt_off = encode_corpus(tgt, read_lines(tok_dir / f"{split}.{tgt_lang}"))
        with atomic_path(out_dir / f"{split}.pt") as tmp:
            torch.save({"src": src_ids, "src_offsets": src_off, "tgt": tgt_ids, "tgt_offsets": tgt_off}, tmp)
    return {"src_size": len(src), "tgt_size": len(tgt)}


