"""The process's memory: training's processes run on mimalloc where it is installed, glibc's
settings are left alone there, oneDNN's kernel cache is limited, and a training process's memory
does not grow with its updates."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from transformer.kernels import memory
from transformer.training.distributed import use_bf16

needs_mimalloc = pytest.mark.skipif(
    memory.mimalloc_library() is None, reason="cmeel-mimalloc, a dependency on Linux, is not installed"
)
needs_bf16 = pytest.mark.skipif(
    not use_bf16("auto", torch.device("cpu")), reason="bf16 matmuls run on oneDNN where the CPU has bf16"
)


def _run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    # timeout: a hang guard; a loaded host may take minutes
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", memory.ALLOCATOR_ENV, memory.KERNEL_CACHE_ENV)
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=clean | env, timeout=540
    )


def _onednn_log(code: str, *args: str, **env: str) -> str:
    """What `code` prints with oneDNN's verbose log on (a line for each kernel it looks up), on one thread."""
    done = _run(code, *args, ONEDNN_VERBOSE="all", OMP_NUM_THREADS="1", **env)
    assert done.returncode == 0, done.stderr
    return done.stdout


_ALLOCATOR = """
import os
from transformer.kernels.memory import allocator, keep_freed_memory, kernel_cache, training_memory
training_memory()
print(allocator(), keep_freed_memory(), os.environ.get("MIMALLOC_PURGE_DELAY"), os.environ.get("MIMALLOC_ALLOW_THP"),
      kernel_cache())
"""


@needs_mimalloc
def test_a_process_that_preloads_runs_itself_again_on_mimalloc_and_leaves_glibcs_settings_alone():
    done = _run(_ALLOCATOR)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mimalloc", "False", *memory.MIMALLOC_OPTIONS.values(), str(memory.KERNEL_CACHE)]


