"""Descriptions of the model and the machine, for reports."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from transformer.model.model import count_parameters, decoder_layers, make_model


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    cpu = cpuinfo()
    name = cpu.get("model name") or platform.processor() or "CPU"
    # Virtual machines often name only the vendor line ("AMD EPYC"); the family and model tell its generations apart.
    if "cpu family" in cpu and "model" in cpu:
        name += f", family {cpu['cpu family']} model {cpu['model']}"
    capability = torch.backends.cpu.get_cpu_capability()  # AVX512, AVX2, ...: what CPU speed depends on most
    threads = torch.get_num_threads()
    cores = f"{os.cpu_count()} CPU cores ({name}, {capability})"
    return f"{cores}, torch {torch.__version__}, {threads} thread{'s' * (threads != 1)}"


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux); empty elsewhere."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


def describe_model(ckpt: dict[str, Any]) -> dict[str, Any]:
    """Parameter count, size, steps and training time of a model file. The count is the model's as
    built from its config, where a tied embedding is one matrix: the file's weights would count it
    once per name (source, target, generator), since averaging gives each name its own tensor.
    Of an ensemble: one member's count, times the members; the training time of them all."""
    with torch.device("meta"):  # shapes only, no memory, no initialization work
        count = count_parameters(make_model(**ckpt["model_config"]))
    c = ckpt["model_config"]
    train_time, members = ckpt.get("train_time_s"), ckpt.get("members", [])
    layers = f"N={c['N']}" + (f" (decoder {decoder_layers(c)})" if decoder_layers(c) != c["N"] else "")
    return {
        "model": f"{layers}, d_model={c['d_model']}, d_ff={c['d_ff']}, h={c['h']}, {c['norm']}-norm",
        "parameters": f"{count / 1e6:.1f}M ({count:,})" + (f" × {len(members) + 1} members" if members else ""),
        "updates": ckpt.get("step"),
        "training time": f"{train_time / 60:.1f} min" if train_time else "unknown",
        "averaged": ", ".join(ckpt.get("averaged", [])) or "no",
    }
