"""The learning-rate schedule of section 5.3, with an optional linear cooldown at the end."""

from __future__ import annotations


def rate(step: int, d_model: int, factor: float, warmup: int, total: int = 0, cooldown: float = 0.0) -> float:
    """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1.

    With a cooldown, the rate of the last `cooldown * total` of `total` updates is also scaled by a
    line that falls from 1 towards 0, so the last update runs at a small fraction of the rate."""
    step = max(step, 1)
    lr = factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    span = cooldown * total
    return lr * min(1.0, (total - step + 1) / span) if span > 0 else lr
