"""The learning-rate schedule of section 5.3."""

from __future__ import annotations


def rate(step: int, d_model: int, factor: float, warmup: int) -> float:
    """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