def test_glibc_asked_for_stays_glibc_and_takes_its_settings():
    done = _run(_ALLOCATOR, **{memory.ALLOCATOR_ENV: "glibc"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["glibc", "True", "None", "None", str(memory.KERNEL_CACHE)]


def test_a_kernel_cache_the_environment_sets_is_kept():
    done = _run(_ALLOCATOR, **{memory.ALLOCATOR_ENV: "glibc", memory.KERNEL_CACHE_ENV: "200"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "200"


# bf16 matmuls of 100 shapes more than training's cache holds, twice over, in a process set up as
# training's: how many of the second pass's kernels oneDNN found in its cache (its verbose log says,
# for each kernel it looks up).
_KERNELS = """
import torch
from transformer.kernels.memory import KERNEL_CACHE, training_memory
training_memory()
weight = torch.randn(64, 32, dtype=torch.bfloat16)
for rows in [*range(1, KERNEL_CACHE + 101)] * 2:
    torch.randn(rows, 64, dtype=torch.bfloat16) @ weight
"""


@needs_bf16
def test_a_training_process_keeps_few_kernels_and_a_default_cache_would_keep_them_all():
    def found_again(**env: str) -> int:
        return _onednn_log(_KERNELS, **env).count("create:cache_hit")

    assert found_again() == 0  # the shapes outgrow the cache: each was dropped before its turn came again
    assert found_again(**{memory.KERNEL_CACHE_ENV: str(memory.ONEDNN_KERNEL_CACHE)}) > memory.KERNEL_CACHE


# A Linear of the model in bf16 over 100 row counts, as token batches bring them, in a process set up
# as training's: how many matmul kernels oneDNN built for them (its verbose log names each it creates).
_ROW_COUNTS = """
import sys
import torch
import torch.nn.functional as F
from transformer.kernels.memory import training_memory
from transformer.kernels.linear import PaddedLinear
training_memory()
layer = PaddedLinear(64, 32)
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    for rows in range(2000, 2100):
        x = torch.randn(rows, 64)
        layer(x) if sys.argv[1] == "bucketed" else F.linear(x, layer.weight, layer.bias)
"""


@needs_bf16
def test_a_linears_bucketed_rows_meet_kernels_already_built():
    def built(way: str) -> int:
        return sum(
            "create:cache_miss" in line and ",matmul," in line for line in _onednn_log(_ROW_COUNTS, way).splitlines()
        )

    assert built("bucketed") == 2  # rows 2,048 and 2,176
    assert built("unpadded") == 100


def test_a_library_the_loader_was_given_is_not_asked_for_again(tmp_path, monkeypatch):
    refused = tmp_path / "libmimalloc.so"  # as if the loader had refused it: this process is on glibc
    refused.write_bytes(b"")
    monkeypatch.setattr(memory, "mimalloc_library", lambda: refused)
    monkeypatch.setenv("LD_PRELOAD", str(refused))
    monkeypatch.delenv(memory.ALLOCATOR_ENV, raising=False)
    monkeypatch.setattr(os, "execve", lambda *args: pytest.fail("the process ran itself again"))
    memory.preload_allocator()


# Updates of a tiny model at the precision training takes on this CPU, over a cycle of batch shapes
# drawn once and met again and again, and the resident set after each update.
_UPDATES = """
import json, torch
from transformer.kernels.memory import keep_freed_memory, training_memory
training_memory()
keep_freed_memory()  # as training does where it runs on glibc
from transformer.data.batching import Batch
from transformer.training.distributed import use_bf16
from transformer.training.loss import Loss, batch_loss
from transformer.kernels.accelerate import accelerate
from transformer.model.model import make_model
from transformer.training.train import make_optimizer

def resident_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

torch.manual_seed(0)
vocab, cycle, cycles = 8000, 25, 8
model = make_model(src_vocab=vocab, tgt_vocab=vocab, pad=0, N=1, decoder_N=0, d_model=64, d_ff=256, h=2,
                   dropout=0.1, attn_dropout=0.0, ff_dropout=0.0, word_dropout=0.0, norm="pre", tie_embeddings=True)
model, criterion = accelerate(model, torch.device("cpu")), accelerate(Loss(0, 0.1), torch.device("cpu"))
optimizer = make_optimizer(model, 0.0, torch.device("cpu"))
bf16 = use_bf16("auto", torch.device("cpu"))
shapes = []  # (rows, the mask's real positions): about 3,000 tokens a batch, as token batches hold
for length in torch.randint(5, 60, (cycle,)).tolist():
    rows = 3000 // length
    shapes.append(torch.arange(length)[None] < torch.randint(1, length + 1, (rows, 1)))
rss, pending = [], []
for step in range(cycle * cycles):
    real = shapes[step % cycle]
    src, tgt = (torch.where(real, torch.randint(4, vocab, real.shape), 0) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # bf16's casts fragment glibc's heap
        batch = Batch(src, tgt, tgt, int(real.sum()))
        loss = batch_loss(model, model.generator, batch, criterion, rdrop=5.0, share=0.5)
        loss.backward()
    pending.append(loss.detach())  # held until the next sync, as training holds them
    if step % 20 == 0:
        pending.clear()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rss.append(resident_mb())
print(json.dumps({"cycle": cycle, "rss": rss}))
"""


@needs_mimalloc
@pytest.mark.slow
def test_a_training_processs_memory_does_not_grow_with_its_updates():
    """Training meets the same few hundred batch shapes epoch after epoch, so the test cycles 25 shapes:
    the first cycles meet them and fill the allocator's and oneDNN's caches, and the resident set grows
    by design; once every shape has been met it must not. Which shapes came last no longer decides, as it
    did when each update drew a new one and a window's peak was the largest batch drawn so far. The
    smallest leak worth catching holds one bf16 activation of one layer an update, 3,000 tokens by 64
    features: 384 KB, 38 MB over the 100 updates between the two cycles compared, the fourth and the
    eighth. The bound, 10 MB, fails it four times over. Each cycle's median decides, not one sample."""
    done = _run(_UPDATES, OMP_NUM_THREADS="1")  # one thread: the test workers keep the cores busy
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    cycles = [run["rss"][start : start + run["cycle"]] for start in range(0, len(run["rss"]), run["cycle"])]
    early, late = statistics.median(cycles[3]), statistics.median(cycles[7])
    assert late - early < 10, [round(statistics.median(cycle)) for cycle in cycles]
