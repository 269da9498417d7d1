"""Scale-out (issue 20): several nodes without a shared disk, every rank's RNG across a resume,
the final upload after the collective work, validation pairs longer than train.max_tokens;
the loss's host sync, the Annotated Transformer's dropouts and smoothing, a reproducible BPE
sample, IWSLT14's split, and safe downloads, names and model files."""

from __future__ import annotations

import contextlib
import gzip
import io
import math
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import (
    ROOT,
    free_port,
    run,
    tgz,
    tiny_model,
    tiny_model_file,
    tiny_params,
    tool_env,
    torchrun,
    toy_pairs,
    train_cmd,
    train_outputs,
    write_params,
)

from transformer import checkpoints
from transformer.config import ConfigError, params_from_dict
from transformer.data.download import MIRROR_ENV, download_corpus, load_registry
from transformer.data.vocab import PAD, BpeVocab, WordVocab
from transformer.decoding.translate import Translator
from transformer.io import DataError
from transformer.kernels.accelerate import accelerate
from transformer.kernels.loss import FusedLoss
from transformer.model.attention import MultiHeadAttention
from transformer.model.layers import FeedForward
from transformer.model.model import check_model_config
from transformer.presets import names, recipe
from transformer.training.loss import Loss, smoothed_cross_entropy

# Dropout on, so that every rank draws random numbers; 600 pairs make 6 updates an epoch on 2 ranks.
DDP_RUN = {"train.nproc": 2, "train.epochs": 10, "train.save_every": 4, "model.dropout": 0.1}


def _env(**extra: str) -> dict:
    """One thread per process, as torchrun sets for several processes a node and not for one:
    1 node x 2 processes and 2 nodes x 1 process then sum in the same order, bit for bit."""
    return tool_env(OMP_NUM_THREADS="1", **extra)


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoints.load(checkpoints.listed(out / "ckpt")[-1])["model"]


def _wait_for_checkpoint(ckpt_dir: Path, step: int, jobs: list[subprocess.Popen]) -> None:
    """Blocks until a checkpoint of at least `step` exists (the signal to kill), or a job ended."""
    deadline = time.time() + 600  # a hang guard, not a speed test: the machine may be loaded
    while not any(int(p.stem.split("_")[1]) >= step for p in checkpoints.listed(ckpt_dir)):
        assert all(j.poll() is None for j in jobs), "a job ended before the checkpoint to kill after"
        assert time.time() < deadline, f"no checkpoint of step {step} within 600 s"
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
    from conftest import toy_vocab

    return toy_vocab(tmp_path_factory.mktemp("scale_vocab"))


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, ddp_vocab) -> Path:
    """One uninterrupted 2-process run with dropout: the weights every resumed run must end with."""
    out = tmp_path_factory.mktemp("scale_reference")
    run(torchrun(1, 2) + train_cmd(write_params(out, **DDP_RUN), ddp_vocab, out), ROOT, env=_env())
    return out


@pytest.mark.slow
def test_two_ranks_with_dropout_resume_after_kill_9_to_bit_identical_weights(tmp_path, ddp_vocab, ddp_reference):
    """Each rank draws its own dropout masks; after the resume each must continue its own stream."""
    params = write_params(tmp_path, **DDP_RUN)
    cmd = torchrun(1, 2) + train_cmd(params, ddp_vocab, tmp_path)
    job = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_checkpoint(tmp_path / "ckpt", 8, [job])  # step 8: mid-epoch 2, after dropout on both ranks
    _kill_9([job])
    assert checkpoints.listed(tmp_path / "ckpt")[-1].name < checkpoints.listed(ddp_reference / "ckpt")[-1].name

    resumed = run(cmd, ROOT, env=_env())
    assert "resuming from" in resumed.stderr
    expected, actual = _final_weights(ddp_reference), _final_weights(tmp_path)
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


