"""From a model file to translations: tokenize, encode, batch by length, search, detokenize."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from transformer.io import DataError
from transformer.model import load_model
from transformer.search import beam_search
from transformer.tokenize import Tokenizer, detokenize
from transformer.vocab import BOS, EOS, PAD, fingerprint, vocab_from_state


class Translator:
    def __init__(self, model_path: Path | str, device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, ckpt = load_model(model_path, self.device)
        self.src_vocab, self.tgt_vocab = (vocab_from_state(ckpt["vocab"][side]) for side in ("src", "tgt"))
        self.params = ckpt["params"]
        self.path = Path(model_path)
        self.tokens_out = 0

    def check_vocab(self, src_vocab, tgt_vocab, where: Path) -> None:
        """Refuses a vocabulary other than the one the model was trained with."""
        for side, mine, theirs in (("source", self.src_vocab, src_vocab), ("target", self.tgt_vocab, tgt_vocab)):
            if fingerprint(mine) != fingerprint(theirs):
                raise DataError(f"{where}: {side} vocabulary ({len(theirs)} entries, fingerprint {fingerprint(theirs)}) "
                                f"does not match the one {self.path} was trained with ({len(mine)}, {fingerprint(mine)}); "
                                f"rebuild the vocabulary or retrain")

    def translate(self, raw_lines: list[str], **search) -> list[str]:
        """Raw text in, raw text out."""
        tokenizer = Tokenizer(self.params["data"]["src_lang"])
        return self.translate_tokenized(list(tokenizer.pipe(raw_lines)), **search)

    def translate_tokenized(self, lines: list[str], *, beam: int, alpha: float, max_len_extra: int, batch_tokens: int,
                            progress: bool = False) -> list[str]:
        """Detokenized translations of tokenized lines, in input order; an empty line gives an empty line.
        The search settings are params.yaml's `decode` section (the model file holds the run's)."""
        from tqdm import tqdm

        encoded = [self.src_vocab.encode(line) + [EOS] if line.strip() else [] for line in lines]
        out = [""] * len(lines)
        bar = tqdm(total=sum(1 for e in encoded if e), unit="sent", disable=not progress, file=sys.stderr, mininterval=1)
        for batch, outputs in search_batches(self.model, encoded, beam, alpha, max_len_extra, batch_tokens, self.device):
            for i, ids in zip(batch, outputs):
                out[i] = to_text(self.tgt_vocab, ids)
                self.tokens_out += len(ids) + 1  # + </s>
            bar.update(len(batch))
        bar.close()
        return out


def search_batches(model, encoded: list[list[int]], beam: int, alpha: float, max_len_extra: int, batch_tokens: int,
                   device: torch.device) -> Iterator[tuple[list[int], list[list[int]]]]:
    """(sentence indices, output ids) batch by batch, shortest sources first; each source ends in
    </s>; empty sources are skipped. The decode stage and validation during training both use it."""
    order = sorted((i for i, e in enumerate(encoded) if e), key=lambda i: len(encoded[i]))
    for batch in _batches(order, encoded, max(1, batch_tokens // beam)):
        src = torch.nn.utils.rnn.pad_sequence([torch.tensor(encoded[i]) for i in batch], batch_first=True,
                                              padding_value=PAD).to(device)
        max_len = torch.tensor([len(encoded[i]) + max_len_extra for i in batch], device=device)
        yield batch, beam_search(model, src, beam, alpha, max_len, BOS, EOS)


def to_text(tgt_vocab, ids: list[int]) -> str:
    """Output ids to detokenized text: what the decode stage writes and BLEU scores."""
    return detokenize(tgt_vocab.decode(ids))


def _batches(order: list[int], encoded: list[list[int]], max_tokens: int) -> list[list[int]]:
    batches, current = [], []
    for i in order:  # ascending length: the last sentence of a batch is its longest
        if current and len(encoded[i]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def timed_translate(translator: Translator, lines: list[str], **search) -> tuple[list[str], dict[str, float]]:
    translator.tokens_out = 0
    start = time.perf_counter()
    out = translator.translate_tokenized(lines, **search)
    seconds = time.perf_counter() - start
    return out, {"seconds": round(seconds, 2), "sentences_per_s": round(len(lines) / seconds, 1),
                 "tokens_per_s": round(translator.tokens_out / seconds, 1)}
