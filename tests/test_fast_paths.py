"""Guards for the fast paths (structure, not timing): a refactor that loses one fails here."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model, tiny_params, train_outputs

import transformer.kernels.loss as kernel_loss
from transformer.config import params_from_dict
from transformer.decoding.search import beam_search, greedy
from transformer.kernels.accelerate import accelerate
from transformer.kernels.select import attention_kernels
from transformer.kernels.softmax import float32_softmax
from transformer.model.attention import MultiHeadAttention
from transformer.training import precision as precision_module
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


def test_generator_projects_only_non_pad_positions(monkeypatch):
    """On a CPU, the model and the loss accelerated as training accelerates them (the generator a
    PaddedLinear, the loss a FusedLoss), the vocabulary projection takes the non-pad positions alone."""
    cpu = torch.device("cpu")
    model, loss = accelerate(_model(), cpu), accelerate(Loss(2, 0.1), cpu)
    rows = []
    model.generator.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[0]))
    fused = kernel_loss.fused_loss  # the fused loss reads the generator's weight, not its forward

    def counted(generator, hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return fused(generator, hidden, *args, **kwargs)

    monkeypatch.setattr(kernel_loss, "fused_loss", counted)
    tgt_out = torch.tensor([[5, 6, 1, 2, 2], [7, 1, 2, 2, 2], [5, 6, 7, 8, 1]])
    loss(model.generator, model(_src(), tgt_out), tgt_out)
    assert rows == [int((tgt_out != 2).sum())]


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


@pytest.mark.parametrize(("precision", "written_out"), [("bf16", True), ("fp16", False)])
def test_cpu_training_attends_written_out_in_bf16_alone(monkeypatch, vocab_dir, tmp_path, precision, written_out):
    seen = []
    original = precision_module.attention_kernels
    monkeypatch.setattr(
        precision_module,
        "attention_kernels",
        lambda device, bf16: seen.append((device.type, bf16)) or original(device, bf16),
    )
    params = params_from_dict(tiny_params(**{"train.epochs": 1, "train.max_steps": 2, "train.precision": precision}))
    train_module.train(params, vocab_dir, train_outputs(tmp_path))
    assert seen and set(seen) == {("cpu", written_out)}
    calls = _sdpa_calls(monkeypatch)
    model = _model(N=2).train()
    for bf16, expected in ((True, 0), (False, 3 * 2)):  # fp32: torch's own choice (flash), per attention
        calls.clear()
        with attention_kernels(torch.device("cpu"), bf16):
            model(_src(), torch.randint(4, 20, (3, 5)))
        assert len(calls) == expected
    calls.clear()
    model(_src(), torch.randint(4, 20, (3, 5)))
    assert len(calls) == 3 * 2  # outside training's kernels, as ever


def _attention_inputs(causal: bool, dtype=torch.float32):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = None if causal else (torch.arange(7) < torch.tensor([7, 4, 1])[:, None])[:, None, None, :]
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True], ids=["padding mask", "causal"])
def test_written_out_attention_gives_what_torchs_kernel_gives(monkeypatch, causal):
    attention = MultiHeadAttention(16, 2, self_attention=True).train()
    q, k, v, mask = _attention_inputs(causal)
    out = {}
    for written_out in (False, True):
        if written_out:  # not through torch's kernel
            monkeypatch.setattr(F, "scaled_dot_product_attention", None)
        with attention_kernels(torch.device("cpu"), True) if written_out else contextlib.nullcontext():
            y = attention._attend(q, k, v, mask, causal)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), (q, k, v))
        out[written_out] = y, *grads
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cpu_bf16_attention_runs_in_bf16_with_no_pass_of_torchs_kernel():
    """Written out, attention makes no float32 copies of its bf16 inputs and none of torch's math kernel's
    extra passes (its mask made additive, its softmax made safe for rows that attend to nothing); its
    forward scales and masks the scores in place, with no tensor of their own. Only the softmax's
    weights and the scores' gradient are copied back from float32 (float32_softmax)."""
    attention = MultiHeadAttention(16, 2, self_attention=True).train()
    q, k, v, mask = _attention_inputs(False, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), attention_kernels(torch.device("cpu"), True):
        with torch.profiler.profile(record_shapes=True) as forward:
            y = attention._attend(q, k, v, mask, False)
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


@pytest.mark.parametrize("bf16", [True, False])
def test_cuda_training_attends_without_cudnn(bf16):
    """cuDNN's attention plans every new shape anew; training's token batches keep changing shape."""
    b = torch.backends.cuda
    assert b.cudnn_sdp_enabled()  # torch's default, which the kernels below turn off for their extent
    with attention_kernels(torch.device("cuda"), bf16):
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
