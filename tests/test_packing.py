"""Packed batches: the token-wise layers skip the padding, with the padded result."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from torch.profiler import ProfilerActivity, profile

from transformer.data.vocab import PAD
from transformer.kernels import linear
from transformer.kernels.accelerate import accelerate
from transformer.kernels.linear import PaddedLinear
from transformer.kernels.packing import PackedTransformer, packing_of

V = 20
BELOW = PackedTransformer.pack_below


def _model(norm: str = "pre", dropout: float = 0.0):
    """The plain model; _packed(model) makes it the CPU's."""
    torch.manual_seed(0)
    return tiny_model(src_vocab=V, tgt_vocab=V, N=2, dropout=dropout, norm=norm, tie_embeddings=True)


def _packed(model, below: float = BELOW):
    model = accelerate(model, torch.device("cpu"))
    model.pack_below = below
    return model


def _padded(lengths: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, V, (len(lengths), max(lengths)), generator=g)
    return tokens.masked_fill(torch.arange(max(lengths)) >= torch.tensor(lengths)[:, None], PAD)


SRC, TGT = _padded([9, 3, 5, 1, 7], 1), _padded([7, 2, 4, 1, 6], 2)  # 56% and 57% real


def _outputs_and_gradients(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    real = model(SRC, TGT)[TGT != PAD]
    (real**2).sum().backward()
    return real.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_packed_outputs_and_gradients_equal_the_padded_ones(norm):
    model = _model(norm).train()
    padded, padded_grads = _outputs_and_gradients(model)
    packed, packed_grads = _outputs_and_gradients(_packed(model, below=2.0))  # every side packed
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _feed_forward_rows(model) -> list[int]:
    rows = []
    for stack in (model.encoder, model.decoder):
        stack.layers[0].ff.w_1.register_forward_hook(
            lambda module, inputs, output: rows.append(inputs[0].shape[:-1].numel())
        )
    return rows


def test_a_mostly_padded_batch_runs_its_token_wise_layers_on_real_tokens_only():
    model = _packed(_model())
    rows = _feed_forward_rows(model)
    out = model(SRC, TGT)
    assert rows == [int((SRC != PAD).sum()), int((TGT != PAD).sum())]
    assert out.shape == (*TGT.shape, 16)  # the caller still sees the padded layout
    assert torch.equal(out[TGT == PAD], torch.zeros_like(out[TGT == PAD]))


def test_a_mostly_real_batch_stays_padded():
    full, one_pad = _padded([6, 6, 6, 6], 3), _padded([6, 6, 6, 5], 4)  # 100% and 96% real
    assert packing_of(full, PAD, BELOW) is None and packing_of(one_pad, PAD, BELOW) is None
    model = _packed(_model())
    rows = _feed_forward_rows(model)
    model(one_pad, full)
    assert rows == [one_pad.numel(), full.numel()]


def test_unpack_restores_the_real_tokens_and_zeroes_the_padding():
    x = torch.randn(*SRC.shape, 3)
    p = packing_of(SRC, PAD, BELOW)
    assert p is not None and p.pack(x).shape == (int((SRC != PAD).sum()), 3)
    back = p.unpack(p.pack(x))
    real = (SRC != PAD)[..., None]
    assert torch.equal(back, torch.where(real, x, torch.zeros(())))


def test_row_buckets_are_eight_an_octave_at_most_an_eighth_above():
    buckets = {rows: linear.row_bucket(rows) for rows in range(1, 20_000)}
    for rows, size in buckets.items():
        assert rows <= size <= rows + max(7, rows // 8) and size % 8 == 0, rows
        assert linear.row_bucket(size) == size, rows  # a bucket's rows stay as they are
    assert len({buckets[rows] for rows in range(2049, 4097)}) == 8  # 2,304 to 4,096


def _linear_rows_and_result(x: torch.Tensor, bf16: bool) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """The rows of the matmuls a Linear(16, 24) ran on x (forward and backward), its output and gradients."""
    torch.manual_seed(0)
    layer = PaddedLinear(16, 24)
    x = x.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = layer(x)
        y.float().square().sum().backward()
    # addmm(bias, x, weightᵀ) forward; mm(grad y, weight) for x's gradient
    rows = [e.input_shapes[1][0] for e in prof.events() if e.name == "aten::addmm"]
    rows += [e.input_shapes[0][0] for e in prof.events() if e.name == "aten::mm" and e.input_shapes[1][0] == 24]
    return rows, y.detach(), [x.grad, layer.weight.grad, layer.bias.grad]


def test_a_linear_in_bf16_on_a_cpu_runs_on_bucketed_rows_and_gives_the_unpadded_result():
    """oneDNN builds a kernel for each row count it meets: padded to row_bucket's sizes, token batches'
    ever-new counts meet kernels already built. The padding is multiplied and dropped."""
    x = torch.randn(3, 37, 16)  # 111 rows: bucket 112
    rows, y, grads = _linear_rows_and_result(x, bf16=True)
    assert rows == [112, 112]
    fp32_rows, fp32_y, fp32_grads = _linear_rows_and_result(x, bf16=False)
    assert fp32_rows == [111, 111]  # fp32 runs on MKL, which builds no kernel per shape
    assert y.shape == (3, 37, 24) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), fp32_y, atol=0.05, rtol=0.02)
    for got, expected in zip(grads, fp32_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=0.2, rtol=0.02)


def test_a_bucketed_linear_copies_its_rows_once_each_way_and_zeroes_only_the_padding():
    """In bf16 on a CPU: x into the padded buffer (cast on the way), the output's gradient into one
    alike, the input's gradient out (cast back), and nothing zeroed but the padding rows."""
    layer = PaddedLinear(16, 24)
    x = torch.randn(3, 37, 16, requires_grad=True)  # 111 rows: bucket 112
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
    ops = [(e.name, e.input_shapes[0]) for e in prof.events() if e.input_shapes]
    assert [shape for name, shape in ops if name == "aten::copy_" and shape[:1] == [111]] == [
        [111, 16],
        [111, 24],
        [111, 16],
    ]
    assert not [shape for name, shape in ops if name in ("aten::fill_", "aten::zero_") and shape[:1] in ([111], [112])]
