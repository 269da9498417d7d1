"""Token-count batching, the sharding of updates across processes, and batch tensors."""

from __future__ import annotations

import pytest
import torch

from transformer.data.batching import (
    ParallelCorpus,
    Prefetch,
    TrainingSplit,
    batch_shapes,
    epoch_steps,
    token_batches,
)
from transformer.data.vocab import BOS, EOS, PAD
from transformer.io import DataError


def _lengths(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 30, (n,), generator=g), torch.randint(2, 30, (n,), generator=g)


def test_batches_cover_every_sentence_exactly_once():
    src, tgt = _lengths()
    batches = token_batches(src, tgt, max_tokens=120, seed=1)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(src)))


def test_padded_batch_size_stays_within_max_tokens():
    src, tgt = _lengths()
    for max_tokens in (30, 64, 120, 500):
        for batch in token_batches(src, tgt, max_tokens, seed=1):
            longest = max(max(int(src[i]), int(tgt[i])) for i in batch)
            assert longest * len(batch) <= max_tokens, (max_tokens, batch)


def test_batches_group_similar_lengths():
    src, tgt = _lengths(400)
    batches = token_batches(src, tgt, max_tokens=200, seed=1)
    spread = [int(tgt[b].max() - tgt[b].min()) for b in batches]
    assert sum(spread) / len(spread) <= 2  # sorted by target length: near-identical within a batch


def test_same_seed_gives_same_batches_and_other_seed_another_order():
    src, tgt = _lengths()
    a = token_batches(src, tgt, 120, seed=1)
    assert a == token_batches(src, tgt, 120, seed=1)
    b = token_batches(src, tgt, 120, seed=2)
    assert a != b
    assert sorted(i for batch in b for i in batch) == list(range(len(src)))


def test_every_seed_gives_as_many_batches():  # with fixed ids, every epoch plans the same number of updates
    src, tgt = _lengths(400)
    for max_tokens in (64, 200):
        assert len({len(token_batches(src, tgt, max_tokens, seed)) for seed in range(10)}) == 1


def test_sentence_longer_than_max_tokens_is_named():
    src, tgt = torch.tensor([3, 50]), torch.tensor([4, 5])
    with pytest.raises(DataError, match="sentence pair 1 has 50 tokens"):
        token_batches(src, tgt, max_tokens=40, seed=1)


@pytest.mark.parametrize("world, accum", [(1, 1), (2, 1), (2, 3), (4, 2), (3, 1)])
def test_rank_shards_partition_the_single_process_updates(world, accum):
    batches = [[i] for i in range(23)]  # distinct, identifiable batches; 23 leaves an incomplete group
    single = epoch_steps(batches, 1, world * accum, 0)
    shards = [epoch_steps(batches, world, accum, rank) for rank in range(world)]
    assert all(len(s) == len(single) == 23 // (world * accum) for s in shards)
    for step, reference in enumerate(single):
        per_rank = [shards[rank][step] for rank in range(world)]
        assert all(len(micro) == accum for micro in per_rank)
        union = [b[0] for micro in per_rank for b in micro]
        assert len(union) == len(set(union))  # disjoint across ranks
        assert sorted(union) == sorted(b[0] for b in reference)


def test_incomplete_last_group_is_dropped():
    batches = [[i] for i in range(7)]
    steps = epoch_steps(batches, 2, 2, 0)
    assert steps == [[[0], [2]]]  # the group of batches 4..6 is short of world * accum = 4
    assert epoch_steps(batches, 2, 2, 1) == [[[1], [3]]]


def _corpus(tmp_path, src: list[list[int]], tgt: list[list[int]]) -> ParallelCorpus:
    def flat(lines):
        ids = torch.tensor([i for line in lines for i in line], dtype=torch.int32)
        offsets = torch.cumsum(torch.tensor([0] + [len(line) for line in lines]), 0)
        return ids, offsets

    (s, so), (t, to) = flat(src), flat(tgt)
    torch.save({"src": s, "src_offsets": so, "tgt": t, "tgt_offsets": to}, tmp_path / "train.pt")
    return ParallelCorpus(tmp_path / "train.pt")


def test_batch_adds_eos_to_source_and_bos_eos_to_target_with_padding(tmp_path):
    corpus = _corpus(tmp_path, [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], [16]])
    assert len(corpus) == 3
    assert corpus.src_lens.tolist() == [4, 2, 3] and corpus.tgt_lens.tolist() == [3, 4, 2]
    batch = corpus.batch([0, 1])
    assert batch.src.tolist() == [[5, 6, 7, EOS], [8, EOS, PAD, PAD]]
    assert batch.tgt_in.tolist() == [[BOS, 11, 12, PAD], [BOS, 13, 14, 15]]
    assert batch.tgt_out.tolist() == [[11, 12, EOS, PAD], [13, 14, 15, EOS]]
    assert batch.ntokens == 3 + 4
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.long
    assert PAD == 2


