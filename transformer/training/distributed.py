"""Distributed set-up: torchrun's environment, the device, its precision, and the checks and
broadcasts that keep every rank on one run."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from transformer.errors import TrainingError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(nproc: int, nnodes: int) -> Dist:
    """Reads torchrun's environment, which must hold the processes the params ask for (their number
    is part of the batch); NCCL on GPUs, gloo on CPUs."""
    die_with_launcher()
    world, rank, local = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)))
    if world != nproc * nnodes:
        raise TrainingError(
            f"torchrun started {world} process{'es' * (world != 1)}, but train.nproc × train.nnodes "
            f"= {nproc} × {nnodes} = {nproc * nnodes}: launch with --nproc-per-node {nproc} --nnodes {nnodes}, "
            f"or set the params to the launch"
        )
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", **_attempt_store(rank, world))
    return Dist(rank, world, device)


def _attempt_store(rank: int, world: int) -> dict[str, Any]:
    """init_process_group's store in a restarted job: the launcher's, under a prefix of this attempt's.
    torchrun's static rendezvous (--nnodes N, --master-addr) keeps one store for every attempt, and
    the ranks of a new attempt would read the addresses the dead attempt's ranks left there, and fail
    to connect. The first attempt uses torchrun's store as it is."""
    if not restarts() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    from torch.distributed.constants import default_pg_timeout

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world, is_master=False, timeout=default_pg_timeout)
    return {"store": dist.PrefixStore(f"attempt_{restarts()}", store), "rank": rank, "world_size": world}


@contextlib.contextmanager
def process_group(nproc: int, nnodes: int) -> Iterator[Dist]:
    """setup_distributed for the body, then, once it has finished, the process group left by every
    rank together. One group serves every run trained in the body (an ensemble's members): torch
    cannot safely destroy and re-create an NCCL group in one process. A body that fails leaves the
    group to the dying process, as other ranks may no longer answer a barrier."""
    env = setup_distributed(nproc, nnodes)
    yield env
    if env.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def wrap_ddp(model: torch.nn.Module, bf16_grads: bool) -> torch.nn.parallel.DistributedDataParallel:
    """`model` under DDP in the default process group. Its only buffer is the positional table, the
    same everywhere: no need to broadcast it each step. Gradients are views into DDP's all-reduce
    buckets, so they take no second copy of their memory and no copy each update. With
    `bf16_grads`, each bucket is all-reduced in bf16 and the mean cast back to fp32: half the bytes
    over the links, which counts across nodes, for gradients rounded to bf16's 8-bit mantissa."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=True)
    if bf16_grads:
        ddp.register_comm_hook(None, bf16_all_reduce)  # None: the default group
    return ddp


def bf16_all_reduce(group, bucket):  # DDP checks the annotations as objects, and this module's are strings
    """torch's DDP bf16_compress_hook under another name: register_comm_hook refuses that hook, by
    its name, outside NCCL, and gloo all-reduces bf16 as well, so CPU runs (and the tests) take the
    very path GPU runs take. (group: a ProcessGroup or None; bucket: a GradBucket; a Future back.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, group, bucket)


def gathered(mine: Any, env: Dist) -> list[Any]:
    """`mine` of every rank, in rank order; a collective: every rank calls it."""
    if env.world == 1:
        return [mine]
    ranks = [None] * env.world
    dist.all_gather_object(ranks, mine)
    return ranks


def rank_seed(seed: int, rank: int) -> int:
    """The seed of a rank's random stream (dropout's masks): train.seed itself on rank 0, so one
    process trains as it always has; a stream of its own on every other rank."""
    return seed + 1_000_003 * rank


def restarts() -> int:
    """How many times torchrun has restarted this job's workers after one died (train.max_restarts
    bounds it): 0 on the first attempt and outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def die_with_launcher() -> None:
    """Under torchrun on Linux: the kernel kills this worker when its launcher dies.

    torchrun starts each worker in a session of its own, so a signal to the launcher's process
    group (a killed `dvc repro` and everything it started) misses the workers, and a launcher
    killed outright cannot stop them: they would train on, orphaned, writing into the checkpoint
    directory a rerun resumes from. A worker killed so loses what a power loss would: the updates
    since its last checkpoint. A launcher that dies while the worker starts up, before this call,
    is not covered."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    launcher = os.getppid()
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        print(
            f"warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): "
            "this worker outlives a killed launcher",
            file=sys.stderr,
        )
    elif os.getppid() != launcher:  # it died between the two calls
        os.kill(os.getpid(), signal.SIGKILL)


