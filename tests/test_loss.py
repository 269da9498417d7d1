"""The training losses against their definitions (section 5.4; R-Drop), written out by hand, and the
CPU's twin (FusedLoss, which accelerate swaps in) against the plain Loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DataDependentOps, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import transformer.kernels.loss as kernel_loss
from transformer.data.batching import Batch
from transformer.kernels.accelerate import accelerate
from transformer.kernels.loss import FusedLoss, LossSpec, _Fused, _rdrop_rows, _rdrop_sum, fused_loss
from transformer.training.loss import Loss, batch_loss

PAD = 2
CPU = torch.device("cpu")


def _loss(fuse: bool, smoothing: float, zero_pad: bool = False) -> Loss:
    """The loss as defined (whole: every position projected and the pad ones ignored, as on an
    accelerator), or as a CPU's training takes it (accelerated: FusedLoss)."""
    loss = Loss(PAD, smoothing, zero_pad)
    return accelerate(loss, CPU) if fuse else loss


@pytest.fixture(params=[False, True], ids=["whole", "fused"])
def make_loss(request):
    """Builds a test's loss whole, and again accelerated for a CPU, the generator and the loss fused."""

    def make(smoothing: float, zero_pad: bool = False) -> Loss:
        loss = _loss(request.param, smoothing, zero_pad)
        assert type(loss) is (FusedLoss if request.param else Loss)
        return loss

    return make


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_token_loss_is_smoothed_cross_entropy_over_real_tokens(smoothing, make_loss):
    torch.manual_seed(0)
    vocab = 20
    model = tiny_model(src_vocab=vocab, tgt_vocab=vocab, tie_embeddings=True).eval()
    tgt_out = torch.tensor([[5, 6, 1, PAD], [7, 1, PAD, PAD]])
    hidden = torch.randn(2, 4, 16)

    log_probs = torch.log_softmax(model.generator(hidden), dim=-1).detach()
    expected = 0.0
    for row, col in (tgt_out != PAD).nonzero().tolist():
        target = torch.full((vocab,), smoothing / vocab)
        target[tgt_out[row, col]] += 1 - smoothing
        expected -= float((target * log_probs[row, col]).sum())

    loss = make_loss(smoothing)
    assert float(loss(model.generator, hidden, tgt_out).detach()) == pytest.approx(expected, rel=1e-5)


def _tiny(dropout: float = 0.0):
    torch.manual_seed(0)
    return tiny_model(src_vocab=20, tgt_vocab=20, dropout=dropout, tie_embeddings=True)


TGT_OUT = torch.tensor([[5, 6, 1, PAD], [7, 1, PAD, PAD]])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@torch.no_grad()  # values only
def test_rdrop_loss_of_two_equal_passes_is_the_token_loss(smoothing, make_loss):
    model, hidden, loss = _tiny().eval(), torch.randn(2, 4, 16), make_loss(smoothing)
    alone = loss(model.generator, hidden, TGT_OUT)
    assert float(loss.rdrop(model.generator, hidden.repeat(2, 1, 1), TGT_OUT, alpha=5.0)) == pytest.approx(
        float(alone), rel=1e-6
    )


@torch.no_grad()  # values only
def test_rdrop_loss_is_the_mean_cross_entropy_plus_a_quarter_alpha_of_the_symmetric_kl(make_loss):
    model, first, second = _tiny().eval(), torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    loss = make_loss(0.1)
    keep = TGT_OUT != PAD
    p = model.generator(first[keep]).log_softmax(-1)
    q = model.generator(second[keep]).log_softmax(-1)
    kl = F.kl_div(q, p, log_target=True, reduction="sum") + F.kl_div(
        p, q, log_target=True, reduction="sum"
    )  # KL(P||Q) + KL(Q||P)
    ce = (loss(model.generator, first, TGT_OUT) + loss(model.generator, second, TGT_OUT)) / 2
    got = loss.rdrop(model.generator, torch.cat([first, second]), TGT_OUT, alpha=3.0)
    assert float(kl) > 0.1
    assert float(got) == pytest.approx(float(ce + 3.0 / 4 * kl), rel=1e-5)


