"""Training: it learns, it resumes bit-identically, and DDP splits work without changing it."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    DataDependentOps,
    HostReads,
    free_port,
    run,
    same_values,
    tiny_model,
    tiny_params,
    tool_env,
    torchrun,
    train_cmd,
    train_outputs,
    write_params,
)

from transformer import checkpoints
from transformer.config import params_from_dict
from transformer.errors import DataError
from transformer.training.schedule import rate


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoints.load(checkpoints.listed(out / "ckpt")[-1])["model"]


def _without_key_biases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drops the key-projection biases. They add one constant to all scores of a query, which
    softmax cancels: their true gradient is 0, and Adam (eps 1e-9) turns the last-bit noise of a
    different summation order into full-size steps. They cannot change any output."""
    out = dict(state)
    for name, value in state.items():
        if name.endswith("qkv.bias"):  # [q | k | v]
            d = value.numel() // 3
            out[name] = torch.cat([value[:d], value[2 * d :]])
        elif name.endswith("kv.bias"):  # [k | v]
            out[name] = value[value.numel() // 2 :]
    return out


def _assert_same_training(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    a, b = _without_key_biases(a), _without_key_biases(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, f"parameters differ by up to {worst}"


def test_copy_task_learns_exact_copies_in_a_few_hundred_updates(tmp_path):
    from conftest import toy_pairs

    from transformer.data.tokenize import tokenize_corpus
    from transformer.data.vocab import build_vocabs
    from transformer.decoding.translate import Search, Translator
    from transformer.training.train import train

    raw = tmp_path / "raw"
    raw.mkdir()
    for split, n in (("train", 4000), ("val", 30)):
        src = [p[0] for p in toy_pairs(n, seed=len(split))]
        for lang in ("de", "en"):
            (raw / f"{split}.{lang}").write_text("\n".join(src) + "\n")
    tokenize_corpus(raw, tmp_path / "tok", ["train", "val"], ("de", "en"), "train", 100)
    build_vocabs(tmp_path / "tok", tmp_path / "vocab", ("de", "en"), "word", 0, 1, "train", "val", seed=1)
    # 4,000 sentences, 6 epochs (852 updates): from 800 sentences, at 26 to 40 epochs, a fifth to a third
    # of the seeds left one or two of the 30 copies confused (a repeated word confused, a last word
    # dropped), whatever the epochs: the model had learnt its 800 sentences more than copying. A host
    # class's kernels, or any change to the loss's rounding, draws another such seed.
    params = params_from_dict(
        tiny_params(
            **{
                "vocab.kind": "word",
                "model.tie_embeddings": False,
                "model.N": 2,
                "model.d_model": 64,
                "model.d_ff": 128,
                "train.epochs": 6,
                "train.max_tokens": 200,
                "train.factor": 1.0,
                "train.label_smoothing": 0.0,
                "train.cooldown": 0.5,
            }
        )
    )
    (summary,) = train(params, tmp_path / "vocab", train_outputs(tmp_path))
    assert summary["steps"] < 900  # a few hundred updates: seconds on an idle CPU
    assert summary["val_loss"] < 0.01  # nats per token
    checkpoints.save(tmp_path / "model.pt", checkpoints.average_checkpoints(tmp_path / "ckpt", 3))
    translator = Translator(tmp_path / "model.pt", device="cpu")
    sources = (tmp_path / "tok" / "val.de").read_text().splitlines()
    search = Search(beam=1, alpha=0.6, max_len_extra=50, batch_tokens=6000)
    assert translator.translate_tokenized(sources, search) == (raw / "val.en").read_text().splitlines()


def test_training_writes_checkpoints_reports_and_keeps_the_last_k(tmp_path, vocab_dir):
    params = write_params(tmp_path, **{"train.epochs": 4, "train.keep": 2})
    run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    names = [p.name for p in checkpoints.listed(tmp_path / "ckpt")]
    assert len(names) == 2
    steps = (tmp_path / "reports" / "train_steps.tsv").read_text().splitlines()
    epochs = (tmp_path / "reports" / "train_epochs.tsv").read_text().splitlines()
    assert steps[0].split("\t") == ["step", "loss", "lr", "tokens_per_s"] and len(steps) > 10
    assert len(epochs) == 1 + 4
    assert float(epochs[-1].split("\t")[3]) < float(epochs[1].split("\t")[3])  # val loss falls


def test_rdrop_trains_reproducibly_and_otherwise_than_one_pass(tmp_path, vocab_dir):
    from transformer.training.train import train

    def trained(name: str, rdrop: float, shared_encoder: bool = False, share: float = 1.0) -> dict:
        params = params_from_dict(
            tiny_params(
                **{
                    "train.epochs": 3,
                    "train.rdrop": rdrop,
                    "model.dropout": 0.1,
                    "train.rdrop_shared_encoder": shared_encoder,
                    "train.rdrop_share": share,
                }
            )
        )
        (summary,) = train(params, vocab_dir, train_outputs(tmp_path / name))
        assert summary["val_loss"] < 4.0  # nats per token: it learns (uniform over the toy vocabulary: ~4.8)
        return _final_weights(tmp_path / name)

    rdrop, again, one_pass = trained("rdrop", 5.0), trained("again", 5.0), trained("one_pass", 0.0)
    shared, shared_again = trained("shared", 5.0, True), trained("shared_again", 5.0, True)
    assert all(torch.equal(rdrop[k], again[k]) for k in rdrop)
    assert all(torch.equal(shared[k], shared_again[k]) for k in shared)
    assert not all(torch.equal(rdrop[k], one_pass[k]) for k in rdrop)
    assert not all(torch.equal(shared[k], rdrop[k]) for k in rdrop)
    assert not all(torch.equal(shared[k], one_pass[k]) for k in rdrop)
    partial, partial_again = trained("partial", 5.0, share=0.5), trained("partial_again", 5.0, share=0.5)
    assert all(torch.equal(partial[k], partial_again[k]) for k in partial)
    assert not all(torch.equal(partial[k], rdrop[k]) for k in rdrop)
    assert not all(torch.equal(partial[k], one_pass[k]) for k in rdrop)


def test_partial_rdrop_killed_mid_epoch_resumes_to_bit_identical_weights(tmp_path, vocab_dir, monkeypatch, capsys):
    """The sentences passed twice are drawn from torch's generator, which a checkpoint keeps."""
    import transformer.training.train as train_module

    params = params_from_dict(
        tiny_params(
            **{
                "train.epochs": 2,
                "train.rdrop": 5.0,
                "train.rdrop_share": 0.5,
                "model.dropout": 0.1,
                "train.save_every": 5,
            }
        )
    )
    train_module.train(params, vocab_dir, train_outputs(tmp_path / "whole"))
    update = train_module.Trainer._update

    def dying(loop, group):
        if loop.progress.step == 17:  # inside the second epoch (12 updates each), after the checkpoint of step 15
            raise RuntimeError("killed")
        update(loop, group)

    monkeypatch.setattr(train_module.Trainer, "_update", dying)
    with pytest.raises(RuntimeError, match="killed"):
        train_module.train(params, vocab_dir, train_outputs(tmp_path / "killed"))
    monkeypatch.setattr(train_module.Trainer, "_update", update)
    capsys.readouterr()
    train_module.train(params, vocab_dir, train_outputs(tmp_path / "killed"))
    assert "(step 15, epoch 2)" in capsys.readouterr().err  # resumed mid-epoch, not started afresh
    expected, actual = _final_weights(tmp_path / "whole"), _final_weights(tmp_path / "killed")
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


def test_rdrop_from_turns_rdrop_on_for_the_last_updates_only(tmp_path, vocab_dir, monkeypatch):
    import transformer.training.train as train_module

    alphas = []

    def recording(*args, rdrop=0.0, **kwargs):
        alphas.append(rdrop)
        return batch_loss(*args, rdrop=rdrop, **kwargs)

    batch_loss = train_module.batch_loss
    monkeypatch.setattr(train_module, "batch_loss", recording)
    params = params_from_dict(
        tiny_params(**{"train.epochs": 4, "train.rdrop": 5.0, "train.rdrop_from": 0.6, "model.dropout": 0.1})
    )
    (summary,) = train_module.train(params, vocab_dir, train_outputs(tmp_path / "late"))
    updates = summary["steps"]
    assert len(alphas) == updates > 10  # one micro-batch an update
    first = math.ceil(0.6 * updates)
    assert alphas == [0.0] * first + [5.0] * (updates - first)


def test_weight_decay_shrinks_weight_matrices_and_leaves_norms_and_biases():
    from transformer.training.train import make_optimizer

    torch.manual_seed(0)
    model = tiny_model(src_vocab=30, tgt_vocab=30, tie_embeddings=True)
    assert type(make_optimizer(model, 0.0, torch.device("cpu"))) is torch.optim.Adam  # the paper's, as before
    optimizer = make_optimizer(model, 0.1, torch.device("cpu"))
    before = {name: w.detach().clone() for name, w in model.named_parameters()}
    for w in model.parameters():
        w.grad = torch.zeros_like(w)  # Adam's own step is then 0: what moves is the decay alone
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    optimizer.step()
    for name, w in model.named_parameters():
        expected = before[name] * (1 - 0.5 * 0.1) if w.dim() > 1 else before[name]
        assert torch.allclose(w, expected, rtol=1e-6, atol=0), name
    assert any(w.dim() > 1 for w in model.parameters()) and any(w.dim() == 1 for w in model.parameters())


_FAULTS_OF_FRESH_BLOCKS = """
import json, resource, torch
import transformer.training.train  # the process training runs in: what it maps decides where the heap can grow
from transformer.kernels.memory import keep_freed_memory

def faults_of_a_fresh_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 * 2**20 // 4)  # 64 MiB, over glibc's largest mmap threshold, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults = {}
for keep in (False, True):
    assert keep_freed_memory(keep)
    faults_of_a_fresh_block(), faults_of_a_fresh_block()  # with keep, the heap grows to hold it
    faults[str(keep)] = faults_of_a_fresh_block()
print(json.dumps(faults))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's settings are glibc's")
def test_kept_memory_serves_the_next_large_block_without_page_faults():
    # In a fresh process: the settings are the process's, and a test worker's history changes what
    # they do (after a failed allocation glibc moves the main thread to an arena of at most 64 MiB,
    # which maps every larger block afresh whatever mallopt says).
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS_OF_FRESH_BLOCKS], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    faults = json.loads(done.stdout)
    assert faults["False"] > 10_000  # glibc's defaults: mapped anew, every 4 KiB page faults in again
    assert faults["True"] < 1_000  # kept: the freed block serves the next


def test_cpu_training_hands_freed_memory_back_every_release_every_updates(tmp_path, vocab_dir, monkeypatch):
    import transformer.training.train as train_module

    released = []
    monkeypatch.setattr(train_module, "RELEASE_EVERY", 3)
    monkeypatch.setattr(train_module, "release_freed_memory", lambda: released.append(1))
    params = params_from_dict(tiny_params(**{"train.epochs": 2}))
    updates = train_module.train(params, vocab_dir, train_outputs(tmp_path / "run"))[0]["steps"]
    assert updates >= 6 and len(released) == updates // 3


def test_training_with_glibcs_default_allocation_is_bit_identical(tmp_path, vocab_dir, monkeypatch):
    import transformer.training.train as train_module

    params = params_from_dict(tiny_params(**{"train.epochs": 2, "model.dropout": 0.1}))
    train_module.train(params, vocab_dir, train_outputs(tmp_path / "kept"))
    keep, asked = train_module.keep_freed_memory, []

    def glibcs_defaults(keep_: bool = True) -> bool:
        asked.append(keep_)
        return keep(False)

    monkeypatch.setattr(train_module, "keep_freed_memory", glibcs_defaults)
    try:
        train_module.train(params, vocab_dir, train_outputs(tmp_path / "default"))
    finally:
        keep()
    assert asked == [True]
    kept, default = _final_weights(tmp_path / "kept"), _final_weights(tmp_path / "default")
    assert all(torch.equal(kept[k], default[k]) for k in kept)


@pytest.mark.parametrize(
    "capability, cpuinfo_bf16, bf16",
    [
        ("AVX512", True, True),  # AVX-512 cores with bf16: torch names them AVX512, cpuinfo tells
        ("AVX512", False, False),  # AVX-512 without bf16
        ("AVX512_VNNI", True, True),  # any AVX-512 level torch may name
        ("AVX2", True, False),  # torch held to AVX2 (ATEN_CPU_CAPABILITY=avx2) would emulate bf16
        ("AVX2", False, False),
        ("AMX", False, True),
    ],
)
def test_auto_precision_picks_bf16_only_where_torch_may_use_bf16_instructions(
    monkeypatch, capability, cpuinfo_bf16, bf16
):
    from transformer.training import distributed

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(distributed, "_cpu_has", lambda flag: cpuinfo_bf16 and flag == "avx512_bf16")
    assert distributed.use_bf16("auto", torch.device("cpu")) is bf16
    assert distributed.use_bf16("fp32", torch.device("cpu")) is False
    assert distributed.use_bf16("bf16", torch.device("cpu")) is True


def test_cooldown_scales_the_last_updates_down_to_nearly_zero():
    plain = [rate(s, 256, 2.0, 10) for s in range(1, 101)]
    cooled = [rate(s, 256, 2.0, 10, total=100, cooldown=0.4) for s in range(1, 101)]
    assert cooled[:61] == plain[:61]  # the last 40 updates cool down
    assert cooled[60] > cooled[61] > cooled[99] and cooled[99] == pytest.approx(plain[99] / 40)


def test_training_cools_down_over_its_last_updates(tmp_path, vocab_dir):
    params = write_params(tmp_path, **{"train.epochs": 3, "train.cooldown": 0.5})
    run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    rows = [line.split("\t") for line in (tmp_path / "reports" / "train_steps.tsv").read_text().splitlines()[1:]]
    steps, lrs = [int(r[0]) for r in rows], [float(r[2]) for r in rows]
    total = steps[-1]  # all 3 epochs: the run knew its length before the first update
    assert steps == list(range(1, total + 1)) and total >= 6
    assert lrs == pytest.approx([rate(s, 32, 1.0, 100, total, 0.5) for s in steps], rel=1e-5)  # the TSV keeps 6 digits
    assert lrs[-1] < 0.2 * rate(total, 32, 1.0, 100)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One reference run for the kill tests: (params, vocabulary, output directory)."""
    from conftest import toy_vocab

    tmp = tmp_path_factory.mktemp("reference")
    toy_vocab(tmp)
    # ~11 ms a step here: 20 epochs (240 steps) outlast the latest kill (step 30 + 0.1 s) several times over
    # Both dropouts draw from torch's generator, which a checkpoint must carry for the resumed run to repeat them.
    params = write_params(
        tmp, **{"train.epochs": 20, "train.save_every": 3, "model.dropout": 0.1, "model.word_dropout": 0.1}
    )
    run(
        [sys.executable] + train_cmd(params, tmp / "vocab", tmp / "out"), ROOT, timeout=1200
    )  # hang guard, not a speed test
    return params, tmp / "vocab", tmp / "out"


# Where the kill lands: (the newest checkpoint step to wait for, or 0 for "as soon as the first epoch
# starts"; then a delay in seconds). With save_every 3 and keep 3: before any checkpoint, just after
# one, between two (a few updates on, ~11 ms each), and late, after older checkpoints were pruned.
KILL_POINTS = {
    "before-any-checkpoint": (0, 0.0),
    "just-after-a-checkpoint": (6, 0.0),
    "between-checkpoints": (9, 0.02),
    "after-pruning": (30, 0.1),
}


@pytest.mark.parametrize("landing", KILL_POINTS)
def test_killed_training_resumes_to_bit_identical_checkpoints_reports_and_average(tmp_path, uninterrupted, landing):
    """SIGKILL at a chosen point, then rerun: every kept checkpoint (weights and optimizer), the epoch
    report and the averaged model equal the uninterrupted run's."""
    import threading

    params, vocab, reference = uninterrupted
    after_step, delay = KILL_POINTS[landing]
    interrupted = tmp_path / "interrupted"
    env = tool_env()
    proc = subprocess.Popen(
        [sys.executable] + train_cmd(params, vocab, interrupted),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = threading.Event()
    threading.Thread(target=_watch_for_first_epoch, args=(proc, started), daemon=True).start()
    assert started.wait(120), "training never started"
    while after_step and not any(_step(p) >= after_step for p in checkpoints.listed(interrupted / "ckpt")):
        assert proc.poll() is None, "training ended before the kill"
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = checkpoints.listed(interrupted / "ckpt")
    assert not before or before[-1].name < checkpoints.listed(reference / "ckpt")[-1].name, (
        "killed too late to test resuming"
    )
    kept_time = checkpoints.load(before[-1], checkpoints.RESUME_KEYS)["wall_s"] if before else 0.0

    timing = tmp_path / "timing.json"
    result = run(
        [sys.executable] + train_cmd(params, vocab, interrupted) + ["--timing", str(timing)], ROOT, timeout=1200
    )
    assert ("resuming from" in result.stderr) == bool(before)
    # The stage's time adds the killed invocation's, up to the checkpoint it resumed from.
    assert json.loads(timing.read_text()).get("resumed_s", 0.0) == round(kept_time, 1)
    kept, expected = checkpoints.listed(interrupted / "ckpt"), checkpoints.listed(reference / "ckpt")
    assert [p.name for p in kept] == [p.name for p in expected]
    for mine, theirs in zip(kept, expected):
        a, b = checkpoints.load(mine, checkpoints.RESUME_KEYS), checkpoints.load(theirs, checkpoints.RESUME_KEYS)
        assert same_values(a["model"], b["model"]) and same_values(a["optimizer"], b["optimizer"]), mine.name
        assert (a["step"], a["epoch"], a["history"]["epochs"]) == (b["step"], b["epoch"], b["history"]["epochs"])
    assert (interrupted / "reports/train_epochs.tsv").read_bytes() == (
        reference / "reports/train_epochs.tsv"
    ).read_bytes()
    averaged = [checkpoints.average_checkpoints(out / "ckpt", 3)["model"] for out in (interrupted, reference)]
    assert same_values(*averaged)
    assert not list((interrupted / "ckpt").glob(".*.tmp"))


def _step(path: Path) -> int:
    return int(checkpoints.PATTERN.match(path.name).group(1))


def _watch_for_first_epoch(proc: subprocess.Popen, started) -> None:
    """Sets `started` when the progress bar of epoch 1 appears; keeps draining stderr."""
    for line in proc.stderr:
        if "epoch 1/" in line:
            started.set()


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """One uninterrupted run with BPE-dropout and a cooldown: (command maker, tokenized text, output, stderr)."""
    from conftest import toy_vocab

    tmp = tmp_path_factory.mktemp("sampled")
    toy_vocab(tmp, train=300)
    params = write_params(
        tmp,
        **{
            "train.epochs": 3,
            "train.save_every": 4,
            "model.dropout": 0.1,
            "train.bpe_dropout": 0.1,
            "train.cooldown": 0.3,
        },
    )

    def cmd(out: Path) -> list[str]:
        return [sys.executable] + train_cmd(params, tmp / "vocab", out) + ["--tokenized", str(tmp / "tok")]

    result = run(cmd(tmp / "out"), ROOT)
    return cmd, tmp / "tok", tmp / "out", result.stderr


def test_bpe_dropout_resegments_every_epoch_and_cools_down_to_the_last_update(sampled):
    _, _, out, stderr = sampled
    assert stderr.count("BPE-dropout 0.1 segmented 300 pairs") == 3
    rows = [line.split("\t") for line in (out / "reports" / "train_steps.tsv").read_text().splitlines()[1:]]
    steps, lrs = [int(r[0]) for r in rows], [float(r[2]) for r in rows]
    total = steps[-1]
    assert steps == list(range(1, total + 1))
    # the last epoch planned with its own length: the cooldown ends exactly at the last update
    assert lrs[-1] == pytest.approx(rate(total, 32, 1.0, 100, total, 0.3), rel=1e-5)


def test_killed_bpe_dropout_training_resumes_to_bit_identical_weights(tmp_path, sampled):
    """Killed in a later epoch, the rerun must cut that epoch's words as the first run did."""
    cmd, _, reference, _ = sampled
    first_epoch = int(
        (reference / "reports" / "train_epochs.tsv").read_text().splitlines()[1].split("\t")[1]
    )  # its updates
    interrupted = tmp_path / "interrupted"
    env = tool_env()
    proc = subprocess.Popen(cmd(interrupted), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        int(p.stem.split("_")[1]) > first_epoch for p in checkpoints.listed(interrupted / "ckpt")
    ):
        time.sleep(0.02)
    time.sleep(0.05)  # killed inside the second epoch
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = checkpoints.load(checkpoints.listed(interrupted / "ckpt")[-1])
    assert killed_at["epoch"] >= 1, "killed before the second epoch: nothing to resegment"
    assert killed_at["step"] < checkpoints.load(checkpoints.listed(reference / "ckpt")[-1])["step"], "killed too late"

    result = run(cmd(interrupted), ROOT)
    assert "resuming from" in result.stderr
    expected, actual = _final_weights(reference), _final_weights(interrupted)
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


def test_bpe_dropout_without_the_tokenized_text_stops_before_training(tmp_path, vocab_dir):
    params = write_params(tmp_path, **{"train.bpe_dropout": 0.1})
    result = run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT, check=False)
    assert result.returncode == 1
    assert "train.bpe_dropout" in result.stderr and "--tokenized" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists()


def test_changed_params_start_afresh_instead_of_resuming(tmp_path, vocab_dir):
    out = tmp_path / "out"
    run([sys.executable] + train_cmd(write_params(tmp_path, **{"train.epochs": 1}), vocab_dir, out), ROOT)
    result = run(
        [sys.executable] + train_cmd(write_params(tmp_path, **{"train.epochs": 1, "train.warmup": 50}), vocab_dir, out),
        ROOT,
    )
    assert "starting afresh" in result.stderr and "resuming" not in result.stderr
    assert checkpoints.load(checkpoints.listed(out / "ckpt")[-1])["params"]["train"]["warmup"] == 50


def test_resume_refuses_changed_data_vocabulary_or_model_shape_in_one_line(tmp_path, vocab_dir):
    """Each change is named in the one line that says the run starts afresh; nothing stale is continued."""
    import shutil

    from transformer.data.vocab import build_vocabs, encode_corpus, load_vocabs
    from transformer.io import read_lines

    out, steps = tmp_path / "out", {"train.epochs": 1, "train.max_steps": 2}
    run([sys.executable] + train_cmd(write_params(tmp_path, **steps), vocab_dir, out), ROOT)
    fewer_pairs = tmp_path / "fewer_pairs"  # the same vocabulary, one training pair less
    shutil.copytree(vocab_dir, fewer_pairs)
    src, tgt = load_vocabs(vocab_dir)
    arrays = {}
    for side, vocab, lang in (("src", src, "de"), ("tgt", tgt, "en")):
        arrays[side], arrays[f"{side}_offsets"] = encode_corpus(
            vocab, read_lines(tmp_path / "tok" / f"train.{lang}")[:-1]
        )
    torch.save(arrays, fewer_pairs / "train.pt")
    other_vocab = tmp_path / "other_vocab"
    build_vocabs(tmp_path / "tok", other_vocab, ("de", "en"), "bpe", 100, 1, "train", "val", seed=1)
    changes = [
        (fewer_pairs, {}, "the training data (token ids) changed"),
        (other_vocab, {}, "the vocabulary (vocab.pt) changed"),
        (other_vocab, {"model.d_ff": 48}, "model.d_ff was 64, now 48"),
        (other_vocab, {"model.d_ff": 48, "model.decoder_N": 2}, "model.decoder_N was 0, now 2"),
    ]
    for vocab, model, why in changes:
        newest = checkpoints.listed(out / "ckpt")[-1]
        result = run([sys.executable] + train_cmd(write_params(tmp_path, **steps, **model), vocab, out), ROOT)
        said = [line for line in result.stderr.splitlines() if "afresh" in line or "resuming" in line]
        aside = max((out / "ckpt.previous").iterdir())  # the newest folder: this restart's
        assert said == [f"{newest}: not resumed, {why}; its run moved to {aside}; starting afresh"], result.stderr
        assert (aside / newest.name).is_file()  # set aside, not deleted
        fresh = checkpoints.load(checkpoints.listed(out / "ckpt")[-1], checkpoints.RESUME_KEYS)
        assert fresh["step"] == 2 and fresh["identity"]["params"]["model"]["d_ff"] == model.get("model.d_ff", 64)
    layers = {name.split(".")[0] + name.split(".")[2] for name in fresh["model"] if ".layers." in name}
    assert layers == {"encoder0", "decoder0", "decoder1"}  # N 1, decoder_N 2: trained as asked


@pytest.mark.slow
def test_two_processes_train_like_one_with_accumulation(tmp_path, vocab_dir):
    """Same global batches: 2 ranks x 1 micro-batch == 1 rank x 2 accumulated (no dropout)."""
    common = {"train.epochs": 1, "train.max_steps": 6, "model.dropout": 0.0}
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = write_params(tmp_path / "one", **common, **{"train.accum": 2})
    two = write_params(tmp_path / "two", **common, **{"train.nproc": 2})
    run([sys.executable] + train_cmd(one, vocab_dir, tmp_path / "one"), ROOT)
    run(torchrun(1, 2) + train_cmd(two, vocab_dir, tmp_path / "two"), ROOT)
    _assert_same_training(_final_weights(tmp_path / "one"), _final_weights(tmp_path / "two"))
    moved = checkpoints.load(checkpoints.listed(tmp_path / "one" / "ckpt")[-1])["step"]
    assert moved == 6
    peaks = {
        n: json.loads((tmp_path / n / "reports" / "train.json").read_text())["peak_rss_mb"] for n in ("one", "two")
    }
    assert list(peaks["one"]) == ["rank_0"] and list(peaks["two"]) == ["rank_0", "rank_1"]
    assert all(100 < mb < 8192 for run in peaks.values() for mb in run.values())  # MiB: each rank's own process


@pytest.mark.slow
def test_two_nodes_rendezvous_on_loopback(tmp_path, vocab_dir):
    """2 nodes x 1 process through a static rendezvous on 127.0.0.1 train like 2 local processes."""
    common = {"train.epochs": 1, "train.max_steps": 4, "model.dropout": 0.0, "train.nnodes": 2}
    params = write_params(tmp_path, **common)
    port = free_port()
    env = tool_env()
    nodes = [
        subprocess.Popen(
            torchrun(2, 1, rank, port) + train_cmd(params, vocab_dir, tmp_path / "nodes"),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    local = tmp_path / "local"
    local.mkdir()
    run(
        torchrun(1, 2)
        + train_cmd(write_params(local, **common | {"train.nnodes": 1, "train.nproc": 2}), vocab_dir, local),
        ROOT,
    )
    _assert_same_training(_final_weights(tmp_path / "nodes"), _final_weights(local))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # fp16: the gradient scaler's skips read with the losses
def test_an_update_reads_nothing_back_and_the_loop_reads_its_losses_once_a_log_interval(
    tmp_path, vocab_dir, monkeypatch, precision
):
    # The reads an accelerator would wait for, counted on the CPU: with the twins CUDA takes (none of the
    # CPU's packing or row selection), as the code runs there. Where CUDA is at hand training runs on
    # it, and torch's sync debug mode fails any sync in an update.
    import transformer.training.train as train_module
    from transformer.kernels.accelerate import accelerate
    from transformer.training.record import RunRecord

    monkeypatch.setattr(train_module, "accelerate", lambda step, device: accelerate(step, torch.device("cuda")))
    monkeypatch.setattr(train_module, "LOG_EVERY", 5)
    reads: dict[str, list[list[str]]] = {"_update": [], "sync": []}
    owners = {"_update": train_module.Trainer, "sync": RunRecord}
    for name, method in [(name, getattr(owners[name], name)) for name in reads]:

        def counted(self, *args, _method=method, _name=name, **kwargs):
            if torch.cuda.is_available() and _name == "_update":
                torch.cuda.set_sync_debug_mode("error")
            try:
                with HostReads() as calls, DataDependentOps() as ops:
                    result = _method(self, *args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("default")
            reads[_name].append(calls.seen + ops.seen)
            return result

        monkeypatch.setattr(owners[name], name, counted)
    overrides = {"train.max_steps": 12, "train.rdrop": 5.0, "train.rdrop_share": 0.5, "model.dropout": 0.1}
    overrides["train.precision"] = precision
    train_module.train(params_from_dict(tiny_params(**overrides)), vocab_dir, train_outputs(tmp_path / "run"))
    assert reads["_update"] == [[]] * 12
    read = [r for r in reads["sync"] if r]
    assert all(r == ["tolist"] for r in read), read  # the pending losses, all in one read
    assert len(read) == math.ceil(12 / 5)  # every 5 updates, and the last two at the end of the run


def test_diverging_loss_stops_with_the_step_and_keeps_finite_checkpoints(tmp_path, vocab_dir):
    # A huge learning rate makes the loss overflow within a few updates: a real divergence.
    params = write_params(tmp_path, **{"train.factor": 1e6, "train.warmup": 1, "train.save_every": 1})
    result = run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT, check=False)
    assert result.returncode == 1
    assert "at step" in result.stderr and ("non-finite" in result.stderr or "error: loss is" in result.stderr)
    assert "Traceback" not in result.stderr
    kept = checkpoints.listed(tmp_path / "ckpt")
    assert kept, "the last good checkpoint must stay"
    for path in kept:
        assert all(torch.isfinite(t).all() for t in checkpoints.load(path)["model"].values() if t.is_floating_point())


def test_unreachable_tracking_server_fails_before_any_training(tmp_path, vocab_dir):
    params = write_params(tmp_path)
    cmd = [sys.executable] + [a for a in train_cmd(params, vocab_dir, tmp_path) if a != "--no-track"]
    result = run(cmd, ROOT, check=False, env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"})
    assert result.returncode == 1
    assert "is unreachable" in result.stderr and "MLFLOW_TRACKING_URI" in result.stderr
    assert not (tmp_path / "ckpt").exists()


def test_rerunning_a_finished_training_changes_nothing_and_its_time_still_counts_the_first_run(tmp_path, vocab_dir):
    params = write_params(tmp_path, **{"train.epochs": 2, "train.max_steps": 5})
    timing = tmp_path / "timing.json"
    run([sys.executable] + train_cmd(params, vocab_dir, tmp_path) + ["--timing", str(timing)], ROOT)
    first, summary = json.loads(timing.read_text()), json.loads((tmp_path / "reports" / "train.json").read_text())
    trained = _final(tmp_path)["wall_s"]
    assert "resumed_s" not in first and summary["resumed_s"] == 0 and 0 < trained < first["wall_s"]
    before = [(p.name, p.stat().st_mtime_ns) for p in checkpoints.listed(tmp_path / "ckpt")]
    epochs = (tmp_path / "reports" / "train_epochs.tsv").read_text()
    result = run([sys.executable] + train_cmd(params, vocab_dir, tmp_path) + ["--timing", str(timing)], ROOT)
    assert "resuming from" in result.stderr
    assert [(p.name, p.stat().st_mtime_ns) for p in checkpoints.listed(tmp_path / "ckpt")] == before
    assert (tmp_path / "reports" / "train_epochs.tsv").read_text() == epochs
    again, summary = json.loads(timing.read_text()), json.loads((tmp_path / "reports" / "train.json").read_text())
    assert again["resumed_s"] == summary["resumed_s"] == round(trained, 1) and again["wall_s"] > again["resumed_s"]
    assert summary["wall_s"] >= round(trained, 1)


def _validations(out: Path) -> list[dict[str, float]]:
    lines = (out / "reports" / "train_epochs.tsv").read_text().splitlines()
    return [dict(zip(lines[0].split("\t"), map(float, line.split("\t")))) for line in lines[1:]]


@pytest.mark.parametrize(
    "bleus, patience, spent",
    [
        ([10.0, 12.0, 11.0, 12.0], 2, True),  # 12.0 again is no rise
        ([10.0, 12.0, 11.0, 12.5], 2, False),
        ([10.0, 12.0, 11.0], 2, False),  # only one validation since the best
        ([10.0, 9.0, 8.0], 2, True),
        ([10.0, 9.0, 8.0], 0, False),  # 0: off
        ([5.0], 1, False),
    ],
)
def test_patience_is_spent_after_that_many_validations_without_a_higher_bleu(bleus, patience, spent):
    from transformer.training.resume import patience_spent

    assert patience_spent(bleus, patience) is spent


def test_val_bleu_equals_the_decode_stages_greedy_bleu_of_the_same_checkpoint(tmp_path, vocab_dir):
    from transformer.decoding.translate import Search, Translator
    from transformer.evaluation.score import score_lines
    from transformer.io import read_lines

    params = write_params(tmp_path, **{"train.epochs": 6, "decode.max_len_extra": 20, "decode.batch_tokens": 150})
    run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    rows = _validations(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5, 6]
    last = checkpoints.listed(tmp_path / "ckpt")[-1]
    sources = read_lines(vocab_dir.parent / "tok" / "val.de")
    greedy = Search(beam=1, alpha=0.0, max_len_extra=20, batch_tokens=150)  # as validation searches
    hyps = Translator(last, device="cpu").translate_tokenized(sources, greedy)
    expected = score_lines(hyps, read_lines(vocab_dir.parent / "toy" / "val.en"), "en", ("bleu",))["bleu"]
    assert rows[-1]["val_bleu"] == pytest.approx(expected, abs=1e-4) and expected > rows[0]["val_bleu"]
    assert json.loads((tmp_path / "reports" / "train.json").read_text())["val_bleu"] == pytest.approx(expected)


def test_eval_every_validates_and_checkpoints_between_epoch_ends_too(tmp_path, vocab_dir):
    params = write_params(tmp_path, **{"train.epochs": 2, "train.eval_every": 4, "train.keep": 20, "average.last_k": 1})
    run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    rows = _validations(tmp_path)
    per_epoch = int(next(r["step"] for r in rows if r["epoch"] == 1))
    between = [s for s in range(4, 2 * per_epoch, 4) if s != per_epoch]
    assert sorted(int(r["step"]) for r in rows) == sorted(between + [per_epoch, 2 * per_epoch])  # no epoch end twice
    assert all(r["epoch"] == pytest.approx(r["step"] / per_epoch, rel=1e-5) for r in rows)  # the TSV keeps 6 digits
    summary = json.loads((tmp_path / "reports" / "train.json").read_text())
    assert all(0 <= r["val_bleu"] <= 100 for r in rows) and rows[-1]["val_bleu"] == summary["val_bleu"]
    assert summary["best_val_bleu"] == max(r["val_bleu"] for r in rows)  # mid-epoch validations count too
    assert [checkpoints.step_of(p) for p in checkpoints.listed(tmp_path / "ckpt")] == sorted(
        int(r["step"]) for r in rows
    )


def test_select_best_keeps_the_best_k_beside_the_last_ones(tmp_path, vocab_dir):
    params = write_params(
        tmp_path,
        **{"train.epochs": 6, "train.keep": 1, "average.select": "best", "average.last_k": 3, "train.factor": 3.0},
    )
    run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    rows = _validations(tmp_path)
    best = checkpoints.best_steps({int(r["step"]): r["val_bleu"] for r in rows}, 3)
    assert [checkpoints.step_of(p) for p in checkpoints.listed(tmp_path / "ckpt")] == sorted(
        set(best) | {int(rows[-1]["step"])}
    )
    assert checkpoints.average_checkpoints(tmp_path / "ckpt", 3, "best")["averaged"] == [
        checkpoints.path_for(Path(), s).name for s in best
    ]


def _stalled(tmp_path: Path, **overrides) -> Path:
    """Params whose learning rate is too small to change any translation: val BLEU never rises."""
    return write_params(tmp_path, **{"train.epochs": 8, "train.factor": 1e-9, "train.patience": 2} | overrides)


def test_patience_stops_training_and_a_rerun_stays_stopped(tmp_path, vocab_dir):
    params = _stalled(tmp_path)
    result = run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    assert "stopping early" in result.stderr
    rows = _validations(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2, 3]  # the best at epoch 1, then 2 validations no higher
    summary = json.loads((tmp_path / "reports" / "train.json").read_text())
    assert summary["stopped_early"] is True and summary["steps"] == rows[-1]["step"]
    before = [(p.name, p.stat().st_mtime_ns) for p in checkpoints.listed(tmp_path / "ckpt")]
    result = run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    assert "resuming from" in result.stderr and "epoch 4/8" not in result.stderr  # no progress bar: no update
    assert [(p.name, p.stat().st_mtime_ns) for p in checkpoints.listed(tmp_path / "ckpt")] == before


def test_patience_counts_validations_from_before_a_resume(tmp_path, vocab_dir):
    """Lose the last checkpoint (as a kill right after it would): the rerun resumes at epoch 2 with
    one validation without a rise in its history, so it stops after epoch 3, as the first run did."""
    params = _stalled(tmp_path)
    run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    first = _validations(tmp_path)
    checkpoints.listed(tmp_path / "ckpt")[-1].unlink()
    result = run([sys.executable] + train_cmd(params, vocab_dir, tmp_path), ROOT)
    assert "resuming from" in result.stderr and "stopping early" in result.stderr
    assert _validations(tmp_path) == first


@pytest.mark.slow
def test_two_processes_stop_early_together(tmp_path, vocab_dir):
    """Rank 0 validates and decides; a rank that missed the decision would wait forever in its next update."""
    params = _stalled(tmp_path, **{"train.nproc": 2})
    result = run(torchrun(1, 2) + train_cmd(params, vocab_dir, tmp_path), ROOT, timeout=240)
    assert "stopping early" in result.stderr
    assert [r["epoch"] for r in _validations(tmp_path)] == [1, 2, 3]


def test_members_train_as_single_runs_of_their_seeds_and_a_new_member_keeps_the_trained_ones(tmp_path, vocab_dir):
    """Member k is the single run of seed train.seed + k, bit for bit; raising train.members trains the new
    members only; the model file holds them all and translates as the ensemble of its members' files."""
    from transformer.decoding.translate import Translator

    common = {"train.epochs": 2}
    ens, alone = tmp_path / "ens", tmp_path / "alone"
    run([sys.executable] + train_cmd(write_params(ens, **common), vocab_dir, ens), ROOT)
    first = [(p.name, p.stat().st_mtime_ns) for p in checkpoints.listed(ens / "ckpt")]
    result = run(
        [sys.executable] + train_cmd(write_params(ens, **common, **{"train.members": 2}), vocab_dir, ens), ROOT
    )
    assert "member 2 of 2: seed 2" in result.stderr
    assert [(p.name, p.stat().st_mtime_ns) for p in checkpoints.listed(ens / "ckpt")] == first
    assert (ens / "ckpt" / "seed2" / "train_epochs.tsv").exists() and not (ens / "reports" / "seed2").exists()
    run([sys.executable] + train_cmd(write_params(alone, **common, **{"train.seed": 2}), vocab_dir, alone), ROOT)
    member = checkpoints.load(checkpoints.listed(ens / "ckpt" / "seed2")[-1])
    single = checkpoints.load(checkpoints.listed(alone / "ckpt")[-1])
    assert same_values(member["model"], single["model"]) and member["params"] == single["params"]
    assert not same_values(member["model"], _final_weights(ens))

    run(
        [
            sys.executable,
            "stages/average_checkpoints.py",
            "--params",
            str(ens / "params.yaml"),
            "--checkpoints",
            str(ens / "ckpt"),
            "--out",
            str(ens / "model.pt"),
            "--no-track",
        ],
        ROOT,
    )
    model = checkpoints.load(ens / "model.pt")
    assert [m["seed"] for m in model["members"]] == [2] and model["params"]["train"]["members"] == 2
    assert model["train_time_s"] == pytest.approx(_final(ens)["train_time_s"] + member["train_time_s"])
    for k, directory in enumerate((ens / "ckpt", ens / "ckpt" / "seed2")):
        checkpoints.save(tmp_path / f"member{k}.pt", checkpoints.average_checkpoints(directory, 2))
    lines = (vocab_dir.parent / "tok" / "val.de").read_text().splitlines()[:12]
    assert Translator(ens / "model.pt").translate_tokenized(lines) == Translator(
        [tmp_path / "member0.pt", tmp_path / "member1.pt"]
    ).translate_tokenized(lines)


def test_a_member_trained_with_other_params_is_refused_by_name(tmp_path, vocab_dir):
    common = {"train.epochs": 1, "train.max_steps": 4, "average.last_k": 1}
    run(
        [sys.executable] + train_cmd(write_params(tmp_path, **common, **{"train.members": 2}), vocab_dir, tmp_path),
        ROOT,
    )
    stale = checkpoints.listed(tmp_path / "ckpt" / "seed2")[-1]
    ckpt = checkpoints.load(stale, checkpoints.RESUME_KEYS)
    ckpt["params"]["decode"]["alpha"] += 1  # decoding is not training: the ensemble decodes with the file's params
    checkpoints.save(stale, ckpt)
    assert [m["seed"] for m in checkpoints.average_members(tmp_path / "ckpt", [1, 2], 1)["members"]] == [2]
    ckpt["params"]["train"]["warmup"] += 1
    checkpoints.save(stale, ckpt)
    with pytest.raises(DataError, match=r"seed2: trained with other params than .*\(train\.warmup\)"):
        checkpoints.average_members(tmp_path / "ckpt", [1, 2], 1)


def _final(out: Path) -> dict:
    return checkpoints.load(checkpoints.listed(out / "ckpt")[-1])


class _Recorder:
    """A tracker that keeps the metrics logged to it and accepts every other call."""

    run_id = "recorded"

    def __init__(self):
        self.metrics: list[dict[str, float]] = []

    def factory(self, *args) -> _Recorder:
        return self

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.append(metrics | {"step": step})

    def log_rows(self, rows: list[dict[str, float]]) -> None:
        self.metrics.extend(rows)

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def test_the_report_counts_each_epochs_batch_shapes_and_padding_to_8_makes_fewer(tmp_path, vocab_dir):
    from transformer.data.batching import ParallelCorpus, batch_shapes
    from transformer.training.train import epoch_groups, train

    corpus = ParallelCorpus(vocab_dir / "train.pt")
    counts = {}
    for multiple in (1, 8):
        params = params_from_dict(tiny_params(**{"train.epochs": 2, "train.pad_multiple": multiple}))
        tracker = _Recorder()
        (summary,) = train(params, vocab_dir, train_outputs(tmp_path / str(multiple)), tracker.factory)
        expected = {e + 1: batch_shapes(corpus, epoch_groups(corpus, params.train, e), multiple) for e in (0, 1)}
        assert summary["batch_shapes"] == expected
        report = json.loads((tmp_path / str(multiple) / "reports" / "train.json").read_text())
        assert report["batch_shapes"] == {str(e): n for e, n in expected.items()}
        assert [m["batch_shapes"] for m in tracker.metrics if "batch_shapes" in m] == list(expected.values())
        counts[multiple] = max(expected.values())
    assert 0 < counts[8] < counts[1]


def test_a_run_resumed_mid_epoch_logs_the_epochs_batch_shapes_at_its_first_update(tmp_path, vocab_dir, monkeypatch):
    """An epoch's batch_shapes is one MLflow value at the epoch's first update, whether a kill fell inside
    that epoch or not: the resumed run logs it again at that step, not at the step it resumed from."""
    import transformer.training.train as train_module

    params = params_from_dict(tiny_params(**{"train.epochs": 2, "train.save_every": 5}))
    whole, killed, resumed = _Recorder(), _Recorder(), _Recorder()
    train_module.train(params, vocab_dir, train_outputs(tmp_path / "whole"), whole.factory)
    update = train_module.Trainer._update

    def dying(loop, group):
        if loop.progress.step == 17:  # inside the second epoch, after the checkpoint of step 15
            raise RuntimeError("killed")
        update(loop, group)

    monkeypatch.setattr(train_module.Trainer, "_update", dying)
    with pytest.raises(RuntimeError, match="killed"):
        train_module.train(params, vocab_dir, train_outputs(tmp_path / "killed"), killed.factory)
    monkeypatch.setattr(train_module.Trainer, "_update", update)
    train_module.train(params, vocab_dir, train_outputs(tmp_path / "killed"), resumed.factory)

    def shapes(recorder: _Recorder) -> set[tuple[int, float]]:
        return {(m["step"], m["batch_shapes"]) for m in recorder.metrics if "batch_shapes" in m}

    assert len(shapes(whole)) == 2 and min(step for step, _ in shapes(resumed)) < 15
    assert shapes(killed) | shapes(resumed) == shapes(whole)


def _toy_batches(vocab_dir, multiple: int, count: int):
    from transformer.data.batching import ParallelCorpus, token_batches

    corpus = ParallelCorpus(vocab_dir / "train.pt")
    return [
        corpus.batch(i, multiple) for i in token_batches(corpus.src_lens, corpus.tgt_lens, 400, 1, multiple)[:count]
    ]


def test_the_compiled_step_gives_the_eager_steps_loss_and_gradients(vocab_dir):
    """Model, generator and loss under torch.compile (aot_eager: the graphs dynamo captures, run without
    a C++ build), on batches of changing shapes, with partial R-Drop as the default recipe trains."""
    from transformer.data.vocab import PAD
    from transformer.training.loss import Loss
    from transformer.training.train import StepLoss, compiled

    batches = _toy_batches(vocab_dir, 8, 3)
    assert len({b.src.shape for b in batches}) > 1
    torch.manual_seed(0)
    model = tiny_model(src_vocab=120, tgt_vocab=120, tie_embeddings=True).train()
    step = StepLoss(model, Loss(PAD, 0.1), share=0.5)
    traced = compiled(step, "aot_eager")
    for batch in batches:
        results = []
        for way in (step, traced):
            torch.manual_seed(1)  # partial R-Drop draws the same sentences
            loss = way(batch, 5.0)
            loss.backward()
            results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        (eager, expected), (value, got) = results
        assert value == pytest.approx(eager, rel=1e-5)
        for name, grad in expected.items():
            assert torch.allclose(got[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max())), name


def test_compiled_training_traces_a_few_graphs_for_an_epoch_of_changing_shapes(
    tmp_path, vocab_dir, monkeypatch, caplog
):
    """train.compile with dropout and R-Drop on half the sentences (the default recipe's), as training
    compiles it (the plain step, no CPU twin): no shape may retrace."""
    import torch._dynamo.utils

    import transformer.training.train as train_module

    compiled = train_module.compiled
    monkeypatch.setattr(train_module, "compiled", lambda step: compiled(step, "aot_eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    overrides = {"train.compile": True, "train.rdrop": 10.0, "train.rdrop_share": 0.5, "model.dropout": 0.1}
    params = params_from_dict(tiny_params(**overrides | {"train.epochs": 1}))
    (summary,) = train_module.train(params, vocab_dir, train_outputs(tmp_path))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert summary["steps"] > 10 and summary["batch_shapes"][1] > graphs  # fewer traces than shapes
    assert 0 < graphs <= 8, graphs  # each frame once, and again at most where duck sizing guessed S == T
    assert "recompile_limit" not in caplog.text and math.isfinite(summary["val_loss"])


@contextlib.contextmanager
def _linear_outputs(overflow_first: bool = False):
    """The dtypes of the outputs of every Linear run with gradients while the body runs, seen through
    torch's public global module hook. With `overflow_first`, the gradient reaching the first such
    output is inf: the first backward pass of the body overflows while its forward pass and its loss
    stay finite."""
    dtypes: list[torch.dtype] = []

    def seen(module, args, output):
        if isinstance(module, torch.nn.Linear) and output.requires_grad:
            if overflow_first and not dtypes:
                output.register_hook(lambda grad: torch.full_like(grad, math.inf))
            dtypes.append(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(seen)
    try:
        yield dtypes
    finally:
        handle.remove()


def test_fp16_training_autocasts_to_float16_scales_its_loss_and_learns(tmp_path, vocab_dir):
    from transformer.training.train import train

    params = params_from_dict(tiny_params(**{"train.epochs": 3, "train.precision": "fp16"}))
    with _linear_outputs() as dtypes:
        (summary,) = train(params, vocab_dir, train_outputs(tmp_path))
    assert set(dtypes) == {torch.float16}
    validations = _validations(tmp_path)
    assert validations[-1]["val_loss"] < validations[0]["val_loss"] - 0.5  # nats per token
    # Each skipped update halved the scale from torch's 2^16; growth needs 2,000 finite updates in a row.
    assert _final(tmp_path)["scaler"]["scale"] == 2.0**16 / 2 ** summary["skipped_updates"]


def test_an_overflowed_fp16_update_is_skipped_counted_and_resumed_as_the_uninterrupted_run(
    tmp_path, vocab_dir, monkeypatch
):
    """The first update's gradients overflow: the scaler skips it (the run keeps its initial weights
    through it), train.json and MLflow count it, and a run killed after it resumes with the scaler's
    scale and growth tracker, and ends with the uninterrupted run's weights, optimizer and scaler."""
    import transformer.training.train as train_module

    overrides = {"train.epochs": 2, "train.save_every": 1, "train.keep": 30, "train.precision": "fp16"}
    params = params_from_dict(tiny_params(**overrides))
    whole = _Recorder()
    with _linear_outputs(overflow_first=True):
        (summary,) = train_module.train(params, vocab_dir, train_outputs(tmp_path / "whole"), whole.factory)
    first, second, last = (
        checkpoints.load(checkpoints.path_for(tmp_path / "whole" / "ckpt", s)) for s in (1, 2, summary["steps"])
    )
    torch.manual_seed(params.train.seed)  # the initial weights, as training draws them
    initial = train_module.make_model(**first["model_config"]).state_dict()
    assert same_values(first["model"], initial) and not same_values(second["model"], initial)
    assert first["scaler"] == last["scaler"] | {"scale": 2.0**15, "_growth_tracker": 0}
    assert last["scaler"]["scale"] == 2.0**15 and last["scaler"]["_growth_tracker"] == summary["steps"] - 1
    assert summary["skipped_updates"] == 1
    assert json.loads((tmp_path / "whole" / "reports" / "train.json").read_text())["skipped_updates"] == 1
    assert [m["skipped_updates"] for m in whole.metrics if "skipped_updates" in m][-1] == 1

    update = train_module.Trainer._update

    def dying(loop, group):
        if loop.progress.step == 5:  # after the checkpoint of step 5
            raise RuntimeError("killed")
        update(loop, group)

    monkeypatch.setattr(train_module.Trainer, "_update", dying)
    with _linear_outputs(overflow_first=True), pytest.raises(RuntimeError, match="killed"):
        train_module.train(params, vocab_dir, train_outputs(tmp_path / "killed"))
    monkeypatch.setattr(train_module.Trainer, "_update", update)
    (resumed,) = train_module.train(params, vocab_dir, train_outputs(tmp_path / "killed"))
    again = _final(tmp_path / "killed")
    assert resumed["skipped_updates"] == 1 and again["step"] == last["step"]
    assert all(same_values(again[k], last[k]) for k in ("model", "optimizer", "scaler"))