@pytest.mark.slow
def test_two_nodes_without_a_shared_disk_resume_after_kill_9_to_bit_identical_weights(
    tmp_path, ddp_vocab, ddp_reference
):
    """Node 0 keeps the checkpoints and sends the resume state; node 1's directory stays empty."""
    nodes = [tmp_path / f"node{i}" for i in (0, 1)]
    for node in nodes:  # each node its own copy of the inputs: nothing is shared but the network
        shutil.copytree(ddp_vocab, node / "vocab")
        shutil.copytree(ddp_vocab.parent / "toy", node / "toy")
        write_params(node, **DDP_RUN | {"train.nproc": 1, "train.nnodes": 2})

    def start() -> list[subprocess.Popen]:
        port = free_port()
        return [
            subprocess.Popen(
                torchrun(2, 1, i, port) + train_cmd(node / "params.yaml", node / "vocab", node),
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, node in enumerate(nodes)
        ]

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
    write_params(nodes[0], **{"train.nnodes": 2})
    write_params(nodes[1], **{"train.nnodes": 2, "train.warmup": 50})
    port = free_port()
    jobs = [
        subprocess.Popen(
            torchrun(2, 1, i, port) + train_cmd(node / "params.yaml", ddp_vocab, node),
            cwd=ROOT,
            env=_env(DVC_STAGE="train"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, node in enumerate(nodes)
    ]
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
from transformer.training.train import Outputs, train

out = Path(sys.argv[1])


class Recorder:
    """Records, when the first upload starts, whether collectives are still up and rank 1 is done."""

    def __init__(self, experiment, run_id=None, run_name=None, parent_run_id=None):
        self.run_id, self.uploads = "fake", []

    def log_params(self, params): pass
    def set_tags(self, tags): pass
    def log_metrics(self, metrics, step): pass
    def log_rows(self, rows): pass
    def watch_system(self, resumed): pass

    def log_artifact(self, path, artifact_path=None):
        if not self.uploads:
            deadline = time.time() + 300  # a hang guard: rank 1 is done within a second on an idle machine
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
    params = write_params(tmp_path, **{"train.nproc": 2, "train.epochs": 1, "train.max_steps": 2})
    run(torchrun(1, 2) + [str(script), str(tmp_path), str(params), str(ddp_vocab)], ROOT, env=_env())
    assert (tmp_path / "upload.txt").read_text() == "False True", "rank 0 uploaded while the process group was up"


def test_validation_batches_put_pairs_longer_than_max_tokens_alone():
    from transformer.training.validation import validation_batches

    src_lens = torch.tensor([5, 30, 4, 6, 50, 7, 3])
    tgt_lens = torch.tensor([6, 4, 5, 40, 3, 5, 4])
    batches = validation_batches(src_lens, tgt_lens, 20)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert sorted(b for b in batches if len(b) == 1 and max(src_lens[b[0]], tgt_lens[b[0]]) > 20) == [[1], [3], [4]]
    for b in batches:
        if not any(max(src_lens[i], tgt_lens[i]) > 20 for i in b):
            assert max(max(src_lens[i], tgt_lens[i]) for i in b) * len(b) <= 20


def test_validation_pair_longer_than_max_tokens_does_not_stop_the_first_epoch(tmp_path):
    from transformer.config import params_from_dict
    from transformer.data.batching import ParallelCorpus
    from transformer.data.tokenize import tokenize_corpus
    from transformer.data.vocab import build_vocabs
    from transformer.training.train import train

    raw = tmp_path / "raw"
    raw.mkdir()
    long_pair = toy_pairs(1, seed=9)[0]
    long_pair = (" ".join([long_pair[0][:-1]] * 12) + ".", " ".join([long_pair[1][:-1]] * 12) + ".")
    for split, pairs in {"train": toy_pairs(300, seed=0), "val": toy_pairs(20, seed=1) + [long_pair]}.items():
        for side, lang in enumerate(("de", "en")):
            (raw / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs))
    tokenize_corpus(raw, tmp_path / "tok", ["train", "val"], ("de", "en"), "train", 100)
    build_vocabs(tmp_path / "tok", tmp_path / "vocab", ("de", "en"), "bpe", 120, 1, "train", "val", seed=1)
    max_tokens = 40
    valid = ParallelCorpus(tmp_path / "vocab" / "val.pt")
    assert int(torch.maximum(valid.src_lens, valid.tgt_lens).max()) > max_tokens, "the long pair must exceed max_tokens"

    params = params_from_dict(tiny_params(**{"train.epochs": 1, "train.max_tokens": max_tokens}))
    (summary,) = train(params, tmp_path / "vocab", train_outputs(tmp_path))
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


# Helper c20b: defects 4, 6, 7, 8 and 9.

V = 20


def _tiny(**kw) -> torch.nn.Module:
    return tiny_model(src_vocab=V, tgt_vocab=V, tie_embeddings=True, **kw)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (3, 7), generator=g)
    tgt = torch.randint(4, V, (3, 6), generator=g)
    src[0, 5:], tgt[1, 3:], tgt[2, 5:] = PAD, PAD, PAD
    return src, tgt[:, :-1], tgt[:, 1:]


# Defect 4: the loss syncs with the host on every GPU micro-batch.


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("zero_pad", [False, True])
def test_loss_over_all_positions_with_pads_ignored_equals_the_loss_over_selected_positions(smoothing, zero_pad):
    torch.manual_seed(0)
    model = _tiny(dropout=0.0).eval()
    _, _, tgt_out = _batch()
    hidden = torch.randn(*tgt_out.shape, 16)
    cpu = accelerate(Loss(PAD, smoothing, zero_pad), torch.device("cpu"))
    assert isinstance(cpu, FusedLoss)  # the CPU's loss, on the non-pad positions alone
    selected = cpu(model.generator, hidden, tgt_out)
    every = Loss(PAD, smoothing, zero_pad)(model.generator, hidden, tgt_out)  # an accelerator's: every position
    assert torch.allclose(selected, every, rtol=1e-6, atol=0)
    assert selected.item() > 0


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cpu_loss_is_bit_identical_to_the_boolean_indexing_formulation(smoothing):
    # the plain loss; test_loss holds the fused one to it
    torch.manual_seed(0)
    model = _tiny(dropout=0.0).eval()
    _, _, tgt_out = _batch()
    hidden = torch.randn(*tgt_out.shape, 16)
    keep = tgt_out != PAD
    before = F.cross_entropy(
        model.generator(hidden[keep]).float(), tgt_out[keep], reduction="sum", label_smoothing=smoothing
    )
    assert torch.equal(Loss(PAD, smoothing)(model.generator, hidden, tgt_out), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_loss_runs_without_a_host_sync_and_matches_the_cpu():
    torch.manual_seed(0)
    model = _tiny(dropout=0.0).eval()
    _, _, tgt_out = _batch()
    hidden = torch.randn(*tgt_out.shape, 16)
    cpu = accelerate(Loss(PAD, 0.1, True), torch.device("cpu"))(model.generator, hidden, tgt_out)
    model.cuda()
    hidden, tgt_out = hidden.cuda(), tgt_out.cuda()
    loss = accelerate(Loss(PAD, 0.1, True), hidden.device)  # what CUDA training takes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        gpu = loss(model.generator, hidden, tgt_out)
        with pytest.raises(RuntimeError, match="synchroniz"):
            model.generator(hidden[tgt_out != PAD])  # what the loss did before
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(gpu.cpu(), cpu, rtol=1e-5)


# Defect 9: the Annotated Transformer's attention dropout, feed-forward dropout and pad-free smoothing.


def _train_step(model: torch.nn.Module, seed: int, smoothing_zeroes_pad: bool = False) -> tuple[torch.Tensor, list]:
    src, tgt_in, tgt_out = _batch()
    torch.manual_seed(seed)
    model.train()
    hidden = model(src, tgt_in)
    loss = Loss(PAD, 0.1, smoothing_zeroes_pad)(model.generator, hidden, tgt_out)
    loss.backward()
    return hidden.detach(), [p.grad.clone() for p in model.parameters()]


def test_new_dropouts_at_zero_train_exactly_as_the_model_without_them(monkeypatch):
    torch.manual_seed(3)
    new = _tiny(dropout=0.1, attn_dropout=0.0, ff_dropout=0.0)
    old = _tiny(dropout=0.1)
    old.load_state_dict(new.state_dict())
    hidden_new, grads_new = _train_step(new, seed=7)
    # The forward passes as they were before these params existed: no dropout in either place.
    monkeypatch.setattr(FeedForward, "forward", lambda self, x: self.w_2(torch.relu(self.w_1(x))))
    monkeypatch.setattr(
        MultiHeadAttention,
        "attend",
        lambda self, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask.keys, is_causal=mask.causal),
    )
    hidden_old, grads_old = _train_step(old, seed=7)
    assert torch.equal(hidden_new, hidden_old)
    assert all(torch.equal(a, b) for a, b in zip(grads_new, grads_old))


@pytest.mark.parametrize("written_out", [False, True], ids=["torch's kernel", "written out"])
@pytest.mark.parametrize("param", ["attn_dropout", "ff_dropout"])
def test_each_new_dropout_acts_in_training_only(param, written_out):
    torch.manual_seed(3)
    plain, dropped = _tiny(dropout=0.0), _tiny(dropout=0.0, **{param: 0.5})
    dropped.load_state_dict(plain.state_dict())
    for model in (plain, dropped) if written_out else ():  # CPU bf16 training's attention (CpuAttention)
        accelerate(model, torch.device("cpu"))  # is written out, its dropout with it
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=written_out):
        assert not torch.equal(_train_step(plain, seed=7)[0], _train_step(dropped, seed=7)[0])
        src, tgt_in, _ = _batch()
        assert torch.equal(plain.eval()(src, tgt_in), dropped.eval()(src, tgt_in))


