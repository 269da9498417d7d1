"""Descriptions of the model and the machine, for reports. The machine is its host class: what decides how
its kernels round, so what two runs must share to agree to the digit. One line, written into every
report, checkpoint and MLflow run, that a user compares with their own."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from transformer.model.model import count_parameters, decoder_layers, make_model


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
        "trained on": ckpt.get("host_class") or "unknown",
    }


def host_class() -> str:
    """The processor, what chose the kernels (kernels()), the cores, torch's version and its threads,
    e.g. "AMD EPYC, family 26 model 2; AVX-512 bf16; 2 CPU cores; torch 2.13.0; 2 threads"."""
    threads = torch.get_num_threads()
    cores = f"{os.cpu_count()} CPU cores"
    return f"{processor()}; {kernels()}; {cores}; torch {torch.__version__}; {threads} thread{'s' * (threads != 1)}"


def numerics_class() -> str:
    """What of host_class decides the numbers a run computes: the CPU's vendor, what chose the kernels and
    torch's version, not the generation, cores or threads of one machine, e.g. "AMD; AVX-512 bf16; torch
    2.13.0". Runs of one recipe on one numerics class agree to the digit."""
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(cpuinfo().get("vendor_id", ""), platform.machine())
    return f"{vendor}; {kernels()}; torch {torch.__version__}"


def kernels() -> str:
    """A GPU's name and compute capability where training and decoding run on one, else the CPU's
    instruction set."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, capability {major}.{minor}"
    return instruction_set()


def processor() -> str:
    """The CPU's name; where a virtual machine names only the vendor line ("AMD EPYC"), its family and
    model, which tell its generations apart."""
    cpu = cpuinfo()
    name = cpu.get("model name") or platform.processor() or "CPU"
    if "cpu family" in cpu and "model" in cpu:
        name += f", family {cpu['cpu family']} model {cpu['model']}"
    return name


def instruction_set() -> str:
    """The widest of AVX2 / AVX-512 / AVX-512 bf16 / AMX that torch's kernels use here: torch's own
    dispatch level (ATEN_CPU_CAPABILITY can hold it lower), refined by the bf16 units the CPU has,
    which decide how a bf16 matmul rounds."""
    capability = torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512, ...
    if not capability.startswith("AVX512"):
        return "AVX2" if capability == "AVX2" else f"below AVX2 ({capability})"
    flags = set(cpuinfo().get("flags", "").split())
    if "amx_bf16" in flags:
        return "AMX"
    return "AVX-512 bf16" if "avx512_bf16" in flags else "AVX-512"


def after(previous: str | None, now: str) -> str:
    """A run's host class when it resumes on `now`: unchanged on the same class, else both in order."""
    if not previous or previous == now or previous.endswith(f", then {now}"):
        return previous or now
    return f"{previous}, then {now}"


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