def use_bf16(precision: str, device: torch.device) -> bool:
    """precision auto: bf16 where the hardware computes it natively. On a GPU, compute capability
    8.0 on (Ampere's bf16 tensor cores); torch.cuda.is_bf16_supported() also counts older cards,
    where torch emulates bf16 slower than fp32. On a CPU, where the cores have bf16 instructions
    and torch may use them: torch names AVX512 on AVX-512 cores with or without bf16, so
    /proc/cpuinfo decides there; with torch held below AVX-512 (ATEN_CPU_CAPABILITY=avx2) bf16
    would be emulated at a small fraction of fp32's speed (`bench.py --quick`'s bf16 rows show it), so fp32."""
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX512_BF16", "AMX") or (capability.startswith("AVX512") and _cpu_has("avx512_bf16"))


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype training autocasts to, None for fp32: bf16 where use_bf16 says; fp16 where asked for,
    and under auto on a GPU without native bf16, whose fp16 tensor cores reach back to Volta (fp16's
    5-bit exponent then needs the gradient scaler, training/precision.py). auto never picks fp16 on a
    CPU: its cores compute fp16 no faster than fp32, so there auto stays with bf16 or fp32."""
    if use_bf16(precision, device):
        return torch.bfloat16
    if precision == "fp16" or (precision == "auto" and device.type == "cuda"):
        return torch.float16
    return None


def _check_fp16(device: torch.device) -> None:
    """A clear error where torch cannot autocast to fp16 on `device`: its autocast would only warn,
    disable itself and train in fp32 under a run that says fp16."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.amp.is_autocast_available(device.type)
        if available:
            with torch.autocast(device.type, dtype=torch.float16):
                pass
    if not available or caught:
        raise TrainingError(
            f"train.precision: fp16 cannot run on {device} with torch {torch.__version__} "
            "(no fp16 autocast there): choose auto, bf16 or fp32"
        )


def set_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype training autocasts to (autocast_dtype; None: fp32), and on a GPU the matmuls'
    precision to go with it: fp32 runs multiply in TF32 (fp32's range, a 10-bit mantissa, on Ampere
    and later; older cards ignore the flag), several times fp32's speed, as cuBLAS does by default on
    other frameworks. CPUs are left alone: torch's global set_float32_matmul_precision would let
    oneDNN round their fp32 matmuls too."""
    dtype = autocast_dtype(precision, device)
    if dtype == torch.float16:
        _check_fp16(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = dtype is None
        torch.backends.cudnn.allow_tf32 = dtype is None
    return dtype


def _cpu_has(flag: str) -> bool:
    with contextlib.suppress(OSError):
        return flag in Path("/proc/cpuinfo").read_text()
    return False


def check_same_run(identity: dict, env: Dist) -> None:
    """One clear error on every rank at start-up when the nodes would not train the same run: other
    params or token ids than rank 0's, or DVC running the stage on a node other than 0 (DVC runs on
    node 0 only, which writes every output; there it would also delete node 0's outputs on a shared disk)."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    mine = {"host": socket.gethostname(), "node": node, "identity": identity, "dvc": os.environ.get("DVC_STAGE")}
    everyone: list[Any] = [None] * env.world
    dist.all_gather_object(everyone, mine)
    problems = []
    for rank, other in enumerate(everyone):
        where = f"rank {rank} (node {other['node']}, {other['host']})"
        if other["identity"]["params"] != everyone[0]["identity"]["params"]:
            problems.append(f"{where} has other data/tokenize/vocab/model/train params than rank 0")
        elif other["identity"]["data"] != everyone[0]["identity"]["data"]:
            problems.append(f"{where} has other token ids (vocab.pt, train.pt) than rank 0")
        if other["node"] != 0 and other["dvc"]:
            problems.append(
                f"{where} runs under DVC: run DVC on node 0 only, and the stage's command itself on the others"
            )
    if problems:
        raise TrainingError("the nodes do not train the same run: " + "; ".join(problems) + " (see docs/scale.md)")


def broadcast(obj: Any, device: torch.device) -> Any:
    """Rank 0's `obj` (dicts and lists of tensors and plain values) on every rank: the structure
    in one pickled message, then each tensor through `device` (NCCL sends GPU tensors only)."""
    tensors: list[torch.Tensor] = []

    def strip(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _Slot(len(tensors) - 1, x.shape, x.dtype)
        return _map(x, strip)

    def collect(x):
        if isinstance(x, _Slot):
            slots.append(x)
        return _map(x, collect)

    sender, slots = dist.get_rank() == 0, []
    message = [strip(obj) if sender else None]
    dist.broadcast_object_list(message, src=0)
    collect(message[0])
    received = []
    for slot in sorted(slots, key=lambda s: s.index):
        t = tensors[slot.index].to(device) if sender else torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.broadcast(t, src=0)
        received.append(None if sender else t.cpu())

    def fill(x):
        return received[x.index] if isinstance(x, _Slot) else _map(x, fill)

    return obj if sender else fill(message[0])


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sits in a broadcast structure."""

    index: int
    shape: torch.Size
    dtype: torch.dtype


def _map(x: Any, fn) -> Any:
    """`fn` applied to each element of a dict, list or tuple (the same container back); other values as they are."""
    if isinstance(x, dict):
        return {k: fn(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(fn(v) for v in x)
    return x