def test_pad_free_smoothing_is_the_annotated_transformers_label_smoothing():
    torch.manual_seed(0)
    smoothing, n = 0.1, 5
    logits, target = torch.randn(n, V), torch.tensor([5, 6, PAD, 1, 9])
    # Its LabelSmoothing: smoothing / (V - 2) everywhere, the confidence on the gold token,
    # nothing on the pad column, nothing for a pad target; here as cross-entropy, not KL.
    true_dist = torch.full((n, V), smoothing / (V - 2))
    true_dist.scatter_(1, target[:, None], 1 - smoothing)
    true_dist[:, PAD] = 0
    true_dist[target == PAD] = 0
    expected = -(true_dist * logits.log_softmax(-1)).sum()
    assert torch.allclose(smoothed_cross_entropy(logits, target, PAD, smoothing, zero_pad=True), expected, rtol=1e-6)
    assert not torch.allclose(smoothed_cross_entropy(logits, target, PAD, smoothing), expected, rtol=1e-4)


def _preset(name: str) -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text()) if name == "params" else recipe(name, ROOT)


@pytest.mark.parametrize("name", ["params"] + names(ROOT))
def test_only_the_annotated_transformer_preset_uses_its_dropouts_and_pad_free_smoothing(name):
    p = _preset(name)
    m, t = p["model"], p["train"]
    if name == "annotated_transformer":
        assert m["attn_dropout"] == m["ff_dropout"] == m["dropout"] > 0 and t["smoothing_zeroes_pad"] is True
    else:
        assert m["attn_dropout"] == m["ff_dropout"] == 0 and t["smoothing_zeroes_pad"] is False


