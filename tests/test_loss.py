"""The training losses against their definitions (section 5.4; R-Drop), written out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DataDependentOps, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import transformer.kernels.loss as kernel_loss
import transformer.kernels.packing
from transformer.data.batching import Batch
from transformer.kernels import select
from transformer.kernels.loss import LossSpec, _Fused, _RDrop
from transformer.training.loss import batch_loss, rdrop_loss, token_loss

PAD = 2


@pytest.fixture(params=[False, True], ids=["whole", "fused"])
def fused(request, monkeypatch):
    """Runs a test on the whole loss and again with the generator and loss fused (_Fused)."""
    _fuse(monkeypatch, request.param)
    return request.param


_FUSES_LOSS = select.fuses_loss  # training's choice: fused for every row of a Linear generator


def _fuse(monkeypatch, fuse: bool) -> None:
    """The loss fused with the generator as training fuses it, or never (the whole loss)."""
    monkeypatch.setattr(select, "fuses_loss", _FUSES_LOSS if fuse else lambda generator, rows: False)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_token_loss_is_smoothed_cross_entropy_over_real_tokens(smoothing, fused):
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

    assert float(token_loss(model, hidden, tgt_out, PAD, smoothing).detach()) == pytest.approx(expected, rel=1e-5)


def _tiny(dropout: float = 0.0):
    torch.manual_seed(0)
    return tiny_model(src_vocab=20, tgt_vocab=20, dropout=dropout, tie_embeddings=True)


TGT_OUT = torch.tensor([[5, 6, 1, PAD], [7, 1, PAD, PAD]])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@torch.no_grad()  # values only
def test_rdrop_loss_of_two_equal_passes_is_the_token_loss(smoothing, fused):
    model, hidden = _tiny().eval(), torch.randn(2, 4, 16)
    alone = token_loss(model, hidden, TGT_OUT, PAD, smoothing)
    assert float(rdrop_loss(model, hidden.repeat(2, 1, 1), TGT_OUT, PAD, smoothing, alpha=5.0)) == pytest.approx(
        float(alone), rel=1e-6
    )


@torch.no_grad()  # values only
def test_rdrop_loss_is_the_mean_cross_entropy_plus_a_quarter_alpha_of_the_symmetric_kl(fused):
    model, first, second = _tiny().eval(), torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    keep = TGT_OUT != PAD
    p = model.generator(first[keep]).log_softmax(-1)
    q = model.generator(second[keep]).log_softmax(-1)
    kl = F.kl_div(q, p, log_target=True, reduction="sum") + F.kl_div(
        p, q, log_target=True, reduction="sum"
    )  # KL(P||Q) + KL(Q||P)
    ce = (token_loss(model, first, TGT_OUT, PAD, 0.1) + token_loss(model, second, TGT_OUT, PAD, 0.1)) / 2
    got = rdrop_loss(model, torch.cat([first, second]), TGT_OUT, PAD, 0.1, alpha=3.0)
    assert float(kl) > 0.1
    assert float(got) == pytest.approx(float(ce + 3.0 / 4 * kl), rel=1e-5)


@torch.no_grad()  # values only
def test_partial_rdrop_passes_the_drawn_share_twice_and_weighs_every_sentence_as_one_pass(fused):
    model = _tiny().eval()  # no dropout: a sentence's two passes are equal and R-Drop's KL is 0
    tgt_out = torch.tensor([[5, 6, 1, PAD], [7, 1, PAD, PAD], [8, 9, 10, 1], [11, 1, PAD, PAD]])
    tgt_in = torch.cat([torch.zeros(4, 1, dtype=torch.long), tgt_out[:, :-1]], 1).masked_fill(tgt_out == PAD, PAD)
    batch = Batch(
        torch.tensor([[4, 5, 1, PAD], [6, 1, PAD, PAD], [7, 8, 9, 1], [10, 1, PAD, PAD]]), tgt_in, tgt_out, 11
    )
    seen = []

    def forward(src, tgt):
        seen.append(src)
        return model(src, tgt)

    plain = batch_loss(forward, model, batch, PAD, 0.1)
    drawn = set()
    for _ in range(8):
        partial = batch_loss(forward, model, batch, PAD, 0.1, rdrop=5.0, share=0.5)
        assert float(partial) == pytest.approx(float(plain), rel=1e-5)  # every sentence's CE counted once
        assert seen[-1].size(0) == 4 + 2  # half the batch a second time
        drawn.add(tuple(map(tuple, seen[-1][4:].tolist())))
    assert len(drawn) > 1  # the sentences passed twice are drawn afresh each time
    full = batch_loss(forward, model, batch, PAD, 0.1, rdrop=5.0)
    assert seen[-1].size(0) == 8 and float(full) == pytest.approx(float(plain), rel=1e-5)


def test_partial_rdrop_forward_and_backward_wait_on_no_data_dependent_op(monkeypatch, fused):
    # As on an accelerator: there the model neither packs nor drops the padding before the generator.
    monkeypatch.setattr(transformer.kernels.packing, "counts_on_host", lambda t: False)
    model = _tiny(dropout=0.1).train()
    tgt_out = TGT_OUT.repeat(3, 1)
    batch = Batch(torch.tensor([[4, 5, 6, 1]]).repeat(6, 1), torch.tensor([[0, 5, 6, 1]]).repeat(6, 1), tgt_out, 18)
    with DataDependentOps() as ops:
        batch_loss(model, model, batch, PAD, 0.1, rdrop=5.0, share=0.5).backward()
    assert ops.seen == []
    with DataDependentOps() as ops:  # the counter sees what a boolean mask costs
        batch.src[batch.src[:, 0] > 0].sum().item()
    assert "_local_scalar_dense.default" in ops.seen and len(ops.seen) >= 2


@torch.no_grad()  # values only
def test_partial_rdrop_adds_the_kl_of_the_drawn_sentences():
    model = _tiny(dropout=0.3).train()
    tgt_out = TGT_OUT.repeat(2, 1)
    batch = Batch(torch.tensor([[4, 5, 6, 1]]).repeat(4, 1), torch.tensor([[0, 5, 6, 1]]).repeat(4, 1), tgt_out, 10)

    def loss(alpha: float) -> float:
        torch.manual_seed(1)  # the same draw and the same dropout masks for both
        return float(batch_loss(model, model, batch, PAD, 0.1, rdrop=alpha, share=0.5))

    assert loss(5.0) > loss(0.001)


@torch.no_grad()  # values only
def test_the_two_passes_of_a_repeated_batch_draw_their_own_dropout():
    model = _tiny(dropout=0.3).train()
    src, tgt_in = torch.tensor([[4, 5, 6, 1]]).repeat(2, 1), torch.tensor([[0, 5, 6, 1]]).repeat(2, 1)
    hidden = model(src.repeat(2, 1), tgt_in.repeat(2, 1))
    first, second = hidden.chunk(2)
    assert not torch.allclose(first, second)  # else R-Drop's KL would be 0 and its second pass wasted
    assert float(rdrop_loss(model, hidden, TGT_OUT, PAD, 0.1, alpha=5.0)) > float(
        rdrop_loss(model, hidden, TGT_OUT, PAD, 0.1, alpha=0.0)
    )


@pytest.mark.parametrize("smoothing, zero_pad", [(0.0, False), (0.1, False), (0.1, True)])
def test_rdrop_loss_gradient_is_that_of_its_formula(smoothing, zero_pad, fused):
    """The loss writes its gradient out by hand (for speed): it must be autograd's of the formula,
    and pad positions must get none."""
    torch.manual_seed(0)
    vocab, rows = 11, 6
    hidden = torch.randn(2, rows, 8, dtype=torch.float64, requires_grad=True)
    generator = torch.nn.Linear(8, vocab).double()
    model = torch.nn.Module()
    model.generator = generator
    tgt_out = torch.randint(3, vocab, (1, rows))
    tgt_out[0, 2] = PAD

    got = rdrop_loss(model, hidden, tgt_out, PAD, smoothing, alpha=5.0, zero_pad=zero_pad)
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

    assert float(got.detach()) == pytest.approx(
        float(expected.detach()), rel=1e-6
    )  # the logits are float32 (as under autocast)
    assert torch.allclose(got_grad, expected_grad, rtol=1e-4, atol=1e-6)
    for got_part, expected_part in zip(got_generator, expected_generator):  # the weight's and the bias's
        assert torch.allclose(got_part, expected_part, rtol=1e-4, atol=1e-6)
    assert float(expected_grad[:, 2].abs().max()) == 0.0  # the pad position

    # In float64, from the logits on, with the pad row kept (as on a GPU): to rounding.
    logits = generator(hidden.detach().flatten(0, 1)).detach().requires_grad_()
    target = tgt_out.flatten().repeat(2)
    spec = LossSpec(PAD, smoothing, zero_pad, alpha=5.0)
    assert torch.autograd.gradcheck(lambda z: _RDrop.apply(z, target, spec), (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_pad", [False, True])
def test_rdrop_loss_in_blocks_is_bit_for_bit_the_loss_in_one(monkeypatch, dtype, zero_pad):
    """On a CPU the loss works on a block of rows at a time (for speed): its value and gradient
    must be those of one block of every row, to the bit, in the logits' dtype."""
    torch.manual_seed(0)
    vocab, n = 50, 23
    logits = (3 * torch.randn(2 * n, vocab)).to(dtype)
    target = torch.randint(3, vocab, (n,)).repeat(2)
    target[[4, n + 4]] = PAD

    def run(block: int) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(kernel_loss, "_BLOCK", block)
        x = logits.clone().requires_grad_()
        loss = _RDrop.apply(x, target, LossSpec(PAD, 0.1, zero_pad, alpha=5.0))
        (loss / 17).backward()
        return loss, x.grad

    whole, blocked = run(1 << 40), run(5 * vocab)  # blocks of 5 pairs: four whole ones and one of 3
    assert blocked[1].dtype == dtype and float(blocked[1].abs().sum()) > 0
    assert float(blocked[1][[4, n + 4]].abs().max()) == 0.0  # the pad rows
    assert torch.equal(whole[0], blocked[0])
    assert torch.equal(whole[1], blocked[1])


