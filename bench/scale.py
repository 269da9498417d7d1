"""The data path at WMT14 scale: download, tokenize, build_vocab and the train stage's start-up.

Run from the repository root (the full size wants about 6 GB of disk; --pairs for small runs):

    python -m bench.scale [--pairs 4500000] [--work /tmp/transformer-scale] [--out reports/scale.json]

It writes a synthetic parallel corpus of WMT14 en-de's size (4.5M training pairs, 3000
validation, 3003 test), registers it as a local corpus, and runs the real stage scripts on
it with the wmt14_en_de_base preset (joint BPE 37000, tokenize.max_len 250), each in a
process of its own: wall time (Python's start-up included), CPU time and peak RSS per
stage, and the load average, since other processes stretch wall time on a shared machine.
The train stage's start-up is what train() does before its first update: load the
vocabulary and the token ids (train and valid), fingerprint them, and plan one epoch's
batches for train.nproc x nnodes ranks. It also reports how much of its memory is the
token-id file, mapped, and so shared by the ranks of a node through the page cache.

The corpus, seeded: sentence lengths from a log-normal chosen to match WMT14 en-de's
figures (about 140M tokens a side over 4.5M pairs, so ~31 tokens a sentence once
punctuation is split off: median 23 words, mean ~27, a tail past 100), the target's
length correlated with the source's; words drawn by Zipf's law (s = 1.07) from 1,000,000
invented words a language, shortest most frequent (3-4 letters a token), German-like
ones with umlauts and ß; a capital first word, commas, a full stop or a question mark.
It has WMT's sizes, not its text: spaCy and sentencepiece see simpler words than real ones.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[1]

PRESET = ROOT / "params" / "wmt14_en_de_base.yaml"
CORPUS = "synthetic_wmt14"
SPLITS = {"val": 3000, "test2014": 3003}
TYPES = 1_000_000  # invented words per language (WMT14 has about this many distinct tokens a side)
SYLLABLES = {
    "en": ["th", "er", "an", "re", "on", "at", "en", "nd", "st", "es", "ing", "ou", "ea", "al", "it", "ed"],
    "de": ["ch", "er", "en", "ei", "ie", "sch", "un", "st", "ge", "ä", "ö", "ü", "ß", "au", "ung", "te"],
}


@functools.cache
def words(lang: str) -> list[str]:
    """TYPES distinct invented words of 2 syllables or more, shortest first (frequent words are short)."""
    rng, found, length = random.Random(lang), {}, 2
    syllables = SYLLABLES[lang] + list("aeioubdfgklmnprstvwz")
    while len(found) < TYPES:
        for _ in range(TYPES):
            found.setdefault("".join(rng.choices(syllables, k=length)))
        length += 1
    return list(found)[:TYPES]


def write_side(path: Path, lengths, lang: str, seed: int) -> None:
    """One side of a split: a sentence of each length, words drawn by Zipf's law."""
    import numpy as np

    rng, vocab = np.random.default_rng(seed), words(lang)
    cdf = np.cumsum(1.0 / np.arange(1, TYPES + 1) ** 1.07)
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, len(lengths), 100_000):
            chunk = lengths[start : start + 100_000]
            ids = np.searchsorted(cdf, rng.random(int(chunk.sum())) * cdf[-1]).tolist()
            commas = (rng.random(len(ids)) < 0.08).tolist()
            ends = (rng.random(len(chunk)) < 0.9).tolist()
            lines, at = [], 0
            for n, end in zip(chunk.tolist(), ends):
                toks = [vocab[i] + "," if c else vocab[i] for i, c in zip(ids[at : at + n], commas[at : at + n])]
                toks[-1] = toks[-1].rstrip(",") + ("." if end else " ?")
                toks[0] = toks[0].capitalize()
                lines.append(" ".join(toks))
                at += n
            f.write("\n".join(lines) + "\n")


def generated(work: Path, pairs: int) -> dict[str, float]:
    """generate(), unless `work` holds what this script wrote for `pairs` pairs already: the corpus depends
    on nothing else (its seeds are fixed), and the download stage checks it against the registry's sha256.
    Wall and CPU time, and whether it was reused."""
    from transformer.io import sha256_file

    stamp, key = work / "corpus.json", {"pairs": pairs, "script_sha256": sha256_file(__file__)}
    start, cpu = time.perf_counter(), time.process_time()
    reused = stamp.exists() and json.loads(stamp.read_text()) == key and (work / "corpora.yaml").exists()
    if not reused:
        stamp.unlink(missing_ok=True)  # written last: a generation cut short is never reused
        generate(work, pairs)
        stamp.write_text(json.dumps(key), encoding="utf-8")
    return {
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
        "reused": reused,
    }


def generate(work: Path, pairs: int) -> Path:
    """The corpus files and a registry naming them (local paths, sha256 pinned); returns the registry."""
    import numpy as np

    from transformer.io import sha256_file

    rng = np.random.default_rng(0)
    entry = {}
    for split, n in {"train": pairs, **SPLITS}.items():
        src_len = np.clip(np.rint(rng.lognormal(np.log(23), 0.6, n)), 1, 400).astype(np.int64)
        tgt_len = np.clip(np.rint(src_len * rng.lognormal(0, 0.15, n)), 1, 400).astype(np.int64)
        entry[split] = {}
        for lang, lengths, seed in (("en", src_len, 1), ("de", tgt_len, 2)):
            path = work / "corpus" / f"{split}.{lang}"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_side(path, lengths, lang, seed + 10 * len(entry))
            entry[split][lang] = [{"path": str(path), "sha256": sha256_file(path)}]
    registry = work / "corpora.yaml"
    registry.write_text(yaml.safe_dump({CORPUS: entry}), encoding="utf-8")
    return registry