def test_batch_keeps_the_requested_order(tmp_path):
    corpus = _corpus(tmp_path, [[5], [6], [7]], [[8], [9], [10]])
    batch = corpus.batch([2, 0])
    assert batch.src[:, 0].tolist() == [7, 5]
    assert batch.tgt_out[:, 0].tolist() == [10, 8]


def _sentence_by_sentence(corpus: ParallelCorpus, index: list[int]) -> list[torch.Tensor]:
    """A batch as the per-sentence definition builds it: each line sliced, </s> or <s> added, then padded."""
    pad = torch.nn.utils.rnn.pad_sequence
    src = [corpus.src[corpus.src_off[i] : corpus.src_off[i + 1]].tolist() for i in index]
    tgt = [corpus.tgt[corpus.tgt_off[i] : corpus.tgt_off[i + 1]].tolist() for i in index]
    sides = ([s + [EOS] for s in src], [[BOS] + t for t in tgt], [t + [EOS] for t in tgt])
    return [pad([torch.tensor(line) for line in side], batch_first=True, padding_value=PAD) for side in sides]


def test_whole_batch_gathers_equal_the_sentence_by_sentence_batches(tmp_path):
    g = torch.Generator().manual_seed(3)
    lines = [
        [int(x) for x in torch.randint(4, 90, (int(n),), generator=g)]
        for n in torch.randint(0, 12, (300,), generator=g)
    ]
    corpus = _corpus(tmp_path, lines[:150], lines[150:])
    for index in token_batches(corpus.src_lens, corpus.tgt_lens, 60, seed=5):
        batch = corpus.batch(index)
        for built, expected in zip((batch.src, batch.tgt_in, batch.tgt_out), _sentence_by_sentence(corpus, index)):
            assert torch.equal(built, expected), index
        assert batch.ntokens == corpus.tokens(index) == sum(len(lines[150 + i]) + 1 for i in index)


def test_a_batch_padded_to_a_multiple_is_the_exact_batch_with_pad_columns_added(tmp_path):
    corpus = _corpus(tmp_path, [[5, 6, 7], [8], [9] * 8], [[11, 12], [13, 14, 15], [16] * 9])
    for index in ([0, 1], [2], [0, 1, 2]):
        exact, padded = corpus.batch(index), corpus.batch(index, 8)
        for e, p in zip((exact.src, exact.tgt_in, exact.tgt_out), (padded.src, padded.tgt_in, padded.tgt_out)):
            assert p.size(1) % 8 == 0 and 0 <= p.size(1) - e.size(1) < 8, index
            assert torch.equal(p[:, : e.size(1)], e) and bool((p[:, e.size(1) :] == PAD).all())
        assert padded.ntokens == exact.ntokens
        assert corpus.shape(index, 8) == (len(index), padded.src.size(1), padded.tgt_in.size(1))


def test_token_batches_padded_to_a_multiple_stay_within_max_tokens_and_have_fewer_shapes():
    src, tgt = _lengths(400)
    offsets = {
        side: torch.cat([torch.zeros(1, dtype=torch.long), (n - 1).cumsum(0)]) for side, n in zip("st", (src, tgt))
    }
    data = {"src": torch.zeros(int(src.sum())), "tgt": torch.zeros(int(tgt.sum()))}  # lines with these lengths + 1
    corpus = ParallelCorpus(data=data | {"src_offsets": offsets["s"], "tgt_offsets": offsets["t"]})
    for multiple in (1, 8):
        batches = token_batches(src, tgt, 120, seed=1, multiple=multiple)
        assert sorted(i for b in batches for i in b) == list(range(len(src)))
        for b in batches:
            _, S, T = corpus.shape(b, multiple)
            assert S % multiple == T % multiple == 0 and max(S, T) * len(b) <= 120
    exact, padded = (batch_shapes(corpus, [token_batches(src, tgt, 120, 1, m)], m) for m in (1, 8))
    assert padded < exact


