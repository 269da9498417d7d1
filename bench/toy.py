"""The toy project the test suite and bench/soak.py run the pipeline on: a learnable toy corpus, tiny
params, a fresh git + DVC copy of the project, and the helpers that run and compare it."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

# The processes a toy run starts (stages, torchrun ranks) run tiny models, and toy runs go side by side
# (`make test` runs a pytest worker per core, the soak its rounds): with torch's default of a thread
# per core each, two threads share every core and torch's parallel ops wait on the descheduled one.
# One thread a process; a value set by whoever runs them is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DVC = str(BIN / "dvc")
SRC_WORDS = [f"{c}{v}n" for c in "bdfgklmprst" for v in "aeiou"][:40]
LEXICON = dict(zip(SRC_WORDS, [f"{v}{c}" for c in "bdfgklmprst" for v in "aeiou"][:40]))


def toy_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """A word-for-word translation through a fixed dictionary: learnable in seconds."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = rng.choices(SRC_WORDS, k=rng.randint(3, 7))
        pairs.append((" ".join(words) + ".", " ".join(LEXICON[w] for w in words) + "."))
    return pairs


def write_toy_corpus(directory: Path, splits: dict[str, int] | None = None, langs=("de", "en")) -> Path:
    """Raw files plus a registry (local paths, sha256 pinned); returns the registry path."""
    splits = splits or {"train": 1500, "val": 60, "test2016": 60}
    directory.mkdir(parents=True, exist_ok=True)
    entry = {}
    for seed, (split, n) in enumerate(splits.items()):
        pairs = toy_pairs(n, seed)
        entry[split] = {}
        for side, lang in enumerate(langs):
            path = directory / f"{split}.{lang}"
            path.write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")
            entry[split][lang] = [{"path": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}]
    registry = directory / "corpora.yaml"
    registry.write_text(yaml.safe_dump({"toy": entry}), encoding="utf-8")
    return registry


# tiny_params's changes to params.yaml: the toy corpus, a tiny model, short training.
TINY_PARAMS = {
    "data.corpus": "toy",
    "data.registry": "toy/corpora.yaml",
    "vocab.kind": "bpe",
    "vocab.size": 120,
    "model.N": 1,
    "model.d_model": 32,
    "model.d_ff": 64,
    "model.h": 2,
    "model.dropout": 0.0,
    "train.max_tokens": 400,
    "train.epochs": 12,
    "train.factor": 1.0,
    "train.warmup": 100,
    "train.cooldown": 0.0,
    "train.keep": 3,
    "train.precision": "fp32",
    "train.rdrop": 0.0,
    "train.rdrop_share": 1.0,
    "train.weight_decay": 0.0,
    "average.last_k": 2,
    "decode.beam": 2,
    "decode.alpha": 1.0,
}


def tiny_params(**overrides) -> dict:
    """The default params with a tiny model and short training; overrides as {'train.epochs': 2}.

    The choices tuned on real data (the cooldown, α) are pinned, so retuning a recipe does not move
    the tests; the tests that are about them set them.
    """
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key, value in (TINY_PARAMS | overrides).items():
        section, name = key.split(".")
        params[section][name] = value
    return params


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_env(**extra: str) -> dict[str, str]:
    """A subprocess's environment: this one, with the venv's tools first on PATH, this checkout's package
    first on the import path (a venv installed from another checkout must not run its code instead), and
    a free port for torchrun's master (two tests running at once must not both take its default), then
    `extra`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    tools = {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": path}
    return os.environ | tools | {"PET_MASTER_PORT": str(free_port())} | extra


def run(
    cmd: list[str],
    cwd: Path,
    check: bool = True,
    timeout: int = 300,
    env: dict | None = None,
    input_text: str | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    stdin = {"input": input_text} if input_text is not None else {"stdin": subprocess.DEVNULL}
    full_env = tool_env(**(env or {}))
    result = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env, preexec_fn=preexec_fn, **stdin
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def project_copy(tmp_path: Path, params: dict) -> Path:
    """A fresh git + DVC repository holding the project and the toy corpus."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "stages", "transformer", "reports/reference"):
        src = ROOT / name
        (
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
            if src.is_dir()
            else shutil.copy(src, repo / name)
        )
    write_toy_corpus(repo / "toy")
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / ".gitignore").write_text("mlflow.db\nmlartifacts/\n")
    git = ["git", "-c", "user.name=Test", "-c", "user.email=test@example.com"]
    run(["git", "init", "-q"], repo)
    run(["git", "config", "user.name", "Test"], repo)
    run(["git", "config", "user.email", "test@example.com"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo)
    run([str(BIN / "dvc"), "config", "core.analytics", "false"], repo)
    run(["git", "add", "-A"], repo)
    run(git + ["commit", "-qm", "toy project"], repo)
    return repo


def mlflow_client(repo: Path):
    """A client of the repo's mlflow.db, where the stages log."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")


def same_values(a, b) -> bool:
    """Exact equality of nested dicts and lists of tensors and numbers."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b


# The pipeline tests' and the soak's toy run: short training, checkpoints mid-epoch, two averaged.
SMALL = {"train.epochs": 3, "train.save_every": 10, "average.last_k": 2}


# model.pt's record of one run, not of its result: the keys two runs of the same work may differ in.
RUN_RECORD = ("mlflow_run_id", "train_time_s")


def clean_run(directory: Path) -> Path:
    """One clean `dvc repro` of the toy project at SMALL's settings, in `directory`: the pipeline tests' run,
    and the one a fingerprint is taken of."""
    repo = project_copy(directory, tiny_params(**SMALL))
    run([DVC, "repro"], repo, timeout=1200)
    return repo


def fingerprint(repo: Path) -> str:
    """sha256 of what a finished toy run computed: the averaged model's weights and the translations. Any
    change to the code's numerics on a host class (a kernel, an op's order, the search) shows in it, and
    two clean runs on one class agree, so it tells whether today's code still makes a committed run."""
    import torch

    found = hashlib.sha256()
    weights = torch.load(repo / "data/model/model.pt", weights_only=True)["model"]
    for name, tensor in sorted(weights.items()):
        found.update(name.encode())
        found.update(tensor.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    for path in sorted((repo / "data/translations").glob("*.txt")):
        found.update(path.read_bytes())
    return found.hexdigest()


def tree(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def start_repro(repo: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [DVC, "repro"],
        cwd=repo,
        env=tool_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # its own process group: the kill takes the stage with it
