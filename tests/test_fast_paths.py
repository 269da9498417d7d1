"""Guards for the fast paths (structure, not timing): a refactor that loses one fails here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model, tiny_params, train_outputs

from transformer.config import params_from_dict
from transformer.decoding.search import beam_search, greedy
from transformer.kernels import loss as kernel_loss
from transformer.kernels.accelerate import accelerate, attention_backends
from transformer.kernels.attention import CpuAttention, written_out
from transformer.kernels.softmax import float32_softmax
from transformer.model.attention import Mask, MultiHeadAttention
from transformer.training import train as train_module
from transformer.training.loss import Loss


def _model(N: int = 2):
    torch.manual_seed(0)
    return tiny_model(src_vocab=20, tgt_vocab=20, N=N, tie_embeddings=True).eval()


def _src():
    src = torch.randint(4, 20, (3, 6))
    src[0, 4:] = 2  # padding
    return src


def _sdpa_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every scaled_dot_product_attention call from now on."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or sdpa(*a, **k))
    return calls


def test_attention_goes_through_scaled_dot_product_attention(monkeypatch):
    calls = _sdpa_calls(monkeypatch)
    model = _model(N=2)
    model(_src(), torch.randint(4, 20, (3, 5)))
    assert len(calls) == 3 * 2  # encoder self, decoder self, decoder-source, per layer
    assert sum(bool(k.get("is_causal")) for k in calls) == 2  # decoder self-attention: causal, no mask tensor


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "whole"])
def test_generator_projects_only_non_pad_positions_on_a_cpu(monkeypatch, fuse):
    """The CPU's loss (FusedLoss) projects the non-pad positions alone; the plain loss projects every
    position, as an accelerator does, where selecting them would make the host wait."""
    model, loss = _model(), Loss(pad=2, smoothing=0.1)
    if fuse:
        loss = accelerate(loss, torch.device("cpu"))
    rows = []
    model.generator.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[:-1].numel()))
    fused = kernel_loss.fused_loss  # the fused loss reads the generator's weight, not its forward
    monkeypatch.setattr(
        kernel_loss, "fused_loss", lambda g, hidden, *a: rows.append(hidden.shape[0]) or fused(g, hidden, *a)
    )
    tgt_out = torch.tensor([[5, 6, 1, 2, 2], [7, 1, 2, 2, 2], [5, 6, 7, 8, 1]])
    loss(model.generator, model(_src(), tgt_out), tgt_out)
    assert rows == [int((tgt_out != 2).sum()) if fuse else tgt_out.numel()]


def test_training_batches_by_token_count(monkeypatch, vocab_dir, tmp_path):
    seen = []
    original = train_module.token_batches
    monkeypatch.setattr(train_module, "token_batches", lambda *a: seen.append(a[2]) or original(*a))
    params = params_from_dict(tiny_params(**{"train.epochs": 1, "train.max_steps": 2}))
    train_module.train(params, vocab_dir, train_outputs(tmp_path))
    assert params.train.max_tokens in seen


def test_decoding_feeds_one_token_per_step_to_the_cached_decoder():
    model = _model()
    lengths = []
    model.decoder.layers[0].self_attn.register_forward_hook(
        lambda module, inputs, output: lengths.append(inputs[0].shape[1])
    )
    max_len = torch.tensor([8, 8, 8])
    for search in (
        lambda: greedy(model, _src(), max_len, 0, 1),
        lambda: beam_search(model, _src(), 3, 0.6, max_len, 0, 1),
    ):
        lengths.clear()
        search()
        assert lengths and set(lengths) == {1}, "the decoder re-read the prefix instead of its cache"


@pytest.mark.parametrize(
    ("dtype", "sdpa_calls"), [(torch.bfloat16, 0), (torch.float16, 3 * 2), (torch.float32, 3 * 2)], ids=str
)
def test_the_cpus_attention_is_written_out_in_bf16_alone(monkeypatch, dtype, sdpa_calls):
    """Accelerated for a CPU, bf16 attention is written out (CpuAttention); fp16 and fp32 attention,
    and the plain model's in any dtype, go through torch's kernel, per attention of each layer."""
    calls = _sdpa_calls(monkeypatch)
    for model, expected in (
        (_model(N=2).train(), 3 * 2),
        (accelerate(_model(N=2), torch.device("cpu")).train(), sdpa_calls),
    ):
        calls.clear()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            model(_src(), torch.randint(4, 20, (3, 5)))
        assert len(calls) == expected


@pytest.mark.parametrize(("compile", "twins"), [(False, True), (True, False)], ids=["eager", "compiled"])
def test_training_takes_the_cpus_twins_unless_it_compiles(monkeypatch, vocab_dir, tmp_path, compile, twins):
    made = []
    original = train_module.compiled
    monkeypatch.setattr(train_module, "compiled", lambda step: made.append(step) or original(step, backend="eager"))
    original_step = train_module.StepLoss
    monkeypatch.setattr(train_module, "StepLoss", lambda *a, **k: made.append(original_step(*a, **k)) or made[-1])
    params = params_from_dict(tiny_params(**{"train.epochs": 1, "train.max_steps": 1, "train.compile": compile}))
    train_module.train(params, vocab_dir, train_outputs(tmp_path))
    attention = made[0].model.encoder.layers[0].self_attn
    assert (type(attention) is CpuAttention) == twins and isinstance(attention, MultiHeadAttention)


def _attention_inputs(causal: bool, dtype=torch.float32):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = None if causal else (torch.arange(7) < torch.tensor([7, 4, 1])[:, None])[:, None, None, :]
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True], ids=["padding mask", "causal"])
def test_written_out_attention_gives_what_torchs_kernel_gives(causal):
    q, k, v, mask = _attention_inputs(causal)
    out = {}
    for written in (False, True):
        if written:
            y = written_out(q, k, v, Mask(keys=mask, causal=causal), 0.0)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), (q, k, v))
        out[written] = y, *grads
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cpu_bf16_attention_runs_in_bf16_with_no_pass_of_torchs_kernel():
    """Written out, attention makes no float32 copies of its bf16 inputs and none of torch's math kernel's
    extra passes (its mask made additive, its softmax made safe for rows that attend to nothing); its
    forward scales and masks the scores in place, with no tensor of their own. Only the softmax's
    weights and the scores' gradient are copied back from float32 (float32_softmax)."""
    q, k, v, mask = _attention_inputs(False, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.profiler.profile(record_shapes=True) as forward:
            y = written_out(q, k, v, Mask(keys=mask), 0.0)
        with torch.profiler.profile(record_shapes=True) as prof:
            y.sum().backward()
    ops = {e.name for e in forward.events()}
    assert {"aten::mul_", "aten::masked_fill_"} <= ops and not ops & {"aten::mul", "aten::div", "aten::masked_fill"}
    ops |= {e.name for e in prof.events()}
    assert not ops & {"aten::scaled_dot_product_attention", "aten::_safe_softmax", "aten::where", "aten::isneginf"}
    events = [*forward.events(), *prof.events()]
    copies = [e.input_shapes[0] for e in events if e.name == "aten::_to_copy" and e.input_shapes[0]]
    # of a tensor (scalars are cast as ever): the weights back to bf16, forward, and the scores' gradient, backward
    assert copies == [[3, 2, 7, 7]] * 2
    softmax = [e.input_shapes[0] for e in forward.events() if e.name == "aten::_softmax"]
    assert softmax == [[3, 2, 7, 16]]  # rows of 7 scores padded to a float32 vector's 16
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("length", [7, 20], ids=["rows padded", "rows as they are"])
def test_the_softmax_of_bf16_scores_is_float32s_forward_and_back(length):
    """The written-out attention's softmax of bf16 scores gives float32's weights and gradient, each
    rounded once to bf16 (a softmax in bf16 rounds the weights its backward reads: about a third of
    the gradient's values then differ), on rows shorter than a float32 vector, padded, and longer;
    masked (-inf) scores get no weight and no gradient."""
    torch.manual_seed(0)
    scores = (torch.randn(5, 2, 3, length) * 4).bfloat16()
    scores[0, :, :, length // 2 :] = float("-inf")
    scores.requires_grad_()
    grad = torch.randn(scores.shape).bfloat16()
    weights = float32_softmax(scores)
    (d_scores,) = torch.autograd.grad(weights, scores, grad)
    x = scores.detach().float().requires_grad_()
    reference = x.softmax(-1)
    (d_reference,) = torch.autograd.grad(reference, x, grad.float())
    assert weights.shape == d_scores.shape == scores.shape and weights.dtype == d_scores.dtype == torch.bfloat16
    assert torch.all(weights[0, :, :, length // 2 :] == 0) and torch.all(d_scores[0, :, :, length // 2 :] == 0)
    for got, expected in ((weights, reference), (d_scores, d_reference)):
        assert (got == expected.bfloat16()).float().mean() > 0.99


def test_cuda_training_attends_without_cudnn():
    """cuDNN's attention plans every new shape anew; training's token batches keep changing shape."""
    b = torch.backends.cuda
    assert b.cudnn_sdp_enabled()  # torch's default, which the kernels below turn off for their extent
    with attention_backends(torch.device("cuda")):
        assert not b.cudnn_sdp_enabled()
        assert b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled() and b.math_sdp_enabled()
    assert b.cudnn_sdp_enabled()


def test_cpu_training_steps_with_the_fused_adam(monkeypatch, vocab_dir, tmp_path):
    made = []
    original = torch.optim.Adam
    monkeypatch.setattr(torch.optim, "Adam", lambda *a, **k: made.append(k) or original(*a, **k))
    params = params_from_dict(tiny_params(**{"train.epochs": 1, "train.max_steps": 1}))
    train_module.train(params, vocab_dir, train_outputs(tmp_path))
    assert [k.get("fused") for k in made] == [True]