def test_batch_shapes_counts_the_distinct_src_and_target_shapes_of_every_micro_batch(tmp_path):
    corpus = _corpus(tmp_path, [[5], [6, 7], [8, 9, 10], [5]], [[5], [6], [7, 8], [9]])
    groups = [[[0], [3]], [[1], [2]], [[0, 3]]]  # (1, 2, 2) twice, (1, 3, 2), (1, 4, 3), (2, 2, 2)
    assert batch_shapes(corpus, groups, 1) == 4
    assert batch_shapes(corpus, groups, 8) == 2  # (1, 8, 8) and (2, 8, 8)


def test_a_batch_of_empty_lines_holds_only_the_markers(tmp_path):
    corpus = _corpus(tmp_path, [[], [5]], [[], []])
    batch = corpus.batch([0, 1])
    assert batch.src.tolist() == [[EOS, PAD], [5, EOS]]
    assert batch.tgt_in.tolist() == [[BOS], [BOS]] and batch.tgt_out.tolist() == [[EOS], [EOS]]


def test_prefetch_yields_each_ranks_batches_of_every_update_in_order(tmp_path):
    corpus = _corpus(tmp_path, [[5 + i] * (1 + i % 4) for i in range(24)], [[6 + i] * (1 + i % 3) for i in range(24)])
    global_groups = epoch_steps(token_batches(corpus.src_lens, corpus.tgt_lens, 8, seed=1), 1, 4, 0)
    for rank in (0, 1):
        with Prefetch(corpus, global_groups, rank, 2, torch.device("cpu")) as updates:
            got = list(updates)
        assert len(got) == len(global_groups)
        for update, group in zip(got, global_groups):
            mine = group[rank::2]
            assert [b.src.tolist() for b in update.batches] == [corpus.batch(i).src.tolist() for i in mine]
            assert update.mine == sum(corpus.tokens(i) for i in mine)
            assert update.total == sum(corpus.tokens(i) for i in group) and update.wait_s >= 0.0


def test_prefetch_stops_its_thread_when_the_loop_leaves_early(tmp_path):
    corpus = _corpus(tmp_path, [[5]] * 40, [[6]] * 40)
    groups = [[[i]] for i in range(40)]
    with Prefetch(corpus, groups, 0, 1, torch.device("cpu"), depth=1) as updates:
        first = next(iter(updates))
    assert first.batches[0].src.tolist() == [[5, EOS]]
    assert not updates.thread.is_alive()


def test_an_error_building_a_batch_is_raised_in_the_loop(tmp_path):
    corpus = _corpus(tmp_path, [[5]] * 3, [[6]] * 3)
    with pytest.raises(IndexError), Prefetch(corpus, [[[0]], [[7]]], 0, 1, torch.device("cpu")) as updates:
        list(updates)


def test_missing_corpus_file_names_the_stage(tmp_path):
    with pytest.raises(DataError, match="build_vocab"):
        ParallelCorpus(tmp_path / "absent.pt")


def test_training_split_without_bpe_dropout_is_build_vocabs_ids_in_every_epoch(vocab_dir):
    split = TrainingSplit(ParallelCorpus(vocab_dir / "train.pt"))
    stored = torch.load(vocab_dir / "train.pt", weights_only=True)
    for epoch in (0, 1, 7):
        corpus = split.epoch(epoch)
        assert corpus is split.fixed
        assert torch.equal(corpus.src, stored["src"]) and torch.equal(corpus.tgt_off, stored["tgt_offsets"])


def _sampled_split(vocab_dir, dropout: float, seed: int = 1) -> TrainingSplit:
    from transformer.data.vocab import load_vocabs

    tok = vocab_dir.parent / "tok"
    lines = tuple((tok / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("de", "en"))
    return TrainingSplit(ParallelCorpus(vocab_dir / "train.pt"), load_vocabs(vocab_dir)[0], lines, dropout, seed)


def test_training_split_with_bpe_dropout_resegments_each_epoch_repeatably(vocab_dir):
    split = _sampled_split(vocab_dir, 0.2)
    first, again, second = split.epoch(0), _sampled_split(vocab_dir, 0.2).epoch(0), split.epoch(1)
    assert torch.equal(first.src, again.src) and torch.equal(first.tgt_off, again.tgt_off)  # same (seed, epoch)
    assert not torch.equal(first.tgt_lens, second.tgt_lens)  # the next epoch cuts the words elsewhere
    assert not torch.equal(first.src_lens, _sampled_split(vocab_dir, 0.2, seed=2).epoch(0).src_lens)  # other seed
    assert len(first) == len(split.fixed) and len(first.tgt) > len(split.fixed.tgt)
    assert (first.src_lens >= split.fixed.src_lens).all()
