"""GPU settings: bf16 only where the card computes it natively, else fp16; TF32 for fp32 on a GPU and nowhere else."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import BIN, ROOT, run, same_values, write_params

from transformer import checkpoints
from transformer.errors import TrainingError
from transformer.training import distributed

GPU = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


@pytest.fixture
def tf32():
    """The TF32 flags as set_precision leaves them, restored afterwards (they are process-wide;
    monkeypatch cannot restore them, torch serves them through __getattr__)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize(("capability", "bf16"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_auto_precision_on_a_gpu_picks_bf16_from_compute_capability_8_not_from_emulation(monkeypatch, capability, bf16):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # V100 and T4 too
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert distributed.use_bf16("auto", GPU) is bf16
    assert distributed.use_bf16("bf16", GPU) is True and distributed.use_bf16("fp32", GPU) is False


@pytest.mark.parametrize(
    ("capability", "dtype"), [((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16)]
)
def test_auto_precision_on_a_gpu_without_native_bf16_picks_fp16_and_on_a_cpu_never(monkeypatch, capability, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert distributed.autocast_dtype("auto", GPU) is dtype
    assert distributed.autocast_dtype("fp16", GPU) is torch.float16 and distributed.autocast_dtype("fp32", GPU) is None
    cpu = torch.device("cpu")
    assert distributed.autocast_dtype("auto", cpu) is (torch.bfloat16 if distributed.use_bf16("auto", cpu) else None)
    assert distributed.autocast_dtype("fp16", cpu) is torch.float16  # asked for: CPU autocast and the scaler run it


def test_fp16_where_torch_cannot_autocast_to_it_is_a_clear_error():
    assert distributed.set_precision("fp16", torch.device("cpu")) is torch.float16
    with pytest.raises(TrainingError, match="fp16 cannot run on meta"):
        distributed.set_precision("fp16", torch.device("meta"))  # a device type without autocast


def test_fp32_on_a_gpu_multiplies_in_tf32_and_bf16_runs_and_cpus_leave_it_alone(monkeypatch, tf32):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert distributed.set_precision("fp32", GPU) is None and tf32() == (True, True)
    assert distributed.set_precision("auto", GPU) is torch.bfloat16 and tf32() == (False, False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cpu_matmuls = torch.backends.mkldnn.matmul.fp32_precision
    assert distributed.set_precision("fp32", torch.device("cpu")) is None and tf32() == (False, False)
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu_matmuls


TWO_RANKS = """
import json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from transformer.training import train as training
from transformer.config import load_params

out, rank = Path(sys.argv[1]), os.environ["RANK"]
inits, models, bf16_grads = [], [], []
init_process_group, make_model = dist.init_process_group, training.make_model


def counted(*args, **kwargs):
    inits.append(1)
    return init_process_group(*args, **kwargs)


def kept(**config):
    models.append(make_model(**config))
    return models[-1]


def rounded_to_bf16(optimizer, args, kwargs):
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    bf16_grads.append(all(torch.equal(g, g.bfloat16().float()) for g in grads))


dist.init_process_group, training.make_model = counted, kept
register_optimizer_step_pre_hook(rounded_to_bf16)
reports = out / "reports"
outputs = training.Outputs(out / "ckpt", reports / "steps.tsv", reports / "epochs.tsv", reports / "train.json")
training.train(load_params(sys.argv[2]), Path(sys.argv[3]), outputs)
torch.save([m.state_dict() for m in models], out / f"weights.{rank}.pt")
report = {"inits": len(inits), "group_left": not dist.is_initialized(), "bf16_grads": bf16_grads}
(out / f"report.{rank}.json").write_text(json.dumps(report))
"""


def test_two_gloo_ranks_train_every_member_in_one_process_group_to_equal_weights_with_bf16_gradients(
    tmp_path, vocab_dir
):
    """train.members 2 under DDP: one process group for both members (NCCL's cannot be re-created
    safely in one process), left once both are trained; with train.ddp_bf16_grads every update
    steps on gradients rounded to bf16, and each member's weights stay equal on both ranks."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    common = {"train.epochs": 1, "train.max_steps": 3, "model.dropout": 0.1, "train.members": 2, "train.nproc": 2}
    common["train.ddp_bf16_grads"] = True
    params = write_params(tmp_path, **common)
    torchrun = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2"]
    run(
        torchrun + [str(script), str(tmp_path), str(params), str(vocab_dir)],
        ROOT,
        env={"OMP_NUM_THREADS": "1"},
        timeout=120,  # a group destroyed and re-created in one process hangs: fail in minutes
    )
    reports = [json.loads((tmp_path / f"report.{r}.json").read_text()) for r in (0, 1)]
    assert reports == [{"inits": 1, "group_left": True, "bf16_grads": [True] * 6}] * 2  # 2 members x 3 updates
    weights = [torch.load(tmp_path / f"weights.{r}.pt") for r in (0, 1)]
    assert len(weights[0]) == 2 and all(same_values(a, b) for a, b in zip(*weights))
    assert not same_values(weights[0][0], weights[0][1])  # two seeds, two models
    for k, where in enumerate((tmp_path / "ckpt", tmp_path / "ckpt" / "seed2")):
        final = checkpoints.load(checkpoints.listed(where)[-1])
        assert final["step"] == 3 and same_values(final["model"], weights[0][k])
