"""Descriptions of the model and the machine, for reports."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    name = platform.processor() or "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPU cores ({name}), torch {torch.__version__}, {torch.get_num_threads()} threads"


def describe_model(ckpt: dict[str, Any]) -> dict[str, Any]:
    """Parameter count (shared weights once), size, steps and training time of a model file."""
    seen, count = set(), 0
    for tensor in ckpt["model"].values():
        key = (tensor.untyped_storage().data_ptr(), tensor.shape)
        if key not in seen:
            seen.add(key)
            count += tensor.numel()
    c = ckpt["model_config"]
    train_time = ckpt.get("train_time_s")
    return {"model": f"N={c['N']}, d_model={c['d_model']}, d_ff={c['d_ff']}, h={c['h']}, {c['norm']}-norm",
            "parameters": f"{count / 1e6:.1f}M", "updates": ckpt.get("step"),
            "training time": f"{train_time / 60:.1f} min" if train_time else "unknown",
            "averaged": ", ".join(ckpt.get("averaged", [])) or "no"}
