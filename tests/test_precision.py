"""fp16's gradient scaler: an update whose gradients overflow is skipped, and the scale halves."""

from __future__ import annotations

import math

import torch

from transformer.training.precision import Precision
from transformer.training.train import make_optimizer


def _backward(precision: Precision, model: torch.nn.Module) -> None:
    with precision.autocast():
        loss = model(torch.full((3, 4), 0.1)).float().square().mean()  # its gradients fit fp16 at scale 2^16
    precision.backward(loss)


def test_an_overflowed_fp16_update_is_skipped_and_halves_the_scale_and_a_finite_one_steps():
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = make_optimizer(model, 0.0, cpu)
    for g in optimizer.param_groups:
        g["lr"] = 1e-2
    precision = Precision("fp16", cpu)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hook = model.weight.register_hook(lambda grad: torch.full_like(grad, math.inf))  # an overflowed gradient
    _backward(precision, model)
    hook.remove()
    assert bool(precision.step(optimizer)) is True
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)  # bias too: the update is skipped
    assert all(float(s["step"]) == 0 for s in optimizer.state.values())  # Adam's bias correction did not advance
    assert precision.scaler.state_dict()["scale"] == 2.0**15 and precision.scaler.state_dict()["_growth_tracker"] == 0
    optimizer.zero_grad(set_to_none=True)
    _backward(precision, model)
    assert bool(precision.step(optimizer)) is False
    assert not torch.equal(model.weight, before["weight"])
    assert precision.scaler.state_dict()["scale"] == 2.0**15 and precision.scaler.state_dict()["_growth_tracker"] == 1


def test_outside_fp16_the_scaler_is_off_and_steps_are_the_optimizers_own():
    precision = Precision("fp32", torch.device("cpu"))
    assert not precision.scaler.is_enabled() and precision.dtype is None
    loss = torch.tensor(3.0)
    assert precision.scaler.scale(loss) is loss  # the loss the backward pass sees: the same tensor, unscaled
