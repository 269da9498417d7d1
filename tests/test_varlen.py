"""VarlenAttention, CUDA's twin of MultiHeadAttention (kernels/varlen.py): its layout of a padded batch as
variable-length segments computes the key-masked attention, padding queries included.

torch's variable-length flash kernel runs only on CUDA cards. On a CPU the tests give the twin
`segments`, the kernel's definition written out (each query segment attends to the key segment of
the same number), so that the layout, the offsets and the fallbacks are held to the plain attention
here; the CUDA test holds the real kernel to it on a card (bench/gpu_check.py runs it)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DataDependentOps, HostReads, tiny_model

from transformer.kernels.accelerate import accelerate
from transformer.kernels.varlen import VarlenAttention, by_sentence
from transformer.model.attention import Mask, MultiHeadAttention


def segments(q, k, v, *, cu_q, cu_k, max_q, max_k, calls: list | None = None):
    """The variable-length kernel's definition (flash_kernel's): query rows cu_q[i]:cu_q[i + 1] of q
    (rows, h, d_k) attend to key rows cu_k[i]:cu_k[i + 1]; every row of q and k in one segment, none
    longer than max_q and max_k."""
    if calls is not None:
        calls.append(len(cu_q) - 1)
    assert cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    assert starts_q[0] == starts_k[0] == 0 and starts_q[-1] == len(q) and starts_k[-1] == len(k)
    out = []
    for (a, b), (c, d) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:])):
        assert 0 <= b - a <= max_q and 0 <= d - c <= max_k
        if b > a:
            scores = q[a:b].transpose(0, 1) @ k[c:d].transpose(0, 1).transpose(1, 2) / math.sqrt(q.size(-1))
            out.append((scores.softmax(-1) @ v[c:d].transpose(0, 1)).transpose(0, 1))
    return torch.cat(out)


class Segments(VarlenAttention):
    """The twin with the kernel's definition in its place, in float32 too, counting its calls."""

    calls: list = []
    kernel = staticmethod(lambda *args, **kwargs: segments(*args, **kwargs, calls=Segments.calls))
    dtypes = (torch.float32,)


class Refusing(VarlenAttention):
    """The twin in float32 too, its kernel a failure."""

    kernel = staticmethod(lambda *args, **kwargs: pytest.fail("the kernel was called"))
    dtypes = (torch.float32,)


def _leaves(B: int, h: int, T: int, S: int, d_k: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, n, d_k, generator=g).requires_grad_() for n in (T, S, S)]


@pytest.mark.parametrize("T, S", [(5, 7), (6, 6)])  # source attention, self-attention
def test_sentence_segments_give_the_key_masked_attention_and_its_gradients(T, S):
    real = torch.tensor([S, 1, 4, S])  # full sentences too: their padding segments are empty
    keys = (torch.arange(S) < real[:, None])[:, None, None, :]  # (B, 1, 1, S), as Transformer.src_mask
    weights = torch.randn(4, 2, T, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for attend in (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keys), None):
        q, k, v = _leaves(4, 2, T, S)
        out = attend(q, k, v) if attend else by_sentence(q, k, v, keys, segments)
        (out * weights).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for name, ours, plain in zip(("output", "dq", "dk", "dv"), results[1], results[0]):
        torch.testing.assert_close(ours, plain, msg=name)  # every row, the padding queries' too


def test_the_segments_are_laid_out_on_the_device_without_a_host_read():
    """Nothing the host would wait for on a card: the offsets come from the mask's sums as tensors."""
    q, k, v = _leaves(4, 2, 5, 7)
    keys = (torch.arange(7) < torch.tensor([7, 1, 4, 7])[:, None])[:, None, None, :]
    with HostReads() as calls, DataDependentOps() as ops:
        out = by_sentence(q, k, v, keys, lambda q, k, v, **offsets: torch.zeros_like(q))
    assert calls.seen + ops.seen == [] and out.shape == q.shape