# Defect 6: the WMT14 vocabulary comes from a sample of its lines, drawn unseeded.


def _sampled_corpus(n: int) -> list[str]:
    rng = random.Random(0)
    words = [f"{a}{b}{c}" for a in "bdgkmpst" for b in "aeiou" for c in "lnrx"]
    return [" ".join(rng.choices(words, weights=range(len(words), 0, -1), k=rng.randint(3, 12))) for _ in range(n)]


def _build_in_a_process_of_its_own(corpus: Path, out: Path, seed: int) -> bytes:
    # sentencepiece's own sampler drew the same lines within a process and others in the next
    # one: only separate processes show whether a build repeats.
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\nfrom transformer.data.vocab import BpeVocab\n"
        f"lines = open({str(corpus)!r}, encoding='utf-8').read().splitlines()\n"
        f"open({str(out)!r}, 'wb').write(BpeVocab.train(lines, 150, seed={seed}, sample=300).proto)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    return out.read_bytes()


@pytest.mark.slow
def test_bpe_vocabulary_from_a_sampled_corpus_is_byte_identical_for_one_seed(tmp_path):
    corpus = tmp_path / "train.txt"
    corpus.write_text("\n".join(_sampled_corpus(3000)) + "\n", encoding="utf-8")  # 10 samples' worth
    first, second = (_build_in_a_process_of_its_own(corpus, tmp_path / name, seed=5) for name in ("a", "b"))
    assert first == second
    other = BpeVocab.train(_sampled_corpus(3000), 150, seed=6, sample=300)
    assert [other.sp.id_to_piece(i) for i in range(len(other))] != [
        BpeVocab(first).sp.id_to_piece(i) for i in range(len(other))
    ]


# Defect 7: IWSLT14 split as fairseq's prepare-iwslt14.sh splits it.


