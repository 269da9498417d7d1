"""Scale-out (issue 20): several nodes without a shared disk, every rank's RNG across a resume,
the final upload after the collective work, validation pairs longer than train.max_tokens."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from conftest import BIN, ROOT, free_port, run, tiny_params, toy_pairs, train_options, train_outputs
from transformer import checkpoints

# Dropout on, so that every rank draws random numbers; 600 pairs make 6 updates an epoch on 2 ranks.
DDP_RUN = {"train.nproc": 2, "train.epochs": 10, "train.save_every": 4, "model.dropout": 0.1}


def _env(**extra: str) -> dict:
    """One thread per process, as torchrun sets for several processes a node and not for one:
    1 node x 2 processes and 2 nodes x 1 process then sum in the same order, bit for bit."""
    return os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PET_MASTER_PORT": str(free_port()),
                         "OMP_NUM_THREADS": "1"} | extra


def _write_params(directory: Path, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump(tiny_params(**overrides)))
    return path


def _train_cmd(params: Path, vocab: Path, out: Path) -> list[str]:
    return ["stages/train.py", "--params", str(params), "--vocab", str(vocab), *train_options(out),
            "--references", str(vocab.parent / "toy" / "val.en"), "--no-track"]


def _torchrun(nnodes: int, nproc: int, node_rank: int = 0, endpoint: str | None = None) -> list[str]:
    cmd = [str(BIN / "torchrun"), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    if endpoint:
        cmd += ["--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "scale"]
    return cmd


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoints.load(checkpoints.listed(out / "ckpt")[-1])["model"]


def _wait_for_checkpoint(ckpt_dir: Path, step: int, jobs: list[subprocess.Popen]) -> None:
    """Blocks until a checkpoint of at least `step` exists (the signal to kill), or a job ended."""
    deadline = time.time() + 180
    while not any(int(p.stem.split("_")[1]) >= step for p in checkpoints.listed(ckpt_dir)):
        assert all(j.poll() is None for j in jobs), "a job ended before the checkpoint to kill after"
        assert time.time() < deadline, f"no checkpoint of step {step} within 180 s"
        time.sleep(0.02)


def _kill_9(jobs: list[subprocess.Popen]) -> None:
    """SIGKILL to every process of every job (launcher and workers), as a power loss would."""
    procs = [psutil.Process(j.pid) for j in jobs]
    procs += [c for p in procs for c in p.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    for j in jobs:
        j.wait()


@pytest.fixture(scope="module")
def ddp_vocab(tmp_path_factory) -> Path:
    from conftest import write_toy_corpus
    from transformer.tokenize import tokenize_corpus
    from transformer.vocab import build_vocabs

    tmp = tmp_path_factory.mktemp("scale_vocab")
    raw = write_toy_corpus(tmp / "toy", {"train": 600, "val": 40}).parent
    tokenize_corpus(raw, tmp / "tok", ["train", "val"], ("de", "en"), "train", 100)
    build_vocabs(tmp / "tok", tmp / "vocab", ("de", "en"), "bpe", 120, 1, "train", "val")
    return tmp / "vocab"


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, ddp_vocab) -> Path:
    """One uninterrupted 2-process run with dropout: the weights every resumed run must end with."""
    out = tmp_path_factory.mktemp("scale_reference")
    run(_torchrun(1, 2) + _train_cmd(_write_params(out, **DDP_RUN), ddp_vocab, out), ROOT, env=_env())
    return out


@pytest.mark.slow
def test_two_ranks_with_dropout_resume_after_kill_9_to_bit_identical_weights(tmp_path, ddp_vocab, ddp_reference):
    """Each rank draws its own dropout masks; after the resume each must continue its own stream."""
    params = _write_params(tmp_path, **DDP_RUN)
    cmd = _torchrun(1, 2) + _train_cmd(params, ddp_vocab, tmp_path)
    job = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_checkpoint(tmp_path / "ckpt", 8, [job])  # step 8: mid-epoch 2, after dropout on both ranks
    _kill_9([job])
    assert checkpoints.listed(tmp_path / "ckpt")[-1].name < checkpoints.listed(ddp_reference / "ckpt")[-1].name

    resumed = run(cmd, ROOT, env=_env())
    assert "resuming from" in resumed.stderr
    expected, actual = _final_weights(ddp_reference), _final_weights(tmp_path)
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


@pytest.mark.slow
def test_two_nodes_without_a_shared_disk_resume_after_kill_9_to_bit_identical_weights(tmp_path, ddp_vocab, ddp_reference):
    """Node 0 keeps the checkpoints and sends the resume state; node 1's directory stays empty."""
    nodes = [tmp_path / f"node{i}" for i in (0, 1)]
    for node in nodes:  # each node its own copy of the inputs: nothing is shared but the network
        shutil.copytree(ddp_vocab, node / "vocab")
        shutil.copytree(ddp_vocab.parent / "toy", node / "toy")
        _write_params(node, **DDP_RUN | {"train.nproc": 1, "train.nnodes": 2})

    def start() -> list[subprocess.Popen]:
        endpoint = f"127.0.0.1:{free_port()}"
        return [subprocess.Popen(_torchrun(2, 1, i, endpoint) + _train_cmd(node / "params.yaml", node / "vocab", node),
                                 cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i, node in enumerate(nodes)]

    jobs = start()
    _wait_for_checkpoint(nodes[0] / "ckpt", 8, jobs)
    _kill_9(jobs)
    assert checkpoints.listed(nodes[0] / "ckpt")[-1].name < checkpoints.listed(ddp_reference / "ckpt")[-1].name

    jobs = start()
    outputs = [j.communicate(timeout=300)[0] for j in jobs]
    assert [j.returncode for j in jobs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "resuming from" in outputs[0]
    assert not checkpoints.listed(nodes[1] / "ckpt") and not (nodes[1] / "reports").exists()
    expected, actual = _final_weights(ddp_reference), _final_weights(nodes[0])
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


@pytest.mark.slow
def test_nodes_with_other_params_or_dvc_beyond_node_0_are_refused_at_start_up(tmp_path, ddp_vocab):
    nodes = [tmp_path / f"node{i}" for i in (0, 1)]
    _write_params(nodes[0], **{"train.nnodes": 2})
    _write_params(nodes[1], **{"train.nnodes": 2, "train.warmup": 50})
    endpoint = f"127.0.0.1:{free_port()}"
    jobs = [subprocess.Popen(_torchrun(2, 1, i, endpoint) + _train_cmd(node / "params.yaml", ddp_vocab, node), cwd=ROOT,
                             env=_env(DVC_STAGE="train"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, node in enumerate(nodes)]
    outputs = [j.communicate(timeout=240)[0] for j in jobs]
    assert [j.returncode for j in jobs] != [0, 0]
    for output in outputs:
        assert "error: the nodes do not train the same run" in output, output[-3000:]
        assert "rank 1 (node 1" in output and "other data/tokenize/vocab/model/train params" in output
        assert "runs under DVC: run DVC on node 0 only" in output
    assert not (nodes[0] / "ckpt").exists(), "refused before any checkpoint work"


FAKE_TRACKER = '''
import os, sys, time
from pathlib import Path

import torch.distributed as dist

from transformer.config import load_params
from transformer.train import Outputs, train

out = Path(sys.argv[1])


class Recorder:
    """Records, when the first upload starts, whether collectives are still up and rank 1 is done."""

    def __init__(self, experiment, run_id, run_name):
        self.run_id, self.uploads = "fake", []

    def log_params(self, params): pass
    def set_tags(self, tags): pass
    def log_metrics(self, metrics, step): pass

    def log_artifact(self, path, artifact_path=None):
        if not self.uploads:
            deadline = time.time() + 20
            while not (out / "done.1").exists() and time.time() < deadline:
                time.sleep(0.05)
            (out / "upload.txt").write_text(f"{dist.is_initialized()} {(out / 'done.1').exists()}")
        self.uploads.append(path)

    def end(self, status="FINISHED"): pass


reports = out / "reports"
outputs = Outputs(out / "ckpt", reports / "train_steps.tsv", reports / "train_epochs.tsv", reports / "train.json")
train(load_params(sys.argv[2]), Path(sys.argv[3]), outputs, Recorder)
(out / f"done.{os.environ['RANK']}").write_text("")
'''


@pytest.mark.slow
def test_final_upload_starts_after_every_rank_has_left_the_collectives(tmp_path, ddp_vocab):
    script = tmp_path / "train_with_recorder.py"
    script.write_text(FAKE_TRACKER)
    params = _write_params(tmp_path, **{"train.nproc": 2, "train.epochs": 1, "train.max_steps": 2})
    run(_torchrun(1, 2) + [str(script), str(tmp_path), str(params), str(ddp_vocab)], ROOT, env=_env())
    assert (tmp_path / "upload.txt").read_text() == "False True", "rank 0 uploaded while the process group was up"


def test_validation_batches_put_pairs_longer_than_max_tokens_alone():
    from transformer.train import validation_batches

    src_lens = torch.tensor([5, 30, 4, 6, 50, 7, 3])
    tgt_lens = torch.tensor([6, 4, 5, 40, 3, 5, 4])
    batches = validation_batches(src_lens, tgt_lens, 20)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert sorted(b for b in batches if len(b) == 1 and max(src_lens[b[0]], tgt_lens[b[0]]) > 20) == [[1], [3], [4]]
    for b in batches:
        if not any(max(src_lens[i], tgt_lens[i]) > 20 for i in b):
            assert max(max(src_lens[i], tgt_lens[i]) for i in b) * len(b) <= 20


def test_validation_pair_longer_than_max_tokens_does_not_stop_the_first_epoch(tmp_path):
    from transformer.batching import ParallelCorpus
    from transformer.config import params_from_dict
    from transformer.tokenize import tokenize_corpus
    from transformer.train import train
    from transformer.vocab import build_vocabs

    raw = tmp_path / "raw"
    raw.mkdir()
    long_pair = toy_pairs(1, seed=9)[0]
    long_pair = (" ".join([long_pair[0][:-1]] * 12) + ".", " ".join([long_pair[1][:-1]] * 12) + ".")
    for split, pairs in {"train": toy_pairs(300, seed=0), "val": toy_pairs(20, seed=1) + [long_pair]}.items():
        for side, lang in enumerate(("de", "en")):
            (raw / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs))
    tokenize_corpus(raw, tmp_path / "tok", ["train", "val"], ("de", "en"), "train", 100)
    build_vocabs(tmp_path / "tok", tmp_path / "vocab", ("de", "en"), "bpe", 120, 1, "train", "val")
    max_tokens = 40
    valid = ParallelCorpus(tmp_path / "vocab" / "val.pt")
    assert int(torch.maximum(valid.src_lens, valid.tgt_lens).max()) > max_tokens, "the long pair must exceed max_tokens"

    params = params_from_dict(tiny_params(**{"train.epochs": 1, "train.max_tokens": max_tokens}))
    summary = train(params, tmp_path / "vocab", train_outputs(tmp_path))
    assert summary["epochs"] == 1 and math.isfinite(summary["val_loss"])


def test_each_rank_restores_its_own_rng_state():
    state = {"cpu": [], "cuda": [None, None]}
    for seed in (1, 2):
        torch.manual_seed(seed)
        state["cpu"].append(checkpoints.rng_state(torch.device("cpu"))["cpu"])
    for rank, seed in enumerate((1, 2)):
        checkpoints.restore_rng(state, rank, torch.device("cpu"))
        drawn = torch.rand(3)
        torch.manual_seed(seed)
        assert torch.equal(drawn, torch.rand(3))