# Runs a script as its own __main__ and, at exit, reports its peak RSS (VmHWM: this process's
# own, unlike ru_maxrss, which also counts the copy of the parent that fork made before exec),
# and the largest peak of the processes it started and waited for (tokenize's workers).
_PEAK = (
    "import atexit, resource, runpy, sys\n"
    "def peak():\n"
    "    hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "    print('peak_kb', hwm.split()[1], kids, file=sys.stderr)\n"
    "atexit.register(peak)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def measured(args: list[str]) -> dict[str, float]:
    """Runs a script to the end: wall time, CPU time (its children's too) and peak RSS."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", _PEAK, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise click.ClickException(f"{' '.join(args)} failed:\n{output[-3000:]}")
    lines = output.strip().splitlines()
    peak_kb, workers_kb = (int(kb) for kb in next(line for line in lines if line.startswith("peak_kb")).split()[1:])
    row = {
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_gb": round(peak_kb / 2**20, 2),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }
    if workers_kb:  # a worker's pages shared with the stage's process count in both
        row["worker_peak_rss_gb"] = round(workers_kb / 2**20, 2)
    extra = next((json.loads(line) for line in lines if line.startswith("{")), {})
    return row | extra


def startup(params_path: Path, vocab_dir: Path) -> dict[str, float]:
    """What train() does before its first update, on one rank; the CPU seconds of each part."""
    from transformer.config import load_params
    from transformer.data.batching import ParallelCorpus, epoch_steps, token_batches
    from transformer.data.vocab import load_vocabs
    from transformer.training.train import data_fingerprint

    params, times, tick = load_params(params_path), {}, time.process_time()

    def lap(name: str) -> None:  # CPU seconds: on a shared machine, wall time mostly measures the others
        nonlocal tick
        times[name] = round(time.process_time() - tick, 2)
        tick = time.process_time()

    load_vocabs(vocab_dir)
    corpus, valid = ParallelCorpus(vocab_dir / "train.pt"), ParallelCorpus(vocab_dir / f"{params.data.valid}.pt")
    lap("load_s")
    data_fingerprint(vocab_dir, "train")
    lap("fingerprint_s")
    p = params.train
    batches = token_batches(corpus.src_lens, corpus.tgt_lens, p.max_tokens, p.seed * 100_003)
    groups = epoch_steps(batches, 1, p.nproc * p.nnodes * p.accum, 0)
    lap("batch_plan_s")
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    rss = {k: round(int(status[k].split()[0]) / 2**20, 2) for k in ("RssAnon", "RssFile") if k in status}
    return times | {
        "pairs": len(corpus),
        "valid_pairs": len(valid),
        "batches": len(batches),
        "updates": len(groups),
        "rss_anon_gb": rss.get("RssAnon"),
        "rss_file_gb": rss.get("RssFile"),
    }


@click.command()
@click.option("--pairs", default=4_500_000, show_default=True, help="training pairs to generate")
@click.option("--work", default=Path("/tmp/transformer-scale"), type=click.Path(path_type=Path), show_default=True)
@click.option("--out", default=Path("reports/scale.json"), type=click.Path(path_type=Path), show_default=True)
@click.option(
    "--startup-of", type=click.Path(path_type=Path), hidden=True, help="(internal) a vocab dir: time start-up"
)
@click.option("--params", "params_path", type=click.Path(path_type=Path), hidden=True)
def main(pairs: int, work: Path, out: Path, startup_of: Path | None, params_path: Path | None) -> None:
    if startup_of:  # the child process that times the train stage's start-up
        click.echo(json.dumps(startup(params_path, startup_of)))
        return
    from transformer.evaluation.system import host_class
    from transformer.io import write_json
    from transformer.presets import recipe
    from transformer.stage import workers

    work.mkdir(parents=True, exist_ok=True)
    load_before = round(os.getloadavg()[0], 1)
    rows = {"generate": generated(work, pairs)}
    params = recipe(PRESET.stem, ROOT)  # a preset holds only what it changes from params.yaml
    params["data"].update(corpus=CORPUS, registry=str(work / "corpora.yaml"))
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    p = ["--params", str(work / "params.yaml")]
    stages = {
        "download": ["stages/download.py", *p, "--out", str(work / "raw")],
        "tokenize": [
            "stages/tokenize_corpus.py",
            *p,
            "--raw",
            str(work / "raw"),
            "--out",
            str(work / "tok"),
            "--report",
            str(work / "tokenize.json"),
        ],
        "build_vocab": ["stages/build_vocab.py", *p, "--tokenized", str(work / "tok"), "--out", str(work / "vocab")],
        "train_startup": ["bench/scale.py", *p, "--startup-of", str(work / "vocab")],
    }
    for name, args in stages.items():
        rows[name] = measured(args)
        click.echo(f"{name}: {rows[name]}", err=True)
    report = {
        "pairs": pairs,
        "hardware": host_class(),
        "cpu_flags": _cpu_flags(),
        "workers": workers(),  # the stages' TRANSFORMER_WORKERS
        "load_avg_1m_at_start": load_before,
        "bench_peak_rss_gb": _own_peak_gb(),  # the generator's, mostly
        "stages": rows,
        "corpus_bytes": sum(f.stat().st_size for f in (work / "corpus").iterdir()),
    }
    write_json(out, report)
    click.echo(json.dumps(report, indent=1))


def _own_peak_gb() -> float:
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
    return round(int(hwm.split()[1]) / 2**20, 2)


def _cpu_flags() -> str:
    from transformer.evaluation.system import cpuinfo

    flags = cpuinfo().get("flags", "").split()
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags)


if __name__ == "__main__":
    main()