@torch.no_grad()  # values only
def test_partial_rdrop_passes_the_drawn_share_twice_and_weighs_every_sentence_as_one_pass(make_loss):
    model, loss = _tiny().eval(), make_loss(0.1)  # no dropout: a sentence's two passes are equal and R-Drop's KL is 0
    tgt_out = torch.tensor([[5, 6, 1, PAD], [7, 1, PAD, PAD], [8, 9, 10, 1], [11, 1, PAD, PAD]])
    tgt_in = torch.cat([torch.zeros(4, 1, dtype=torch.long), tgt_out[:, :-1]], 1).masked_fill(tgt_out == PAD, PAD)
    batch = Batch(
        torch.tensor([[4, 5, 1, PAD], [6, 1, PAD, PAD], [7, 8, 9, 1], [10, 1, PAD, PAD]]), tgt_in, tgt_out, 11
    )
    seen = []

    def forward(src, tgt):
        seen.append(src)
        return model(src, tgt)

    plain = batch_loss(forward, model.generator, batch, loss)
    drawn = set()
    for _ in range(8):
        partial = batch_loss(forward, model.generator, batch, loss, rdrop=5.0, share=0.5)
        assert float(partial) == pytest.approx(float(plain), rel=1e-5)  # every sentence's CE counted once
        assert seen[-1].size(0) == 4 + 2  # half the batch a second time
        drawn.add(tuple(map(tuple, seen[-1][4:].tolist())))
    assert len(drawn) > 1  # the sentences passed twice are drawn afresh each time
    full = batch_loss(forward, model.generator, batch, loss, rdrop=5.0)
    assert seen[-1].size(0) == 8 and float(full) == pytest.approx(float(plain), rel=1e-5)


def test_partial_rdrop_forward_and_backward_wait_on_no_data_dependent_op():
    # The plain model and loss, as an accelerator runs them: neither packs nor drops the padding before the generator.
    model, loss = _tiny(dropout=0.1).train(), Loss(PAD, 0.1)
    tgt_out = TGT_OUT.repeat(3, 1)
    batch = Batch(torch.tensor([[4, 5, 6, 1]]).repeat(6, 1), torch.tensor([[0, 5, 6, 1]]).repeat(6, 1), tgt_out, 18)
    with DataDependentOps() as ops:
        batch_loss(model, model.generator, batch, loss, rdrop=5.0, share=0.5).backward()
    assert ops.seen == []
    with DataDependentOps() as ops:  # the counter sees what a boolean mask costs
        batch.src[batch.src[:, 0] > 0].sum().item()
    assert "_local_scalar_dense.default" in ops.seen and len(ops.seen) >= 2


@torch.no_grad()  # values only
def test_partial_rdrop_adds_the_kl_of_the_drawn_sentences(make_loss):
    model, loss = _tiny(dropout=0.3).train(), make_loss(0.1)
    tgt_out = TGT_OUT.repeat(2, 1)
    batch = Batch(torch.tensor([[4, 5, 6, 1]]).repeat(4, 1), torch.tensor([[0, 5, 6, 1]]).repeat(4, 1), tgt_out, 10)

    def value(alpha: float) -> float:
        torch.manual_seed(1)  # the same draw and the same dropout masks for both
        return float(batch_loss(model, model.generator, batch, loss, rdrop=alpha, share=0.5))

    assert value(5.0) > value(0.001)


@torch.no_grad()  # values only
def test_the_two_passes_of_a_repeated_batch_draw_their_own_dropout(make_loss):
    model, loss = _tiny(dropout=0.3).train(), make_loss(0.1)
    src, tgt_in = torch.tensor([[4, 5, 6, 1]]).repeat(2, 1), torch.tensor([[0, 5, 6, 1]]).repeat(2, 1)
    hidden = model(src.repeat(2, 1), tgt_in.repeat(2, 1))
    first, second = hidden.chunk(2)
    assert not torch.allclose(first, second)  # else R-Drop's KL would be 0 and its second pass wasted
    assert float(loss.rdrop(model.generator, hidden, TGT_OUT, alpha=5.0)) > float(
        loss.rdrop(model.generator, hidden, TGT_OUT, alpha=0.0)
    )