def _ted_train(lang: str, talks: int, per_talk: int) -> tuple[str, list[str]]:
    """train.tags as the IWSLT archive lays it out, and the lines fairseq keeps from it."""
    raw, kept = [], []
    for t in range(talks):
        raw += [
            f"<url>http://www.ted.com/talks/{t}.html</url>",
            f"<keywords>talks, {lang}</keywords>",
            f"<speaker>Speaker {t}</speaker>",
            f"<talkid>{t}</talkid>",
            f"<title>Title {t} {lang}</title>",
            f"<description>About {t} {lang}</description>",
        ]
        kept += [f"<speaker>Speaker {t}</speaker>", f"Title {t} {lang}", f"About {t} {lang}"]
        body = [f"talk {t} line {i} {lang}" for i in range(per_talk)]
        raw, kept = raw + body, kept + body
    return "\n".join(raw) + "\n", kept


def _ted_xml(name: str, lang: str, n: int) -> tuple[str, list[str]]:
    segs = [f"{name} {lang} {i} &amp; more" for i in range(n)]
    body = "".join(f'<seg id="{i}"> {s} </seg>\n' for i, s in enumerate(segs, 1))
    text = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n<refset setid="iwslt2014-{name}" srclang="german">\n'
        f'<doc docid="1" genre="lectures">\n<url>http://www.ted.com/talks/x.html</url>\n<talkid>1</talkid>\n{body}</doc>\n'
        f"</refset>\n</mteval>\n"
    )
    return text, [s.replace("&amp;", "&") for s in segs]


def test_iwslt14_splits_as_fairseq_test_is_five_sets_val_every_23rd_training_line(tmp_path, monkeypatch):
    members, expected = {}, {}
    sizes = {"TED.dev2010": 7, "TEDX.dev2012": 5, "TED.tst2010": 4, "TED.tst2011": 3, "TED.tst2012": 6}
    for lang in ("de", "en"):
        members[f"de-en/train.tags.de-en.{lang}"], kept = _ted_train(lang, talks=5, per_talk=20)
        expected[f"val.{lang}"] = [line for i, line in enumerate(kept, 1) if i % 23 == 0]
        expected[f"train.{lang}"] = [line for i, line in enumerate(kept, 1) if i % 23]
        expected[f"test.{lang}"] = []
        for name, n in sizes.items():  # fairseq's order: dev2010, TEDX.dev2012, tst2010, tst2011, tst2012
            members[f"de-en/IWSLT14.{name}.de-en.{lang}.xml"], segs = _ted_xml(name, lang, n)
            expected[f"test.{lang}"] += segs
    tgz(tmp_path / "mirror/iwslt14/de-en.tgz", members)
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    counts = download_corpus(ROOT / "transformer/corpora.yaml", "iwslt14", ("de", "en"), tmp_path / "raw")
    assert counts["test.de"] == sum(sizes.values()) and counts["val.en"] == 115 // 23
    for name, lines in expected.items():
        assert (tmp_path / "raw" / name).read_text(encoding="utf-8").split("\n")[:-1] == lines, name


# Defect 8: https, decompression caps, bounded model configs, safe path components.


def _registry(tmp_path: Path, sources: dict[str, list[dict]], corpus: str = "c") -> Path:
    path = tmp_path / "corpora.yaml"
    path.write_text(yaml.safe_dump({corpus: {"train": sources}}), encoding="utf-8")
    return path


def test_every_shipped_corpus_url_is_https():
    registry = yaml.safe_load((ROOT / "transformer/corpora.yaml").read_text())
    urls = [
        s["url"] for entry in registry.values() for langs in entry.values() for srcs in langs.values() for s in srcs
    ]
    assert urls and all(url.startswith("https://") for url in urls)
    for corpus in registry:
        load_registry(ROOT / "transformer/corpora.yaml", corpus)  # passes its own checks


def test_plain_http_without_a_pinned_checksum_is_refused(tmp_path):
    sources = {"de": [{"url": "http://example.org/a.gz", "sha256": None}]}
    with pytest.raises(DataError, match="use https") as e:
        load_registry(_registry(tmp_path, sources), "c")
    assert "c.train.de" in str(e.value)
    pinned = {"de": [{"url": "http://example.org/a.gz", "sha256": "0" * 64}]}
    load_registry(_registry(tmp_path, pinned), "c")  # the checksum vouches for the bytes


