"""What building the training batches costs the host: microseconds a sentence, over an epoch's
token batches, of this tree's ParallelCorpus.batch and, side by side in the same process, of the
one in another commit (--before REV, read with `git show`, so no copy of old code lives here).

Run from the repository root (under a minute on 2 cores):

    python bench/batches.py [--vocab-dir data/vocab] [--before cf0f1b6^] [--rounds 3] [--out FILE]

The corpus is data/vocab's train.pt with --vocab-dir, else bench.py's synthetic Multi30k-like
one; the batches are the default recipe's (train.max_tokens, token_batches). The versions take
turns, --rounds times each over every batch; the median round counts. Every batch the two build
must be equal, tensor for tensor, or the script stops. The step loop's own wait for its batches
(built ahead by a thread, batching.Prefetch) is recorded by every training run: batch_wait_s in
reports/train/train.json, batch_wait_ms in MLflow.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from transformer.data.batching import token_batches  # noqa: E402
from transformer.io import write_json  # noqa: E402


def batching_at(rev: str):
    """transformer/data/batching.py as commit `rev` had it, imported as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:transformer/data/batching.py"],
        cwd=bench.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType(f"batching_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up there
    exec(compile(source, f"{rev}:transformer/data/batching.py", "exec"), module.__dict__)
    return module


def us_a_sentence(corpus, index: list[list[int]]) -> float:
    """One round: every batch of `index` built once; microseconds a sentence."""
    start = time.perf_counter()
    for rows in index:
        corpus.batch(rows)
    return 1e6 * (time.perf_counter() - start) / sum(map(len, index))


def same_batches(a, b, index: list[list[int]]) -> bool:
    for rows in index:
        x, y = a.batch(rows), b.batch(rows)
        sides = zip((x.src, x.tgt_in, x.tgt_out), (y.src, y.tgt_in, y.tgt_out))
        if x.ntokens != y.ntokens or not all(p.equal(q) for p, q in sides):
            return False
    return True


@click.command()
@click.option("--vocab-dir", type=click.Path(path_type=Path), help="build_vocab's output (default: synthetic data)")
@click.option("--before", "rev", default="cf0f1b6^", show_default=True, help="the commit to compare with")
@click.option("--rounds", default=3, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), help="also write the figures here (JSON)")
def main(vocab_dir: Path | None, rev: str, rounds: int, out: Path | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = bench.load_data(vocab_dir, Path(tmp))
        path = (vocab_dir / "train.pt") if vocab_dir else Path(tmp) / "synthetic.pt"
        corpora = {"now": data.corpus, rev: batching_at(rev).ParallelCorpus(path)}
        index = token_batches(data.corpus.src_lens, data.corpus.tgt_lens, bench.PARAMS.train.max_tokens, bench.SEED)
        if not same_batches(corpora["now"], corpora[rev], index):
            raise click.ClickException(f"the batches differ from {rev}'s")
        times = {name: [] for name in corpora}
        for _ in range(rounds):
            for name, corpus in corpora.items():
                times[name].append(us_a_sentence(corpus, index))
    report = {
        "corpus": data.origin,
        "batches": len(index),
        "sentences": sum(map(len, index)),
        "us_a_sentence": {name: round(statistics.median(t), 2) for name, t in times.items()},
        "machine": bench.machine(),
    }
    report["speedup"] = round(report["us_a_sentence"][rev] / report["us_a_sentence"]["now"], 2)
    click.echo(json.dumps(report, indent=1))
    if out:
        write_json(out, report)


if __name__ == "__main__":
    main()