@pytest.mark.parametrize("smoothing, zero_pad", [(0.0, False), (0.1, False), (0.1, True)])
def test_rdrop_loss_gradient_is_that_of_its_formula(smoothing, zero_pad, make_loss):
    """The fused loss writes its gradient out by hand (for speed): it must be autograd's of the formula,
    and pad positions must get none."""
    torch.manual_seed(0)
    vocab, rows = 11, 6
    hidden = torch.randn(2, rows, 8, dtype=torch.float64, requires_grad=True)
    generator = torch.nn.Linear(8, vocab).double()
    tgt_out = torch.randint(3, vocab, (1, rows))
    tgt_out[0, 2] = PAD

    got = make_loss(smoothing, zero_pad).rdrop(generator, hidden, tgt_out, alpha=5.0)
    got_grad, *got_generator = torch.autograd.grad(2.5 * got, (hidden, generator.weight, generator.bias))

    keep = (tgt_out != PAD).flatten()
    logits = generator(hidden.flatten(0, 1)).view(2, rows, vocab)[:, keep]  # (2 passes, kept rows, V)
    log_probs = logits.log_softmax(-1)
    target = tgt_out.flatten()[keep]
    smooth = torch.full((vocab,), smoothing / (vocab - 2 if zero_pad else vocab), dtype=torch.float64)
    if zero_pad:
        smooth[PAD] = 0.0
    wanted = smooth.repeat(len(target), 1)
    gold = torch.full((len(target), 1), 1 - smoothing, dtype=torch.float64)
    wanted = wanted.scatter(1, target[:, None], gold) if zero_pad else wanted.scatter_add(1, target[:, None], gold)
    ce = -(wanted * log_probs).sum(-1).sum(-1)  # (2,): each pass's sum over its rows
    p, q = log_probs
    kl = ((p.exp() - q.exp()) * (p - q)).sum()
    expected = ce.mean() + 5.0 / 4 * kl
    expected_grad, *expected_generator = torch.autograd.grad(2.5 * expected, (hidden, generator.weight, generator.bias))

    # the plain loss takes its logits to float32 (as it does a bf16 generator's under autocast)
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert torch.allclose(got_grad, expected_grad, rtol=1e-4, atol=1e-6)
    for got_part, expected_part in zip(got_generator, expected_generator):  # the weight's and the bias's
        assert torch.allclose(got_part, expected_part, rtol=1e-4, atol=1e-6)
    assert float(got_grad[:, 2].abs().max()) == 0.0  # the pad position

    # In float64, fused from the hidden states on, with the pad rows kept among the rows: to rounding.
    rows_in = hidden.detach().flatten(0, 1).requires_grad_()
    weight, bias = generator.weight.detach().requires_grad_(), generator.bias.detach().requires_grad_()
    target = tgt_out.flatten().repeat(2)
    spec = LossSpec(PAD, smoothing, zero_pad, alpha=5.0)
    assert torch.autograd.gradcheck(
        lambda x, w, b: _Fused.apply(x, w, b, target, spec, torch.is_grad_enabled()), (rows_in, weight, bias)
    )


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero_pad", [False, True])
def test_fused_rdrop_loss_in_blocks_is_bit_for_bit_the_loss_in_one(monkeypatch, bf16, zero_pad):
    """On a CPU the fused loss works on a block of rows at a time (for speed): its value and
    gradients must be those of one block of every row, to the bit, in fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    vocab, n = 50, 23
    rows = 3 * torch.randn(2 * n, 8)
    generator = torch.nn.Linear(8, vocab)
    target = torch.randint(3, vocab, (n,)).repeat(2)
    target[[4, n + 4]] = PAD

    def run(block: int) -> list[torch.Tensor]:
        monkeypatch.setattr(kernel_loss, "_BLOCK", block)
        x = rows.clone().requires_grad_()
        generator.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = fused_loss(generator, x, target, LossSpec(PAD, 0.1, zero_pad, alpha=5.0))
        (loss / 17).backward()
        return [loss, x.grad, generator.weight.grad.clone(), generator.bias.grad.clone()]

    whole, blocked = run(1 << 40), run(5 * vocab)  # blocks of 5 pairs: four whole ones and one of 3
    assert float(blocked[1].abs().sum()) > 0
    assert float(blocked[1][[4, n + 4]].abs().max()) == 0.0  # the pad rows
    for one, in_blocks in zip(whole, blocked):  # the value, d hidden, d weight, d bias
        assert torch.equal(one, in_blocks)


def test_rdrop_loss_under_autocast_is_its_float32_value():
    """Autocast computes vecdot in bf16; the KL term of the reported loss must not be rounded so."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2 * 30, 500)).to(torch.bfloat16)
    target = torch.randint(3, 500, (30,)).repeat(2)
    spec = LossSpec(PAD, 0.1, alpha=5.0)
    keep = target != PAD
    ce, kl, _ = _rdrop_rows(logits.float(), target, spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_ce, autocast_kl, _ = _rdrop_rows(logits, target, spec)
        autocast = _rdrop_sum(autocast_ce, autocast_kl, keep, spec.alpha)
    assert autocast.dtype == torch.float32
    assert torch.equal(autocast_kl, kl)
    assert torch.equal(autocast, _rdrop_sum(ce, kl, keep, spec.alpha))


FUSED_VOCAB = 50


def _fused_batch() -> Batch:
    """Six sentences of 23 real target tokens in all (a prime: no chunk size divides it), with padding."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 2, 5, 3, 4, 3])
    tgt_out = torch.randint(3, FUSED_VOCAB, (6, 6), generator=g)
    tgt_out[torch.arange(6)[None, :] >= lengths[:, None]] = PAD
    tgt_in = torch.cat([torch.zeros(6, 1, dtype=torch.long), tgt_out[:, :-1]], 1).masked_fill(tgt_out == PAD, PAD)
    return Batch(torch.randint(3, FUSED_VOCAB, (6, 5), generator=g), tgt_in, tgt_out, int(lengths.sum()))


def _loss_and_gradients(monkeypatch, fuse: bool, chunk: int, bf16: bool, terms: dict, passes: dict):
    """batch_loss (with `passes`: rdrop, share) of a tiny tied-embedding model in training (dropout on),
    and every parameter's gradient: through the decoder they hold d loss / d hidden, and the tied
    embedding both of its uses' gradients. `terms`: the Loss's smoothing and zero_pad."""
    monkeypatch.setattr(kernel_loss, "_CHUNK", chunk)
    torch.manual_seed(0)
    model = tiny_model(src_vocab=FUSED_VOCAB, tgt_vocab=FUSED_VOCAB, dropout=0.1, tie_embeddings=True).train()
    calls, hidden = [], []
    monkeypatch.setattr(kernel_loss, "_Fused", _Spy(calls))

    def forward(src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        hidden.append(model(src, tgt_in))
        hidden[-1].retain_grad()
        return hidden[-1]

    torch.manual_seed(1)  # the same dropout masks and partial R-Drop's draw both ways
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        value = batch_loss(forward, model.generator, _fused_batch(), _loss(fuse, **terms), **passes)
    (2.5 * value).backward()
    assert bool(calls) == fuse
    return value.detach(), {"hidden": hidden[-1].grad} | {name: p.grad for name, p in model.named_parameters()}


class _Spy:
    """Stands in for _Fused and records that it was applied."""

    def __init__(self, calls: list):
        self.calls = calls

    def apply(self, *args):
        self.calls.append(args)
        return _Fused.apply(*args)


# Each loss: the Loss's terms (smoothing, zero_pad), and batch_loss's passes (rdrop, share).
LOSSES = {
    "nll": (dict(smoothing=0.0), {}),
    "smoothed": (dict(smoothing=0.1), {}),
    "zero_pad": (dict(smoothing=0.1, zero_pad=True), {}),
    "rdrop": (dict(smoothing=0.1), dict(rdrop=5.0)),
    "rdrop_zero_pad": (dict(smoothing=0.1, zero_pad=True), dict(rdrop=5.0)),
    "partial_rdrop": (dict(smoothing=0.1), dict(rdrop=5.0, share=0.5)),
}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 7 * FUSED_VOCAB, 1 << 40], ids=["a row", "7 rows", "one chunk"])
@pytest.mark.parametrize("loss", LOSSES)
def test_fused_loss_and_its_gradients_are_the_whole_ones(monkeypatch, loss, chunk, bf16):
    """The generator and loss fused, a chunk of rows at a time (one row or pair, 7 rows or 3 pairs of
    23, or all), on the real tokens alone (a CPU's rows), give the whole loss's value and gradients (the
    plain Loss's, which projects every position and ignores the pad ones, as an accelerator does): to
    float32's rounding, or under bf16 autocast to a few roundings of its bf16 matmuls. There the value
    stays close (both take their logits in bf16) and the gradients of hidden and of the tied weight are
    compared: a bf16 model's backward magnifies the roundings on the way to the encoder's first norm."""
    whole, expected = _loss_and_gradients(monkeypatch, False, chunk, bf16, *LOSSES[loss])
    fused, got = _loss_and_gradients(monkeypatch, True, chunk, bf16, *LOSSES[loss])
    assert float(fused) == pytest.approx(float(whole), rel=1e-5 if bf16 else 1e-6)
    for name in ["hidden", "src_embed.lut.weight"] if bf16 else expected:
        grad = expected[name]
        assert got[name] is not None and got[name].dtype == grad.dtype, name
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((got[name] - grad).abs().max()) <= (2e-2 if bf16 else 1e-5) * scale, name


@pytest.mark.parametrize("rdrop", [False, True], ids=["token loss", "R-Drop"])
def test_fused_loss_equals_the_plain_loss_which_is_the_papers_formula(monkeypatch, rdrop):
    """The plain Loss is the paper's: the label-smoothed cross-entropy summed over the non-pad tokens
    (section 5.4), and R-Drop's objective (Liang et al. 2021: both passes' cross-entropies plus alpha / 2
    times the symmetric KL of their distributions) halved. FusedLoss, its CPU twin, gives the plain
    Loss's value and gradients (of hidden, the weight and the bias) to float32's rounding."""
    smoothing, alpha = 0.1, 3.0
    torch.manual_seed(0)
    generator = torch.nn.Linear(16, FUSED_VOCAB)
    tgt_out = _fused_batch().tgt_out
    hidden = torch.randn(2 * len(tgt_out) if rdrop else len(tgt_out), tgt_out.size(1), 16)
    keep = tgt_out != PAD

    def paper(x: torch.Tensor) -> torch.Tensor:
        def ce(logits):
            return F.cross_entropy(logits[keep], tgt_out[keep], reduction="sum", label_smoothing=smoothing)

        if not rdrop:
            return ce(generator(x))
        first, second = generator(x).chunk(2)
        p, q = first[keep].log_softmax(-1), second[keep].log_softmax(-1)
        kl = F.kl_div(q, p, log_target=True, reduction="sum") + F.kl_div(p, q, log_target=True, reduction="sum")
        return (ce(first) + ce(second) + alpha / 2 * kl) / 2

    def of(loss: Loss):
        return lambda x: loss.rdrop(generator, x, tgt_out, alpha) if rdrop else loss(generator, x, tgt_out)

    def run(value_of) -> tuple[float, list[torch.Tensor]]:
        x = hidden.clone().requires_grad_()
        generator.zero_grad()
        value = value_of(x)
        value.backward()
        return float(value.detach()), [x.grad, generator.weight.grad.clone(), generator.bias.grad.clone()]

    calls = []
    monkeypatch.setattr(kernel_loss, "_Fused", _Spy(calls))
    expected, expected_grads = run(paper)
    plain, plain_grads = run(of(Loss(PAD, smoothing)))
    fused, fused_grads = run(of(FusedLoss(PAD, smoothing)))
    assert len(calls) == 1  # the fused loss alone took _Fused
    assert plain == pytest.approx(expected, rel=1e-6)
    assert fused == pytest.approx(plain, rel=1e-6)
    for name, grad, plain_grad, fused_grad in zip(
        ["hidden", "weight", "bias"], expected_grads, plain_grads, fused_grads
    ):
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((plain_grad - grad).abs().max()) <= 1e-5 * scale, name
        assert float((fused_grad - plain_grad).abs().max()) <= 1e-5 * scale, name


def test_an_accelerated_loss_fuses_every_batch_with_a_linear_generator(monkeypatch):
    """On a CPU the accelerated loss takes the fused path for a batch of any size, so no batch holds
    every logit in float32 at once; a generator of other math than a Linear's (which _Fused repeats)
    keeps the plain loss."""
    calls = []
    monkeypatch.setattr(kernel_loss, "_Fused", _Spy(calls))
    torch.manual_seed(0)
    loss = accelerate(Loss(PAD, 0.1), CPU)
    linear = torch.nn.Linear(16, FUSED_VOCAB, bias=False)
    for rows, length in ((1, 1), (6, 6), (64, 40)):
        tgt_out = torch.randint(3, FUSED_VOCAB, (rows, length))
        hidden = torch.randn(rows, length, 16)
        calls.clear()
        loss(linear, hidden, tgt_out)
        loss.rdrop(linear, hidden.repeat(2, 1, 1), tgt_out, 5.0)
        assert len(calls) == 2, (rows, length)
    calls.clear()
    other = torch.nn.Sequential(linear)  # not the math _Fused repeats
    value = loss(other, hidden, tgt_out)
    assert calls == []
    assert torch.equal(value, Loss(PAD, 0.1)(other, hidden, tgt_out))


class _OpNames(TorchDispatchMode):
    """The names of the ops run, without their overloads."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


class _Matmuls(_OpNames):
    """Counts matrix products."""

    @property
    def count(self) -> int:
        return sum(name in ("mm", "addmm", "bmm", "matmul", "linear") for name in self.names)


class _Copies(_OpNames):
    """The ops' names, and the shapes of what the copies and casts write (copy_) or read (_to_copy)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("copy_", "_to_copy"):
            self.shapes.append(list(args[0].shape))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("rdrop", [False, True], ids=["token loss", "R-Drop"])
def test_the_fused_loss_in_bf16_casts_its_gradient_a_block_at_a_time(monkeypatch, rdrop):
    """Under bf16 autocast the fused loss casts each block's float32 gradient to bf16 (as the generator's
    matmuls take it) while the block is in cache: no copy spans more of the logits' rows than a block.
    And the plain loss takes its log-probabilities from the softmax's maxima, with no log-softmax pass."""
    vocab, rows = 40, 30
    monkeypatch.setattr(kernel_loss, "_BLOCK", 4 * vocab)  # 4 rows, or 4 pairs of rows, a block
    torch.manual_seed(0)
    generator = torch.nn.Linear(16, vocab, bias=False)
    hidden = torch.randn(2 * rows if rdrop else rows, 1, 16, requires_grad=True)
    target = torch.randint(3, vocab, (rows, 1))
    loss = FusedLoss(PAD, 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16), _Copies() as ops:
        value = loss.rdrop(generator, hidden, target, alpha=5.0) if rdrop else loss(generator, hidden, target)
        value.backward()
    copies = [shape for shape in ops.shapes if shape[-1] == vocab]
    assert copies and max(shape[0] for shape in copies) == 4, copies
    assert rdrop or "_log_softmax" not in ops.names


def test_fused_loss_without_a_graph_computes_no_gradient(monkeypatch):
    """Validation (no_grad) pays the generator's matmul alone, one a chunk; training three."""
    monkeypatch.setattr(kernel_loss, "_CHUNK", 10 * FUSED_VOCAB)  # 23 rows: 3 chunks
    torch.manual_seed(0)
    model = tiny_model(src_vocab=FUSED_VOCAB, tgt_vocab=FUSED_VOCAB, tie_embeddings=True)
    hidden, tgt_out = torch.randn(6, 6, 16, requires_grad=True), _fused_batch().tgt_out
    loss = FusedLoss(PAD, 0.0)
    with torch.no_grad(), _Matmuls() as plain:
        loss(model.generator, hidden, tgt_out)
    with _Matmuls() as training:
        loss(model.generator, hidden, tgt_out)
    assert (plain.count, training.count) == (3, 9)


class _MatmulRows(TorchDispatchMode):
    """The rows of the first operand of each matrix product but those of the vocabulary (V, rows)."""

    def __init__(self):
        super().__init__()
        self.rows = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm") and args[-2].size(0) != FUSED_VOCAB:
            self.rows.add(args[-2].size(0))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rdrop", [0.0, 5.0], ids=["token loss", "rdrop"])
def test_the_fused_losss_last_chunk_in_bf16_on_a_cpu_runs_on_a_row_bucket(monkeypatch, rdrop):
    """23 rows in chunks of 10 (R-Drop: 5 pairs): the last one's 3 rows (pairs) are padded to 8 (capped
    at the chunk), so that oneDNN meets kernels it has built, as PaddedLinear's rows; in fp32 they
    are not. The padding's rows add nothing: the loss and d loss / d hidden are the plain loss's, whose
    logits are the same bf16 matmul's, to float32's rounding, and the weight's gradient is its to
    the roundings of bf16 matmuls."""
    monkeypatch.setattr(kernel_loss, "_CHUNK", 10 * FUSED_VOCAB)
    torch.manual_seed(0)
    model = tiny_model(src_vocab=FUSED_VOCAB, tgt_vocab=FUSED_VOCAB, tie_embeddings=True)
    copies = 2 if rdrop else 1
    tgt_out = _fused_batch().tgt_out.repeat(copies, 1)
    hidden = torch.randn(*tgt_out.shape, 16)

    def loss(bf16: bool, fuse: bool = True) -> tuple[set[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        x, of = hidden.clone().requires_grad_(), _loss(fuse, 0.1)
        model.zero_grad()
        with _MatmulRows() as seen, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if rdrop:
                value = of.rdrop(model.generator, x, tgt_out[: len(tgt_out) // 2], alpha=rdrop)
            else:
                value = of(model.generator, x, tgt_out)
            value.backward()
        return seen.rows, value.detach(), x.grad, model.generator.weight.grad.clone()

    rows, value, grad, weight_grad = loss(bf16=True)
    assert rows == ({10, 8} if not rdrop else {10})
    assert loss(bf16=False)[0] == ({10, 3} if not rdrop else {10, 6})
    _, plain, plain_grad, plain_weight_grad = loss(bf16=True, fuse=False)
    torch.testing.assert_close(value, plain)
    torch.testing.assert_close(grad, plain_grad)
    # The weight's gradient sums every row's in bf16 matmuls, a chunk's at a time or all at once.
    scale = float(plain_weight_grad.abs().max())
    assert float((weight_grad - plain_weight_grad).abs().max()) <= 2e-2 * scale


@pytest.mark.parametrize("loss", LOSSES)
def test_a_batch_padded_to_a_multiple_of_8_has_the_exact_batchs_loss_and_gradients(loss):
    """The padding train.pad_multiple adds is masked everywhere: the loss and every gradient stay those
    of the batch padded to its longest line, to rounding. In float64, the model and loss accelerated as
    a CPU's training takes them: the padded side may pack, and its other matmul shapes sum in another
    order, which in float32 moves a gradient by its ulps."""
    from transformer.data.batching import ParallelCorpus

    g = torch.Generator().manual_seed(4)
    lens = {side: torch.randint(1, 12, (6,), generator=g) for side in ("src", "tgt")}
    data = {side: torch.randint(4, 30, (int(n.sum()),), generator=g, dtype=torch.int32) for side, n in lens.items()}
    offsets = {
        f"{side}_offsets": torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]) for side, n in lens.items()
    }
    corpus = ParallelCorpus(data=data | offsets)
    terms, passes = LOSSES[loss]

    def loss_and_gradients(multiple: int) -> tuple[float, dict[str, torch.Tensor]]:
        torch.manual_seed(0)  # the same weights, and partial R-Drop's same draw
        model = accelerate(tiny_model(src_vocab=30, tgt_vocab=30, tie_embeddings=True).double().train(), CPU)
        batch = corpus.batch(list(range(6)), multiple)
        value = batch_loss(model, model.generator, batch, _loss(True, **terms), **passes)
        value.backward()
        return float(value.detach()), {name: p.grad for name, p in model.named_parameters()}

    (exact, expected), (padded, got) = loss_and_gradients(1), loss_and_gradients(8)
    assert padded == pytest.approx(exact, rel=1e-12)
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, rtol=1e-9, atol=1e-12 * float(grad.abs().max())), name


@pytest.mark.parametrize("rdrop", [False, True], ids=["token loss", "R-Drop"])
def test_on_a_cpu_the_loss_zeroes_its_pad_rows_alone_and_runs_no_exp(rdrop):
    """A pad row's gradient is 0. On a CPU the loss's pad rows are a bucket's padding at most, and only
    they are written, not every value of the (rows, V) gradient, as a masked_fill_ would. And the
    probabilities are softmax's, not a slower torch.exp pass over the log-probabilities."""
    target = torch.tensor([5, PAD, 7, 9, PAD, 4] * (2 if rdrop else 1))
    logits = torch.randn(len(target), 40, generator=torch.Generator().manual_seed(0))
    # The profiler, not a dispatch mode: torch turns `g[mask] = 0` into a masked_fill_ before dispatch,
    # except under a mode, which would see an index_put_ that never runs outside it.
    with torch.profiler.profile() as prof:
        if rdrop:
            *_, g = kernel_loss._rdrop_rows(logits, target, LossSpec(PAD, 0.1, alpha=5.0))
        else:
            _, g = kernel_loss._ce_rows(logits, target, LossSpec(PAD, 0.1))
    assert torch.all(g[target == PAD] == 0) and torch.all(g[target != PAD].abs().amax(-1) > 0)
    assert not {"aten::masked_fill_", "aten::masked_fill", "aten::exp"} & {e.name for e in prof.events()}
