"""The model's dropout on a CPU (MaskDropout, the twin of nn.Dropout that accelerate swaps in):
transformer.kernels.dropout's masks from the Mersenne Twister's draws, the same on every CPU."""

import pytest
import torch

from transformer.kernels.accelerate import accelerate
from transformer.kernels.dropout import MaskDropout, dropout


def test_the_masks_are_the_twisters_draws_so_every_cpu_drops_the_same_values():
    # torch.manual_seed(0)'s first 64-bit draw is 0x8c7f0aac97c4aa2f (MT19937, init_genrand(0)); each
    # draw gives four 16-bit values, so these 24 come from its first six draws.
    torch.manual_seed(0)
    kept = dropout(torch.ones(2, 12), 0.5).nonzero().tolist()
    assert kept == [[0, 2], [0, 8], [1, 0], [1, 2], [1, 7], [1, 9], [1, 10]]


def test_a_mask_takes_one_draw_for_four_values():
    torch.manual_seed(1)
    dropout(torch.ones(4, 5, 3), 0.1)  # 60 values: 15 draws
    after_mask = torch.rand(3)
    torch.manual_seed(1)
    torch.empty(15, dtype=torch.int64).random_(-(1 << 63), None)
    assert torch.equal(torch.rand(3), after_mask)


def test_values_are_dropped_at_rate_p_and_the_kept_ones_scaled_to_keep_the_mean():
    torch.manual_seed(2)
    y = dropout(torch.ones(1_000_000), 0.1)
    assert (y == 0).float().mean().item() == pytest.approx(0.1, abs=0.002)  # 7 standard deviations
    assert y.unique().tolist() == [0.0, pytest.approx(65536 / (65536 - 6554))]  # p to 2^-16: 6554 / 65536
    assert y.mean().item() == pytest.approx(1.0, abs=0.004)


def test_the_gradient_is_the_forward_mask_times_the_scale():
    torch.manual_seed(3)
    x = torch.randn(7, 9, requires_grad=True)
    y = dropout(x, 0.3)
    y.backward(torch.ones_like(y))
    scale = 65536 / (65536 - round(0.3 * 65536))
    assert torch.equal(x.grad, (y != 0).float() * scale)
    assert torch.equal(y, x.detach() * (y != 0) * scale)


def test_bf16_values_are_scaled_then_rounded_once():
    torch.manual_seed(4)
    x = torch.randn(1000, dtype=torch.bfloat16)
    y = dropout(x, 0.1)
    kept = y != 0
    assert torch.equal(y[kept], (x[kept].double() * (65536 / (65536 - 6554))).to(torch.bfloat16))


def test_in_eval_mode_or_at_p_0_the_input_passes_through_and_no_draw_is_made():
    layer = accelerate(torch.nn.Dropout(0.1), torch.device("cpu")).eval()
    assert type(layer) is MaskDropout
    x = torch.randn(3, 4)
    torch.manual_seed(5)
    assert layer(x) is x and MaskDropout(0.0).train()(x) is x
    after = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(2), after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dropout_casts_nothing_forward_or_back(dtype):
    """A bool mask multiplied in would be copied to x's dtype first, forward and back: a pass over
    the activations each way, in every dropout of every update."""
    x = torch.randn(64, 32, dtype=dtype, requires_grad=True)
    with torch.profiler.profile(record_shapes=True) as prof:
        dropout(x, 0.1).backward(torch.ones(64, 32, dtype=dtype))
    assert not [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes[0]]
