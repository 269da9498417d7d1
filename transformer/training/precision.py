"""The training's arithmetic: fp32, or autocast to bf16 or fp16 (distributed.autocast_dtype decides
which), and under fp16 torch's gradient scaler.

fp16 keeps 5 exponent bits: small gradients flush to zero, large ones overflow. The scaler multiplies
the loss by its scale before the backward pass and divides the gradients by it inside the optimizer's
step. An update whose gradients hold an inf or a NaN is skipped (the weights, Adam's moments and its
step count stay) and the scale halves; after 2,000 finite updates in a row it doubles. A skipped
update still consumes its batches and its step of the learning-rate schedule, as in PyTorch's AMP
examples: the schedule stays a function of the update number, which resuming and a planned cooldown
rely on, and the few updates skipped while the scale settles move it by as many steps of warmup."""

from __future__ import annotations

import contextlib

import torch

from transformer.kernels.accelerate import attention_backends
from transformer.training.distributed import set_precision


class Precision:
    """How one run computes: its autocast, its loss scaling and its optimizer step."""

    def __init__(self, precision: str, device: torch.device):
        self.device = device
        self.dtype = set_precision(precision, device)  # None: fp32
        # Disabled outside fp16, where scale() returns the loss as it is and step() is the optimizer's.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)

    def autocast(self) -> contextlib.ExitStack:
        """Autocast to the run's half dtype where it has one, with the attention kernels that suit the device."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None))
        stack.enter_context(attention_backends(self.device))
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass of `loss`, scaled under fp16."""
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The optimizer's step, through the scaler under fp16, then the scale's update. Under fp16,
        whether the update was skipped, as a tensor on the device: the scale falls exactly when the
        gradients overflowed, and comparing scales on the device spares the host a read every update
        (training reads it back with the losses). None outside fp16."""
        if not self.scaler.is_enabled():
            optimizer.step()
            return None
        before = self.scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scale() < before

    def scale(self) -> torch.Tensor:
        """The scaler's current scale on the device, read through its public scale() (get_scale() reads it back)."""
        return self.scaler.scale(torch.ones((), device=self.device))
