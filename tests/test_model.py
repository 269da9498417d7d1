"""The encoder-decoder: shapes, incremental decoding = full pass, tied weights, masking."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from transformer.data.vocab import BOS, PAD
from transformer.kernels.accelerate import accelerate

V_SRC, V_TGT = 13, 11


def _model(norm: str = "pre", tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    vocab = V_SRC if tie else V_TGT
    return tiny_model(src_vocab=V_SRC, tgt_vocab=vocab, dropout=0.1, norm=norm, tie_embeddings=tie).eval()


def _tokens(rows: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (rows, length), generator=g)  # no specials


def _full_log_probs(model, src, tgt_in):
    return torch.log_softmax(model.generator(model(src, tgt_in)).float(), dim=-1)


def test_output_shapes():
    model = _model()
    src, tgt = _tokens(3, 7, V_SRC, 1), _tokens(3, 5, V_TGT, 2)
    assert model(src, tgt).shape == (3, 5, 16)
    assert model.generator(model(src, tgt)).shape == (3, 5, V_TGT)
    state = model.start(src)
    assert [c["k"].shape for c in state.sources] == [(3, 2, 7, 8)]  # (B, h, S, d_k), one decoder layer
    assert model.step(state, torch.full((3,), BOS)).shape == (3, V_TGT)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "packed"])
def test_copies_decode_one_encoding_of_the_source(padded):
    model = _model(tie=True)
    src, tgt = _tokens(4, 9, V_SRC, 1), _tokens(4, 6, V_SRC, 2)
    if padded:  # mostly padding: on a CPU both sides run packed (transformer.kernels.packing)
        src[:, 3:], tgt[:, 2:] = PAD, PAD
        model = accelerate(model, torch.device("cpu"))
    encoded = []
    model.encoder.register_forward_hook(lambda module, args, out: encoded.append(len(out)))
    copied = model(src, tgt, copies=2)
    assert encoded == [4 * 3 if padded else 4]  # the source of one copy (packed: its real tokens), once
    assert torch.allclose(copied, model(src.repeat(2, 1), tgt.repeat(2, 1)), atol=1e-6)
    model.train()
    copied = model(src, tgt, copies=2)
    assert not torch.allclose(copied[:4], copied[4:])  # each copy draws its own decoder dropout


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_incremental_decoding_equals_the_full_pass(norm):
    model = _model(norm)
    src = _tokens(2, 6, V_SRC, 3)
    src[1, 4:] = PAD
    tgt_in = torch.cat([torch.full((2, 1), BOS), _tokens(2, 5, V_TGT, 4)], 1)
    with torch.no_grad():
        full = _full_log_probs(model, src, tgt_in)  # (2, 6, V)
        state = model.start(src)
        steps = torch.stack([model.step(state, tgt_in[:, t]) for t in range(tgt_in.size(1))], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=0)


def test_incremental_state_follows_row_selection():
    model = _model()
    src = _tokens(3, 5, V_SRC, 5)
    tgt_in = torch.cat([torch.full((3, 1), BOS), _tokens(3, 3, V_TGT, 6)], 1)
    with torch.no_grad():
        full = _full_log_probs(model, src, tgt_in)
        state = model.start(src)
        model.step(state, tgt_in[:, 0])
        model.step(state, tgt_in[:, 1])
        order = torch.tensor([2, 0, 2])
        state = state.select(order)
        model.step(state, tgt_in[order, 2])
        last = model.step(state, tgt_in[order, 3])
    torch.testing.assert_close(last, full[order, 3], atol=1e-5, rtol=0)


def test_a_beams_reordering_moves_the_prefix_and_leaves_the_source_side_in_place():
    model = _model()
    src = _tokens(2, 5, V_SRC, 7)
    tgt_in = torch.cat([torch.full((4, 1), BOS), _tokens(4, 3, V_TGT, 8)], 1)  # 2 sentences x beam 2
    with torch.no_grad():
        full = _full_log_probs(model, src.repeat_interleave(2, 0), tgt_in)
        state = model.start(src, beam=2)
        model.step(state, tgt_in[:, 0])
        model.step(state, tgt_in[:, 1])
        order = torch.tensor([1, 1, 3, 2])  # each hypothesis stays with its sentence
        reordered = state.select(order)
        assert reordered.sources[0]["k"] is state.sources[0]["k"]
        assert reordered.targets[0]["k"] is not state.targets[0]["k"]
        model.step(reordered, tgt_in[order, 2])
        last = model.step(reordered, tgt_in[order, 3])
        first_left = state.select(torch.tensor([2, 3]))  # sentence 0 finished
        torch.testing.assert_close(first_left.sources[0]["k"], state.sources[0]["k"][2:], atol=0, rtol=0)
    torch.testing.assert_close(last, full[order, 3], atol=1e-5, rtol=0)


@pytest.mark.parametrize("decoder_N, layers", [(0, 2), (1, 1), (3, 3)])
def test_decoder_N_sets_the_decoders_depth_and_0_takes_the_encoders(decoder_N, layers):
    model = tiny_model(src_vocab=V_SRC, tgt_vocab=V_TGT, N=2, decoder_N=decoder_N).eval()
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (2, layers)
    src, tgt_in = _tokens(2, 6, V_SRC, 5), torch.cat([torch.full((2, 1), BOS), _tokens(2, 4, V_TGT, 6)], 1)
    with torch.no_grad():
        state = model.start(src)
        assert len(state.sources) == len(state.targets) == layers  # a cache per decoder layer
        steps = torch.stack([model.step(state, tgt_in[:, t]) for t in range(tgt_in.size(1))], 1)
        torch.testing.assert_close(steps, _full_log_probs(model, src, tgt_in), atol=1e-5, rtol=0)


def test_tied_embeddings_share_one_tensor():
    model = _model(tie=True)
    assert model.tgt_embed is model.src_embed
    assert model.generator.weight is model.src_embed.lut.weight
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("generator") for n in names)  # one tensor, counted once
    untied = _model(tie=False)
    assert untied.generator.weight is not untied.tgt_embed.lut.weight
    assert untied.tgt_embed is not untied.src_embed


def test_tied_embeddings_survive_a_state_dict_round_trip():
    a, b = _model(tie=True, seed=1), _model(tie=True, seed=2)
    b.load_state_dict(a.state_dict())
    assert b.generator.weight is b.src_embed.lut.weight
    assert torch.equal(b.generator.weight, a.generator.weight)


def test_source_padding_does_not_change_another_sentences_outputs():
    model = _model()
    short, long = _tokens(1, 3, V_SRC, 7), _tokens(1, 8, V_SRC, 8)
    tgt = torch.cat([torch.full((2, 1), BOS), _tokens(2, 4, V_TGT, 9)], 1)
    padded = torch.cat([torch.cat([short, torch.full((1, 5), PAD)], 1), long])
    with torch.no_grad():
        batched = model(padded, tgt)
        alone_short = model(short, tgt[:1])
        alone_long = model(long, tgt[1:])
    torch.testing.assert_close(batched[0], alone_short[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batched[1], alone_long[0], atol=1e-5, rtol=0)


def test_source_pad_tokens_are_ignored_whatever_their_embedding():
    model = _model()
    src = torch.cat([_tokens(1, 4, V_SRC, 10), torch.full((1, 3), PAD)], 1)
    tgt = torch.cat([torch.full((1, 1), BOS), _tokens(1, 3, V_TGT, 11)], 1)
    with torch.no_grad():
        before = model(src, tgt)
        model.src_embed.lut.weight[PAD] += 5.0
        after = model(src, tgt)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_decoder_is_causal():
    model = _model()
    src = _tokens(1, 5, V_SRC, 12)
    tgt = torch.cat([torch.full((1, 1), BOS), _tokens(1, 5, V_TGT, 13)], 1)
    changed = tgt.clone()
    changed[0, 4] = 4 if tgt[0, 4] != 4 else 5
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 4:], b[:, 4:], atol=1e-4)  # the change is visible from its position on


def test_dropout_is_active_in_training_and_off_in_eval():
    model = _model()
    src, tgt = _tokens(2, 5, V_SRC, 14), _tokens(2, 4, V_TGT, 15)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), model(src, tgt))
        model.train()
        assert not torch.equal(model(src, tgt), model(src, tgt))


def test_word_dropout_hides_source_tokens_in_training_only():
    torch.manual_seed(0)
    model = tiny_model(src_vocab=V_SRC, tgt_vocab=V_TGT, word_dropout=0.5)
    src, tgt = _tokens(4, 30, V_SRC, 17), _tokens(4, 6, V_TGT, 18)
    mask = model.src_mask(src)
    with torch.no_grad():
        assert torch.equal(model.eval()(src, tgt), model(src, tgt))  # eval: no word dropout
        model.train()
        torch.manual_seed(3)
        memory = model.encode(src, mask)
        torch.manual_seed(3)
        assert torch.equal(model.encode(src, mask), memory)  # the masks follow the seed
        torch.manual_seed(3)
        kept = torch.rand(src.shape) >= 0.5  # the draw encode made
        hidden = src.masked_fill(~kept, 0)  # <s>, whose embedding is zeroed by hand below
        model.src_embed.lut.weight[0] = 0.0
        torch.testing.assert_close(model.encoder(model.position(model.src_embed(hidden)), mask), memory)
        assert 0.3 < kept.float().mean() < 0.7
        model.word_dropout = 0.0
        assert torch.equal(model(src, tgt), model.eval()(src, tgt))  # off: training without dropout is eval


def test_make_model_initializes_matrices_xavier_uniform():
    model = tiny_model(src_vocab=V_SRC, tgt_vocab=V_TGT, dropout=0.1, norm="post")
    weight = model.encoder.layers[0].ff.w_1.weight  # (d_ff, d_model)
    bound = (6 / (16 + 32)) ** 0.5
    assert weight.abs().max() <= bound
    assert weight.abs().max() > 0.8 * bound


def test_positional_encoding_grows_beyond_its_table():
    model = _model()
    src = _tokens(1, 1100, V_SRC, 16)  # longer than the 1024-position table
    with torch.no_grad():
        out = model(src, torch.full((1, 2), BOS))
    assert out.shape == (1, 2, 16) and torch.isfinite(out).all()