def test_rdrop_loss_under_autocast_is_its_float32_value():
    """Autocast computes vecdot in bf16; the KL term of the reported loss must not be rounded so."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2 * 30, 500)).to(torch.bfloat16)
    target = torch.randint(3, 500, (30,)).repeat(2)
    spec = LossSpec(PAD, 0.1, alpha=5.0)
    plain = _RDrop.apply(logits.float(), target, spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _RDrop.apply(logits, target, spec)
    assert autocast.dtype == torch.float32
    assert torch.equal(autocast, plain)


FUSED_VOCAB = 50


def _fused_batch() -> Batch:
    """Six sentences of 23 real target tokens in all (a prime: no chunk size divides it), with padding."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 2, 5, 3, 4, 3])
    tgt_out = torch.randint(3, FUSED_VOCAB, (6, 6), generator=g)
    tgt_out[torch.arange(6)[None, :] >= lengths[:, None]] = PAD
    tgt_in = torch.cat([torch.zeros(6, 1, dtype=torch.long), tgt_out[:, :-1]], 1).masked_fill(tgt_out == PAD, PAD)
    return Batch(torch.randint(3, FUSED_VOCAB, (6, 5), generator=g), tgt_in, tgt_out, int(lengths.sum()))


def _loss_and_gradients(monkeypatch, fuse: bool, chunk: int, bf16: bool, **loss):
    """batch_loss of a tiny tied-embedding model in training (dropout on), and every parameter's gradient:
    through the decoder they hold d loss / d hidden, and the tied embedding both of its uses' gradients."""
    _fuse(monkeypatch, fuse)
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
        value = batch_loss(forward, model, _fused_batch(), PAD, **loss)
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