def _batch():
    torch.manual_seed(2)
    src, tgt = torch.randint(4, 20, (3, 7)), torch.randint(4, 20, (3, 5))
    src[1, 3:], src[2, 6:], tgt[1, 2:] = 2, 2, 2  # padding
    return src, tgt


def test_in_training_the_twin_takes_every_key_masked_attention_and_trains_as_the_plain_model():
    torch.manual_seed(0)
    plain = tiny_model(src_vocab=20, tgt_vocab=20, N=2, tie_embeddings=True).train()
    twin = copy.deepcopy(plain)
    for module in twin.modules():
        if type(module) is MultiHeadAttention:
            module.__class__ = Segments
    src, tgt = _batch()
    Segments.calls.clear()
    outs = [model(src, tgt, copies=2) for model in (plain, twin)]  # R-Drop's copies share the encoding
    assert Segments.calls == [2 * 3] * 2 + [2 * 6] * 2  # the encoder's 2 layers, then source attention's 2
    torch.testing.assert_close(outs[1], outs[0])
    for out in outs:
        out.square().mean().backward()
    for (name, mine), theirs in zip(twin.named_parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, msg=name)


def test_the_twin_leaves_to_torch_what_its_kernel_cannot_take():
    """Evaluation and decoding, kept weights, dropped weights and dtypes other than the kernel's: no call."""
    torch.manual_seed(0)
    model = tiny_model(src_vocab=20, tgt_vocab=20, N=1, tie_embeddings=True)
    for module in model.modules():
        if type(module) is MultiHeadAttention:
            module.__class__ = VarlenAttention  # the flash kernel itself: a call would fail on a CPU
    src, tgt = _batch()
    model.train()(src, tgt)  # float32: not a dtype flash computes in
    attentions = [m for m in model.modules() if isinstance(m, VarlenAttention)]
    for attention in attentions:
        attention.__class__ = Refusing
    model.eval()(src, tgt)
    for attention in attentions:
        attention.keep_weights = True
    model.train()(src, tgt)
    for attention in attentions:
        attention.keep_weights, attention.dropout = False, 0.1
    model(src, tgt)
    self_attention = model.encoder.layers[0].self_attn
    self_attention.dropout = 0.0  # a causal mask with keys: the kernel's segments know no order
    self_attention(torch.randn(3, 7, 16), None, Mask(keys=src[:, None, None, :] != 2, causal=True))


def test_a_machine_without_a_flash_card_keeps_torchs_attention():
    model = accelerate(tiny_model(src_vocab=20, tgt_vocab=20), torch.device("cuda"))
    kinds = {type(m) for m in model.modules() if isinstance(m, MultiHeadAttention)}
    assert kinds == (
        {VarlenAttention}
        if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
        else {MultiHeadAttention}
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flash_varlen_training_matches_the_masked_attention():
    """On a card: the real kernel in bf16 is as close to the float32 model, outputs and every gradient,
    as torch's masked attention in bf16 is (bf16's rounding, not a layout, is all that may differ)."""
    torch.manual_seed(0)
    exact = tiny_model(src_vocab=20, tgt_vocab=20, N=2, tie_embeddings=True).cuda().train()
    plain, twin = copy.deepcopy(exact), accelerate(copy.deepcopy(exact), torch.device("cuda"))
    flash = torch.cuda.get_device_capability() >= (8, 0)  # an older card keeps torch's attention, as plain
    assert any(type(m) is VarlenAttention for m in twin.modules()) == flash
    src, tgt = (t.cuda() for t in _batch())
    results = []
    for model, half in ((exact, False), (plain, True), (twin, True)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=half):
            out = model(src, tgt, copies=2).float()
        out.square().mean().backward()
        results.append([out.detach()] + [p.grad for p in model.parameters()])
    for k, (reference, masked, ours) in enumerate(zip(*results)):
        error, allowed = (ours - reference).abs().max(), 2 * (masked - reference).abs().max() + 1e-3
        assert error <= allowed, f"{'output' if k == 0 else f'gradient {k}'}: {error} > {allowed}"
