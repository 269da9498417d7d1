"""GPU settings: bf16 only where the card computes it natively, TF32 for fp32 on a GPU and nowhere else."""

from __future__ import annotations

import pytest
import torch

from transformer import distributed

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


def test_fp32_on_a_gpu_multiplies_in_tf32_and_bf16_runs_and_cpus_leave_it_alone(monkeypatch, tf32):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert distributed.set_precision("fp32", GPU) is False and tf32() == (True, True)
    assert distributed.set_precision("auto", GPU) is True and tf32() == (False, False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cpu_matmuls = torch.backends.mkldnn.matmul.fp32_precision
    assert distributed.set_precision("fp32", torch.device("cpu")) is False and tf32() == (False, False)
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu_matmuls