LOSSES = {
    "nll": dict(smoothing=0.0),
    "smoothed": dict(smoothing=0.1),
    "zero_pad": dict(smoothing=0.1, zero_pad=True),
    "rdrop": dict(smoothing=0.1, rdrop=5.0),
    "rdrop_zero_pad": dict(smoothing=0.1, rdrop=5.0, zero_pad=True),
    "partial_rdrop": dict(smoothing=0.1, rdrop=5.0, share=0.5),
}


@pytest.mark.parametrize("pad_rows", [False, True], ids=["real rows", "pad rows too"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 7 * FUSED_VOCAB, 1 << 40], ids=["a row", "7 rows", "one chunk"])
@pytest.mark.parametrize("loss", LOSSES)
def test_fused_loss_and_its_gradients_are_the_whole_ones(monkeypatch, loss, chunk, bf16, pad_rows):
    """The generator and loss fused, a chunk of rows at a time (one row or pair, 7 rows or 3 pairs of
    23, or all), on the real tokens alone (a CPU's rows) or with the pad positions (an accelerator's,
    which the loss ignores), give the whole loss's value and gradients: to float32's rounding, or under bf16
    autocast to a few roundings of its bf16 matmuls. There the value stays close (both take their
    logits in bf16) and the gradients of hidden and of the tied weight are compared: a bf16 model's
    backward magnifies the roundings on the way to the encoder's first norm."""
    if pad_rows:
        monkeypatch.setattr(transformer.kernels.packing, "counts_on_host", lambda t: False)
    whole, expected = _loss_and_gradients(monkeypatch, False, chunk, bf16, **LOSSES[loss])
    fused, got = _loss_and_gradients(monkeypatch, True, chunk, bf16, **LOSSES[loss])
    assert float(fused) == pytest.approx(float(whole), rel=1e-5 if bf16 else 1e-6)
    for name in ["hidden", "src_embed.lut.weight"] if bf16 else expected:
        grad = expected[name]
        assert got[name] is not None and got[name].dtype == grad.dtype, name
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((got[name] - grad).abs().max()) <= (2e-2 if bf16 else 1e-5) * scale, name