@pytest.mark.parametrize(
    "sources, message",
    [
        ({"../de": [{"url": "https://example.org/a.gz", "sha256": None}]}, "become file names"),
        ({"de": [{"url": "https://example.org/..", "sha256": None}]}, "not a safe file name"),
        ({"de": [{"url": "https://example.org/a.gz", "sha256": None, "keep_every": 1}]}, "integer >= 2"),
    ],
)
def test_registry_names_that_would_escape_the_output_directory_are_refused(tmp_path, sources, message):
    with pytest.raises(DataError, match=message):
        load_registry(_registry(tmp_path, sources), "c")


def _mirror_download(tmp_path: Path, monkeypatch, name: str, data: bytes, **extra) -> None:
    import hashlib

    (tmp_path / "mirror/c").mkdir(parents=True, exist_ok=True)
    (tmp_path / "mirror/c" / name).write_bytes(data)
    source = {"url": f"https://example.org/{name}", "sha256": hashlib.sha256(data).hexdigest(), **extra}
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    download_corpus(_registry(tmp_path, {"de": [source], "en": [source]}), "c", ("de", "en"), tmp_path / "raw")


def test_gzip_bomb_is_refused_with_one_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr("transformer.data.download.MAX_BYTES", 1 << 20)
    bomb = gzip.compress(b"\n" * (8 << 20), mtime=0)  # 8 MiB of newlines in about 8 KiB
    with pytest.raises(DataError, match="decompression bomb") as e:
        _mirror_download(tmp_path, monkeypatch, "bomb.gz", bomb)
    assert "bomb.gz" in str(e.value)
    assert not (tmp_path / "raw").exists()
    _mirror_download(tmp_path, monkeypatch, "fine.gz", gzip.compress(b"ein Satz\n" * 1000, mtime=0))  # under the cap


def test_archive_member_beyond_the_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr("transformer.data.download.MAX_BYTES", 1 << 20)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("corpus/train.txt")
        info.size = 2 << 20
        tar.addfile(info, io.BytesIO(b"x\n" * (1 << 20)))
    with pytest.raises(DataError, match="decompression bomb") as e:
        _mirror_download(tmp_path, monkeypatch, "big.tgz", buffer.getvalue(), member="corpus/train.txt")
    assert "big.tgz" in str(e.value) and "corpus/train.txt" in str(e.value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("data.corpus", "../elsewhere"),
        ("data.src_lang", "d/e"),
        ("data.tgt_lang", ".."),
        ("data.valid", "-val"),
        ("decode.testsets", ["val", "../../etc/x"]),
    ],
)
def test_params_that_become_path_components_are_checked_by_key(key, value):
    raw = _preset("params")
    section, name = key.split(".")
    raw[section][name] = value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        params_from_dict(raw)


def _model_file(tmp_path: Path, **config_changes) -> Path:
    vocab = WordVocab(["<s>", "</s>", "<blank>", "<unk>"] + [f"w{i}" for i in range(8)])
    params = params_from_dict(_preset("params")).to_dict()
    path = tiny_model_file(tmp_path / "model.pt", vocab, vocab, params, dropout=0.1)
    checkpoint = checkpoints.load(path)
    checkpoints.save(path, checkpoint | {"model_config": checkpoint["model_config"] | config_changes})
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"N": 10**7}, "out of range"),
        ({"decoder_N": 10**7}, "out of range"),
        ({"decoder_N": -1}, "out of range"),
        ({"decoder_N": 2}, "do not fit"),  # the file holds one decoder layer
        ({"d_model": 2**16}, "do not fit"),  # built for real: 51 GB of attention weights alone
        ({"d_model": 2**40}, "do not fit"),  # too large even for shapes
        ({"d_ff": "32"}, "'d_ff' = '32' is not int"),
        ({"norm": "both"}, "out of range"),
        ({"hidden": 3}, "unknown keys"),
    ],
)
def test_model_file_config_is_bounded_before_a_model_is_built(tmp_path, changes, message):
    path = _model_file(tmp_path, **changes)
    with pytest.raises(DataError, match=message) as e:
        Translator(path, device="cpu")
    assert str(path) in str(e.value)


def test_model_file_written_before_the_dropout_params_still_loads(tmp_path):
    path = _model_file(tmp_path)
    ckpt = checkpoints.load(path)
    assert "attn_dropout" not in ckpt["model_config"]
    args = check_model_config(ckpt["model_config"], ckpt["model"], str(path))
    assert args["attn_dropout"] == args["ff_dropout"] == 0.0
    assert "decoder_N" not in ckpt["model_config"] and args["decoder_N"] == 0  # as deep as the encoder
