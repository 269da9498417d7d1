"""Export to CTranslate2 (greedy translations equal ours in float32), the export stage, the MLflow
model it logs and registers, and `dvc artifacts get` finding the model by the name dvc.yaml declares."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import BIN, ROOT, project_copy, run, tiny_model_file, tiny_params
from test_serve import model_and_vocab  # noqa: F401 (a fixture)
from test_translate import SRC_LINES, word_vocabs

from transformer import checkpoints
from transformer.cli import main
from transformer.config import load_params
from transformer.data.vocab import EOS
from transformer.decoding.search import greedy
from transformer.decoding.translate import Search, Translator
from transformer.serving.export import ctranslate2_translate, export_ctranslate2, load_ctranslate2

LINES = SRC_LINES + ["Hund Hund ein", "Buch liest Frau eine Männer", "ein", ""]
GREEDY = Search(beam=1, alpha=0.0, max_len_extra=6, batch_tokens=6000)  # every line of LINES in one batch


def _model_file(path, norm: str, seed: int, decoder_N: int = 0):
    return tiny_model_file(path, *word_vocabs(), seed=seed, N=2, norm=norm, decoder_N=decoder_N)


@pytest.mark.parametrize("norm, decoder_N", [("pre", 0), ("post", 0), ("pre", 1)])
def test_exported_model_decodes_greedily_as_ours_in_float32(tmp_path, norm, decoder_N):
    translator = Translator(_model_file(tmp_path / "model.pt", norm, seed=0, decoder_N=decoder_N), device="cpu")
    export_ctranslate2(tmp_path / "model.pt", tmp_path / "ct2")
    ended = 0
    for line in LINES:  # one at a time: CTranslate2 bounds a batch's length, we each sentence's
        src = torch.tensor([translator.src_vocab.encode(line) + [EOS]])
        ours = greedy(translator.model, src, torch.tensor([src.size(1) + 6]), 0, EOS)[0] if line else []
        theirs = ctranslate2_translate(
            load_ctranslate2(tmp_path / "ct2"), translator.src_vocab, translator.tgt_vocab, [line], GREEDY
        )[0]
        assert theirs == ours, line
        ended += len(ours) < src.size(1) + 6
    assert 0 < ended < len(LINES)  # some sentences end on </s>, some at the length bound: both paths compared


def test_int8_export_is_smaller_and_still_translates(tmp_path):
    model = _model_file(tmp_path / "model.pt", "pre", seed=1)
    result = CliRunner().invoke(
        main, ["export", "--model", str(model), "--out", str(tmp_path / "int8"), "--quantization", "int8"]
    )
    assert result.exit_code == 0, result.output
    export_ctranslate2(model, tmp_path / "fp32")
    size = {q: (tmp_path / q / "model.bin").stat().st_size for q in ("int8", "fp32")}
    assert size["int8"] < 0.8 * size["fp32"]
    translator = Translator(model, device="cpu")
    out = ctranslate2_translate(
        load_ctranslate2(tmp_path / "int8"), translator.src_vocab, translator.tgt_vocab, LINES, GREEDY
    )
    assert len(out) == len(LINES) and out[-1] == []


def test_ctranslate2_is_refused_the_sampling_and_n_best_lists_only_ours_does():
    for search in (dataclasses.replace(GREEDY, sample=True), dataclasses.replace(GREEDY, beam=2, nbest=2)):
        with pytest.raises(ValueError, match="beam search, one translation a line"):
            ctranslate2_translate(None, *word_vocabs(), LINES, search)  # refused before the engine is asked


def test_export_of_a_non_model_file_is_one_error_line_and_no_output(tmp_path):
    (tmp_path / "notes.txt").write_text("not weights\n")
    result = CliRunner().invoke(
        main, ["export", "--model", str(tmp_path / "notes.txt"), "--out", str(tmp_path / "ct2")]
    )
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and "not a model file" in result.stderr
    assert not (tmp_path / "ct2").exists() and list(tmp_path.iterdir()) == [tmp_path / "notes.txt"]


def test_export_stage_logs_and_registers_the_mlflow_model_and_promote_sets_the_alias(
    model_and_vocab, tmp_path, monkeypatch
):
    import mlflow
    from mlflow import MlflowClient

    model_path, vocab_path = model_and_vocab
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = MlflowClient().create_run(MlflowClient().create_experiment("toy")).info.run_id
    tracked = checkpoints.load(model_path) | {"mlflow_run_id": run_id}
    checkpoints.save(tmp_path / "model.pt", tracked)
    params = load_params(ROOT / "params.yaml").to_dict() | {
        "export": {"registered_name": "toy-translator", "quantization": "none"}
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run(
        [
            str(BIN / "python"),
            str(ROOT / "stages" / "export.py"),
            "--params",
            "params.yaml",
            "--model",
            "model.pt",
            "--vocab",
            str(vocab_path.parent),
            "--out",
            "ct2",
        ],
        tmp_path,
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"},
    )
    assert (tmp_path / "ct2" / "model.bin").exists()
    (version,) = MlflowClient().search_model_versions("name='toy-translator'")
    assert version.run_id == run_id and str(version.version) == "1"
    result = CliRunner().invoke(
        main, ["promote", "1", "--alias", "champion", "--params", str(tmp_path / "params.yaml")]
    )
    assert result.exit_code == 0, result.output
    served = mlflow.pyfunc.load_model("models:/toy-translator@champion")
    assert served.predict(["ein Hund läuft."]) == Translator.load(model_path, device="cpu").translate(
        ["ein Hund läuft."]
    )
    assert CliRunner().invoke(main, ["promote", "7", "--params", str(tmp_path / "params.yaml")]).exit_code == 1


def test_export_stage_goes_on_without_the_mlflow_model_when_the_store_lacks_the_models_run(model_and_vocab, tmp_path):
    model_path, vocab_path = model_and_vocab
    checkpoints.save(tmp_path / "model.pt", checkpoints.load(model_path) | {"mlflow_run_id": "f" * 32})
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    cmd = [str(BIN / "python"), str(ROOT / "stages" / "export.py"), "--model", "model.pt"]
    result = run(
        cmd + ["--vocab", str(vocab_path.parent), "--out", "ct2"],
        tmp_path,
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/empty.db"},
    )
    assert (tmp_path / "ct2" / "model.bin").exists() and "Traceback" not in result.stderr
    assert (
        f"MLflow run {'f' * 32}, which the model file names, is not in sqlite:///{tmp_path}/empty.db" in result.stderr
    )
    assert "the MLflow model (registered name 'transformer-multi30k-de-en') not logged" in result.stderr


def test_a_store_that_dies_under_a_failed_run_leaves_the_runs_own_error_to_be_seen(tmp_path, monkeypatch, capsys):
    from mlflow.exceptions import MlflowException

    from transformer.errors import TrackingError
    from transformer.tracking import open_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    tracker = open_run("toy", run_name="train")

    def dead(*args, **kwargs):
        raise MlflowException("the server went away")

    monkeypatch.setattr(tracker.client, "set_terminated", dead)
    tracker.end("FAILED")  # inside train's failure path: said, not raised over the real error
    assert "the server went away (while recording the run as FAILED)" in capsys.readouterr().err
    with pytest.raises(TrackingError, match="the server went away"):
        tracker.end()


def test_dvc_yaml_declares_the_models_as_artifacts():
    artifacts = yaml.safe_load((ROOT / "dvc.yaml").read_text())["artifacts"]
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    outs = {out if isinstance(out, str) else next(iter(out)) for s in stages.values() for out in s.get("outs", [])}
    assert artifacts["transformer-model"]["path"] == "data/model/model.pt"
    assert all(a["type"] == "model" and a["path"] in outs for a in artifacts.values())  # each is a stage's output


@pytest.mark.slow
def test_dvc_artifacts_get_finds_the_model_by_name(model_and_vocab, tmp_path):
    """The project in a git + DVC repository whose average_checkpoints outputs are committed to DVC and
    pushed, and a version registered (a GTO git tag, as `gto register` writes); `dvc artifacts get` from
    another directory fetches model.pt by the artifact's name."""
    repo = project_copy(tmp_path, tiny_params())
    dvc = str(BIN / "dvc")
    for path in ("data/checkpoints/ckpt_00000001.pt", "data/model/model.pt"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(model_and_vocab[0], repo / path)
    (repo / "data" / "timings").mkdir()
    (repo / "data" / "timings" / "average_checkpoints.json").write_text("{}\n")
    run([dvc, "remote", "add", "-d", "local", str(tmp_path / "remote")], repo)
    run([dvc, "commit", "-f", "average_checkpoints"], repo)  # as if the stage had run
    run([dvc, "push", "average_checkpoints"], repo)
    run(["git", "add", "-A"], repo)
    git = ["git", "-c", "user.name=Test", "-c", "user.email=test@example.com"]
    run(git + ["commit", "-qm", "model"], repo)
    run(
        git + ["tag", "-a", "transformer-model@v1.0.0", "-m", "Registering artifact transformer-model version v1.0.0"],
        repo,
    )
    (tmp_path / "elsewhere").mkdir()
    run([dvc, "artifacts", "get", str(repo), "transformer-model"], tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "model.pt").read_bytes() == model_and_vocab[0].read_bytes()


def test_bench_measures_ours_against_ctranslate2_fp32_and_int8_in_one_run(tmp_path):
    from bench import bench

    model = _model_file(tmp_path / "model.pt", "pre", seed=3)
    lines = ["ein Hund läuft", "ein Kind läuft", "Hund Hund ein", "eine Frau liest"]  # one length: one bound for both
    # (seed 3: some of these end on </s>, some at the bound)
    (tmp_path / "src").write_text("\n".join(lines) + "\n")
    (tmp_path / "ref").write_text("a dog runs\na child runs\na dog\na woman reads\n")
    (tmp_path / "work").mkdir()
    rows = bench.model_rows(model, tmp_path / "src", tmp_path / "ref", tmp_path / "work", beam=1)
    assert [(r["key"], r["dtype"]) for r in rows] == [
        ("ours-beam", "fp32"),
        ("ctranslate2-fp32", "fp32"),
        ("ctranslate2-int8", "int8"),
    ]
    assert all(r["tokens_per_s"] > 0 and r["sentences"] == 4 for r in rows)
    assert (
        rows[0]["bleu"] == rows[1]["bleu"] and rows[0]["target_tokens"] == rows[1]["target_tokens"]
    )  # greedy fp32: same output
    assert rows[0]["vs"] == "ctranslate2-fp32" and rows[0]["ratio"] == pytest.approx(
        rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], abs=1e-3
    )


def test_export_of_an_ensemble_writes_its_first_member(tmp_path):
    first = checkpoints.load(_model_file(tmp_path / "first.pt", "pre", seed=0))
    other = checkpoints.load(_model_file(tmp_path / "other.pt", "pre", seed=1))
    checkpoints.save(tmp_path / "ensemble.pt", first | {"members": [{"seed": 2, "model": other["model"]}]})
    export_ctranslate2(tmp_path / "ensemble.pt", tmp_path / "ensemble")
    export_ctranslate2(tmp_path / "first.pt", tmp_path / "alone")
    assert (tmp_path / "ensemble" / "model.bin").read_bytes() == (tmp_path / "alone" / "model.bin").read_bytes()
    assert len(Translator(tmp_path / "ensemble.pt", device="cpu").model.models) == 2