def test_every_batch_with_a_linear_generator_takes_the_fused_loss():
    """The default recipe's (3,000 tokens x 8,000 pieces) as the paper's (25,000 x 37,000): fused, so
    no batch holds every logit in float32 at once; a generator of other math keeps the whole loss."""
    with torch.device("meta"):  # shapes only
        model = torch.nn.Module()
        for rows, vocab in ((2 * 3000, 8000), (25000, 37000), (1, 100)):
            model.generator = torch.nn.Linear(512, vocab, bias=False)
            assert select.fuses_loss(model.generator, torch.empty(rows, 512))
        model.generator = torch.nn.Sequential(torch.nn.Linear(512, 37000))  # not the math _Fused repeats
        assert not select.fuses_loss(model.generator, torch.empty(25000, 512))


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
    model = torch.nn.Module()
    model.generator = torch.nn.Linear(16, vocab, bias=False)
    hidden = torch.randn(2 * rows if rdrop else rows, 1, 16, requires_grad=True)
    target = torch.randint(3, vocab, (rows, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16), _Copies() as ops:
        if rdrop:
            loss = rdrop_loss(model, hidden, target, PAD, 0.1, alpha=5.0)
        else:
            loss = token_loss(model, hidden, target, PAD, 0.1)
        loss.backward()
    copies = [shape for shape in ops.shapes if shape[-1] == vocab]
    assert copies and max(shape[0] for shape in copies) == 4, copies
    assert rdrop or "_log_softmax" not in ops.names


def test_fused_loss_without_a_graph_computes_no_gradient(monkeypatch):
    """Validation (no_grad) pays the generator's matmul alone, one a chunk; training three."""
    monkeypatch.setattr(kernel_loss, "_CHUNK", 10 * FUSED_VOCAB)  # 23 rows: 3 chunks
    torch.manual_seed(0)
    model = tiny_model(src_vocab=FUSED_VOCAB, tgt_vocab=FUSED_VOCAB, tie_embeddings=True)
    hidden, tgt_out = torch.randn(6, 6, 16, requires_grad=True), _fused_batch().tgt_out
    with torch.no_grad(), _Matmuls() as plain:
        token_loss(model, hidden, tgt_out, PAD, 0.0)
    with _Matmuls() as training:
        token_loss(model, hidden, tgt_out, PAD, 0.0)
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
    at the chunk), so that oneDNN meets kernels it has built, as select.Linear's rows; in fp32 they
    are not. The padding's rows add nothing: the loss and its gradient are the unpadded ones."""
    monkeypatch.setattr(kernel_loss, "_CHUNK", 10 * FUSED_VOCAB)
    torch.manual_seed(0)
    model = tiny_model(src_vocab=FUSED_VOCAB, tgt_vocab=FUSED_VOCAB, tie_embeddings=True)
    copies = 2 if rdrop else 1
    tgt_out = _fused_batch().tgt_out.repeat(copies, 1)
    hidden = torch.randn(*tgt_out.shape, 16)

    def loss(bf16: bool) -> tuple[set[int], torch.Tensor, torch.Tensor]:
        x = hidden.clone().requires_grad_()
        with _MatmulRows() as seen, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if rdrop:
                value = rdrop_loss(model, x, tgt_out[: len(tgt_out) // 2], PAD, 0.1, alpha=rdrop)
            else:
                value = token_loss(model, x, tgt_out, PAD, 0.1)
            value.backward()
        return seen.rows, value.detach(), x.grad

    rows, value, grad = loss(bf16=True)
    assert rows == ({10, 8} if not rdrop else {10})
    assert loss(bf16=False)[0] == ({10, 3} if not rdrop else {10, 6})
    monkeypatch.setattr(transformer.kernels.packing, "row_bucket", lambda rows: rows)
    unpadded_rows, unpadded, unpadded_grad = loss(bf16=True)
    assert unpadded_rows == ({10, 3} if not rdrop else {10, 6})
    torch.testing.assert_close(value, unpadded)
    torch.testing.assert_close(grad, unpadded_grad)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_batch_padded_to_a_multiple_of_8_has_the_exact_batchs_loss_and_gradients(loss):
    """The padding train.pad_multiple adds is masked everywhere: the loss and every gradient stay those
    of the batch padded to its longest line, to rounding. In float64: the padded side may pack on a CPU,
    and its other matmul shapes sum in another order, which in float32 moves a gradient by its ulps."""
    from transformer.data.batching import ParallelCorpus

    g = torch.Generator().manual_seed(4)
    lens = {side: torch.randint(1, 12, (6,), generator=g) for side in ("src", "tgt")}
    data = {side: torch.randint(4, 30, (int(n.sum()),), generator=g, dtype=torch.int32) for side, n in lens.items()}
    offsets = {
        f"{side}_offsets": torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]) for side, n in lens.items()
    }
    corpus = ParallelCorpus(data=data | offsets)

    def loss_and_gradients(multiple: int) -> tuple[float, dict[str, torch.Tensor]]:
        torch.manual_seed(0)  # the same weights, and partial R-Drop's same draw
        model = tiny_model(src_vocab=30, tgt_vocab=30, tie_embeddings=True).double().train()
        value = batch_loss(model, model, corpus.batch(list(range(6)), multiple), PAD, **LOSSES[loss])
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
