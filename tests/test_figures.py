"""Figures: attention maps are per-sentence distributions, schedules peak at their warmup, PNGs are reproducible."""

from __future__ import annotations

import pytest
import torch
from conftest import BIN, ROOT, run, tiny_config, tiny_model

from transformer import checkpoints
from transformer.config import load_params
from transformer.data.tokenize import JOINER
from transformer.data.vocab import BOS, EOS, SPECIALS, BpeVocab, WordVocab
from transformer.evaluation.figures import (
    WARMUPS,
    attention_maps,
    draw_figures,
    labels,
    loss_figure,
    read_tsv,
    schedule_curves,
)
from transformer.io import DataError

WORDS = ["kan", "pen", "bin", "don", "."]


def _tiny(h: int = 2):
    torch.manual_seed(0)
    vocab = WordVocab(list(SPECIALS) + WORDS)
    config = tiny_config(len(vocab), len(vocab), h=h)
    return tiny_model(**config), vocab, config


def _checkpoint(tmp_path):
    model, vocab, config = _tiny()
    params = load_params(ROOT / "params.yaml").to_dict()
    params["decode"]["max_len_extra"] = 4
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "train_steps.tsv").write_text(
        "step\tloss\tlr\ttokens_per_s\n" + "".join(f"{s}\t{5 - s / 10}\t{s * 1e-4}\t1000\n" for s in range(1, 31))
    )
    (reports / "train_epochs.tsv").write_text(
        "epoch\tstep\ttrain_loss\tval_loss\tval_ppl\n1\t15\t4\t4.2\t66\n2\t30\t3\t3.4\t30\n"
    )
    source = tmp_path / "val.de"
    source.write_text("\nkan pen .\nbin don kan pen .\nbin .\ndon don .\n")  # empty first line: skipped
    ckpt = {
        "model": model.state_dict(),
        "model_config": config,
        "vocab": {"src": vocab.state(), "tgt": vocab.state()},
        "params": params,
        "step": 30,
    }
    return ckpt, source, reports


def test_attention_maps_are_distributions_over_each_sentences_own_tokens():
    model, vocab, _ = _tiny()
    maps = attention_maps(model, vocab, vocab, ["kan pen .", "bin don kan pen don ."], max_len_extra=3)
    assert len(maps) == 2
    for m in maps:
        S, T = len(m.src), len(m.outputs)
        assert m.src[-1] == "</s>" and m.inputs[0] == "<s>" and m.outputs[-1] == "</s>" and len(m.inputs) == T
        assert m.encoder.shape == (2, S, S) and m.decoder.shape == (2, T, T) and m.source.shape == (2, T, S)
        for weights in (m.encoder, m.decoder, m.source):  # padding of the longer sentence gets no weight
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
        assert torch.all(m.decoder.triu(1) == 0)  # no position looks ahead
    assert maps[0].src == ["kan", "pen", ".", "</s>"]


def test_labels_show_words_and_pieces_as_a_reader_takes_them():
    lines = [f"Zwei Hunde laufen {JOINER}.", f"Ein Hund schläft {JOINER}!"] * 30  # as tokenize writes them
    bpe = BpeVocab.train(lines, 30, seed=0)
    ids = bpe.encode(f"Hunde laufen {JOINER}.")
    pieces = [bpe.sp.id_to_piece(i) for i in ids]
    shown = labels(bpe, [BOS, *ids, EOS])
    assert shown[0] == "<s>" and shown[-1] == "</s>" and len(shown) == len(ids) + 2
    assert "".join(shown[1:-1]).replace("·", "") == "Hundelaufen."
    assert not any("\u2581" in t or JOINER in t for t in shown)
    starts = [i for i, p in enumerate(pieces) if p.startswith("\u2581")]
    assert [i for i, t in enumerate(shown[1:-1]) if not t.startswith("·")] == starts  # a word's first piece, bare
    words = WordVocab(list(SPECIALS) + ["Hunde", f"{JOINER}."])
    assert labels(words, [BOS, 4, 5, EOS]) == ["<s>", "Hunde", ".", "</s>"]


def test_attention_recording_is_switched_off_afterwards():
    model, vocab, _ = _tiny()
    attention_maps(model, vocab, vocab, ["kan pen ."], max_len_extra=2)
    assert not any(getattr(m, "keep_weights", False) for m in model.modules())


def test_schedules_peak_at_their_warmup_and_include_the_params_own():
    curves = schedule_curves(d_model=512, factor=1.0, warmup=1000, steps=10000)
    assert set(curves) == {1000, *WARMUPS}
    for warmup, curve in curves.items():
        assert curve.index(max(curve)) + 1 == warmup


def test_a_ragged_train_report_is_refused_by_file(tmp_path):
    path = tmp_path / "train_steps.tsv"
    path.write_text("step\tloss\n1\t2.0\n2\n")
    with pytest.raises(DataError, match="train_steps.tsv"):
        read_tsv(path)


def test_draw_figures_writes_every_png_and_no_temporary_file(tmp_path):
    ckpt, source, reports = _checkpoint(tmp_path)
    model, _, _ = _tiny()
    drawn = draw_figures(
        model,
        ckpt,
        source,
        reports / "train_steps.tsv",
        reports / "train_epochs.tsv",
        tmp_path / "figures",
        d_model=16,
        factor=1.0,
        warmup=10,
        cooldown=0.0,
    )
    assert [p.name for p in drawn] == sorted(
        ["lr_schedule.png", "loss.png"]
        + [f"attention_{n}_{kind}.png" for n in (1, 2, 3) for kind in ("encoder", "decoder", "source")]
        + ["alignment_1.png"]
    )
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in drawn)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_same_data_draws_the_same_bytes(tmp_path):
    ckpt, source, reports = _checkpoint(tmp_path)
    steps, epochs = read_tsv(reports / "train_steps.tsv"), read_tsv(reports / "train_epochs.tsv")
    loss_figure(steps, epochs, tmp_path / "a.png")
    loss_figure(steps, epochs, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()  # nothing time-dependent in the file


@pytest.mark.slow
def test_figures_stage_draws_the_same_bytes_in_two_processes_and_reports_a_missing_model_in_one_line(tmp_path):
    ckpt, source, reports = _checkpoint(tmp_path)
    checkpoints.save(tmp_path / "model.pt", ckpt)
    cmd = [
        str(BIN / "python"),
        str(ROOT / "stages/figures.py"),
        "--params",
        str(ROOT / "params.yaml"),
        "--source",
        str(source),
        "--steps",
        str(reports / "train_steps.tsv"),
        "--epochs",
        str(reports / "train_epochs.tsv"),
        "--no-track",
    ]
    drawn = {}
    for out, hash_seed in (("figures", "1"), ("figures2", "2")):  # other processes, other str hashes
        result = run(
            cmd + ["--model", str(tmp_path / "model.pt"), "--out", str(tmp_path / out)],
            tmp_path,
            env={"PYTHONHASHSEED": hash_seed},
        )
        assert "drew 12 figures" in result.stderr
        drawn[out] = {p.name: p.read_bytes() for p in sorted((tmp_path / out).iterdir())}
    assert len(drawn["figures"]) == 12 and drawn["figures"] == drawn["figures2"]
    cmd += ["--out", str(tmp_path / "figures")]
    failed = run(cmd + ["--model", str(tmp_path / "missing.pt")], tmp_path, check=False)
    assert failed.returncode == 1 and "error:" in failed.stderr and "missing.pt" in failed.stderr
    assert "Traceback" not in failed.stderr
