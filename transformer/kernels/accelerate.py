"""Speed, applied to the plain model from outside: accelerate swaps the model's and the loss's modules for
the fast twins that pay on a device.

The model (transformer/model) and the loss (transformer/training/loss.py) are the paper's and know
nothing of this. A twin is a subclass of the module it replaces that computes the same function
with the same parameters, in a module of its own here beside a test that holds it to the plain
definition:

    packing.py    PackedTransformer, PackedAttention: a mostly padded batch side's token-wise layers
                  run on its real tokens alone
    attention.py  CpuAttention: packed attention, and bf16 attention written out, its softmax in
                  float32 (softmax.py)
    linear.py     PaddedLinear: a Linear's rows padded to a few sizes where oneDNN builds a kernel
                  for every shape (on a CPU in a half dtype)
    dropout.py    MaskDropout: dropout masks drawn 16 bits a value
    loss.py       FusedLoss: the generator and the loss fused, a block of rows at a time
    varlen.py     VarlenAttention: attention over padded keys on a CUDA card's variable-length
                  flash kernel, which skips the padding the plain attention masks
    memory.py     the process's allocator and oneDNN's kernel cache, which the train stage sets up first

torch.compile is the other way to apply speed: it traces the plain modules and fuses their work
itself, so a compiled training step takes no twin.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.kernels.attention import CpuAttention
from transformer.kernels.dropout import MaskDropout
from transformer.kernels.linear import PaddedLinear
from transformer.kernels.loss import FusedLoss
from transformer.kernels.packing import PackedTransformer
from transformer.kernels.varlen import FLASH_CAPABILITY, VarlenAttention
from transformer.model.attention import MultiHeadAttention
from transformer.model.model import Transformer
from transformer.training.loss import Loss

# Each device's twins, by the exact class they replace. On CUDA the rest is torch's own: its fused
# attention, and the plain loss (one generator matmul and cross-entropy, as compile traces it too).
TWINS: dict[str, dict[type[nn.Module], type[nn.Module]]] = {
    "cpu": {
        Transformer: PackedTransformer,
        MultiHeadAttention: CpuAttention,
        nn.Linear: PaddedLinear,
        nn.Dropout: MaskDropout,
        Loss: FusedLoss,
    },
    "cuda": {MultiHeadAttention: VarlenAttention},
}


def accelerate(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` with every part that has a twin on `device` made that twin, in place, and returned.

    A twin differs from its module in methods alone, so taking its class keeps every parameter,
    buffer and state-dict key where it was: call it before an optimizer, DDP or a checkpoint
    load sees the model, or after; either way they see the same tensors. A CUDA card older than
    flash's (compute capability 8.0) keeps torch's attention."""
    twins = TWINS.get(device.type, {})
    if device.type == "cuda" and not flash_runs(device):
        twins = {plain: twin for plain, twin in twins.items() if twin is not VarlenAttention}
    for part in module.modules():
        twin = twins.get(type(part))
        if twin is not None:
            part.__class__ = twin
    return module


def flash_runs(device: torch.device) -> bool:
    """Whether torch's flash kernels run on the CUDA card `device` (none without a card)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= FLASH_CAPABILITY


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """torch's attention kernels for training on `device`.

    On CUDA, torch prefers cuDNN's kernel for a masked attention (flash takes no mask), and cuDNN
    builds an execution plan for every new shape: with token batches nearly every batch of the
    first epoch is one, and planning outweighs the update (docs/speed.md). So CUDA training takes
    flash or memory-efficient kernels. Elsewhere torch's choice."""
    if device.type == "cuda":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()
