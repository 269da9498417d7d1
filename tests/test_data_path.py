"""tokenize and build_vocab write, byte for byte, what the one-process code wrote before they split
their work into chunks and workers: tests/golden/data_path.json holds the sha256 of every output on a
small corpus, written by that code. `python tests/test_data_path.py` rewrites it with whatever
`transformer` it imports (PYTHONPATH); do so only for a change meant to alter the outputs."""

from __future__ import annotations

import json
import os
import signal
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
from conftest import toy_pairs

from transformer.data import tokenize as tokenize_module
from transformer.data import vocab as vocab_module
from transformer.data.tokenize import tokenize_corpus
from transformer.data.vocab import build_vocabs
from transformer.errors import ConfigError
from transformer.io import sha256_file
from transformer.stage import WORKERS_ENV, workers

GOLDEN = Path(__file__).with_name("golden") / "data_path.json"
MAX_LEN = 10
# What spaCy and sentencepiece find hard: quotes, umlauts, ß, runs of spaces, empty and over-long lines.
TRICKY = [
    ("Sie sagt: „Guten Morgen!“", 'She says "good morning!"'),
    ("Straße  und   Fußball, oder?", "Street  and   football, right?"),
    ("Ärzte (mit Mütze) zahlen 2,50 €.", "Doctors (in caps) pay $2.50."),
    ("", "An empty source."),
    ("Ein Satz.", "   "),
    (" ".join(["lang"] * 12) + ".", "Long."),
    ("Er wartet – wie immer – am Bahnhof...", "He waits -- as always -- at the station..."),
    ("geht's gut?", "it's fine, isn't it?"),
]


def _write_raw(raw: Path) -> None:
    pairs = [pair for i, pair in enumerate(toy_pairs(300, seed=5)) for pair in [pair, TRICKY[i % len(TRICKY)]]]
    raw.mkdir()
    for split, rows in (("train", pairs), ("val", pairs[:40])):
        for side, lang in enumerate(("de", "en")):
            (raw / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in rows), encoding="utf-8")


def outputs(tmp: Path, **workers: int) -> dict:  # no workers: the call the one-process code took
    """tokenize's counts, and the sha256 of each file tokenize and build_vocab (BPE and word) write."""
    _write_raw(tmp / "raw")
    found = {
        "counts": tokenize_corpus(tmp / "raw", tmp / "tok", ["train", "val"], ("de", "en"), "train", MAX_LEN, **workers)
    }
    for kind in ("bpe", "word"):
        threads = {"threads": workers["workers"]} if workers else {}
        build_vocabs(tmp / "tok", tmp / kind, ("de", "en"), kind, 100, 2, "train", "val", seed=1, **threads)
    for directory in ("tok", "bpe", "word"):
        found |= {f"{directory}/{p.name}": sha256_file(p) for p in sorted((tmp / directory).iterdir())}
    return found


@pytest.mark.parametrize("workers", [1, 3])
def test_tokenize_and_build_vocab_write_the_golden_bytes_in_chunks_and_workers(workers, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize_module, "CHUNK", 64)  # 10 chunks of train a side, and a short last one
    monkeypatch.setattr(vocab_module, "ENCODE_CHUNK", 64)
    assert outputs(tmp_path, workers=workers) == json.loads(GOLDEN.read_text(encoding="utf-8"))


def _die(task):
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would


@pytest.mark.timeout(120)
def test_a_tokenize_worker_killed_midway_stops_the_stage_with_an_error_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize_module, "_tokenize_chunk", _die)
    _write_raw(tmp_path / "raw")
    with pytest.raises(BrokenProcessPool):
        tokenize_corpus(tmp_path / "raw", tmp_path / "tok", ["train"], ("de", "en"), "train", MAX_LEN, workers=2)


def test_workers_are_the_usable_cores_unless_the_environment_names_a_number(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert workers() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert workers() == 3


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_a_worker_count_that_is_no_positive_number_is_a_config_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, value)
    with pytest.raises(ConfigError, match=f"TRANSFORMER_WORKERS: .* got '{value}'"):
        workers()


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found = outputs(Path(tmp))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{GOLDEN}: written with {tokenize_module.__file__}", file=sys.stderr)
