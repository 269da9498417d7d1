"""The whole DAG under `dvc repro`, on a toy corpus, in a fresh git repository."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil

import pytest
import yaml

from conftest import BIN, project_copy, run, tiny_params, write_toy_corpus

DVC = str(BIN / "dvc")


@pytest.mark.slow
def test_dvc_repro_runs_all_stages_learns_and_caches(tmp_path):
    repo = project_copy(tmp_path, tiny_params(**{"train.epochs": 20}))  # at 12 the toy model could still repeat a word
    first = run([DVC, "repro"], repo, timeout=600)
    for stage in ("download", "tokenize", "build_vocab", "train", "average_checkpoints", "decode@val",
                  "decode@test2016", "score", "report"):
        assert f"Running stage '{stage}'" in first.stdout
    scores = json.loads((repo / "reports/scores.json").read_text())
    assert set(scores) == {"val", "test2016"}
    assert scores["test2016"]["bleu"] > 80, scores  # the toy translation is learnable
    assert (repo / "data/translations/test2016.txt").read_text().count("\n") == 60
    assert "tok:13a" in (repo / "reports/scores.md").read_text()
    _assert_report_has_every_stage_and_score(repo, scores)

    translated = run([str(BIN / "transformer"), "translate", "--model", "data/model/model.pt", "--beam", "1"], repo,
                     input_text="kan pen.\n\nbin don.\n")
    assert translated.stdout.splitlines() == ["ak ep.", "", "ib od."]

    _assert_mlflow_runs_have_curves_and_scores(repo, scores)

    again = run([DVC, "repro"], repo)
    assert "Running stage" not in again.stdout

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["decode"]["beam"] = 1
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    downstream = run([DVC, "repro"], repo)
    ran = {line.split("'")[1] for line in downstream.stdout.splitlines() if line.startswith("Running stage")}
    assert ran == {"decode@val", "decode@test2016", "score", "report"}

    shown = run([DVC, "metrics", "show"], repo).stdout
    assert "reports/scores.json" in shown and "test2016.bleu" in shown


def _assert_report_has_every_stage_and_score(repo, scores):
    report = (repo / "reports/reproduction.md").read_text()
    assert report.count("<!-- begin toy de-en -->") == 1
    timed = {p.stem for p in (repo / "data/timings").glob("*.json")}
    assert timed == {"download", "tokenize", "build_vocab", "train", "average_checkpoints", "decode@val", "decode@test2016",
                     "score", "figures"}
    for stage in timed:
        assert f"| {stage} |" in report
    assert f"| toy | de→en | test2016 | {scores['test2016']['bleu']} |" in report  # the headline row
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in report.replace("\\|", "|")


def _assert_mlflow_runs_have_curves_and_scores(repo, scores):
    """The training's run holds params and curves; the evaluation's, nested under it, the scores."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "toy-de-en"]
    runs = client.search_runs([experiment.experiment_id])
    (run_,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    (evaluation,) = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == run_.info.run_id]
    assert run_.data.params["model.d_model"] == "32" and "version.torch" in run_.data.params
    assert len(client.get_metric_history(run_.info.run_id, "loss")) > 20
    assert client.get_metric_history(run_.info.run_id, "val_loss")
    assert "test2016_bleu" not in run_.data.metrics and "decode.beam" not in run_.data.params
    assert evaluation.data.metrics["test2016_bleu"] == scores["test2016"]["bleu"]
    assert evaluation.data.params["decode.beam"] == "2"
    assert run_.data.tags["direction"] == "de-en"
    assert {"model", "reports", "vocab", "checkpoints"} <= {a.path for a in client.list_artifacts(run_.info.run_id)}
    assert "reproduction.md" in {a.path.split("/")[-1] for a in client.list_artifacts(run_.info.run_id, "reports")}
    assert {"translations", "reports"} <= {a.path for a in client.list_artifacts(evaluation.info.run_id)}


@pytest.mark.slow
def test_tokenize_param_change_reruns_only_downstream_stages(tmp_path):
    params = tiny_params(**{"train.epochs": 1, "average.last_k": 1})
    repo = project_copy(tmp_path, params)
    run([DVC, "repro", "build_vocab"], repo)
    params["tokenize"]["max_len"] = 6
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = run([DVC, "status"], repo).stdout
    assert "tokenize" in status and "download" not in status
    rerun = run([DVC, "repro", "build_vocab"], repo).stdout
    assert "Running stage 'tokenize'" in rerun and "Running stage 'download'" not in rerun
    dropped = json.loads((repo / "reports/tokenize.json").read_text())["train.dropped_long"]
    assert dropped > 0


def test_download_stage_reads_the_mirror_and_verifies_checksums(tmp_path):
    from conftest import ROOT

    corpus = write_toy_corpus(tmp_path / "plain").parent
    mirror = tmp_path / "mirror" / "toy"
    mirror.mkdir(parents=True)
    entry = {}
    for path in sorted(p for p in corpus.iterdir() if p.suffix in (".de", ".en")):
        packed = mirror / f"{path.name}.gz"
        packed.write_bytes(gzip.compress(path.read_bytes()))
        split, lang = path.name.split(".")
        digest = hashlib.sha256(packed.read_bytes()).hexdigest()
        entry.setdefault(split, {})[lang] = [{"url": f"https://example.org/toy/{packed.name}", "sha256": digest}]
    registry = tmp_path / "corpora.yaml"
    registry.write_text(yaml.safe_dump({"toy": entry}))
    params = tiny_params()
    params["data"]["registry"] = str(registry)
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    mirror_env = {"TRANSFORMER_DATA_MIRROR": str(tmp_path / "mirror")}
    cmd = [str(BIN / "python"), "stages/download.py", "--params", str(params_path), "--out", str(tmp_path / "raw")]
    run(cmd, ROOT, env=mirror_env)
    assert (tmp_path / "raw/train.de").read_bytes() == (corpus / "train.de").read_bytes()

    shutil.rmtree(tmp_path / "raw")
    (mirror / "val.en.gz").write_bytes(gzip.compress(b"tampered\n"))
    failed = run(cmd, ROOT, check=False, env=mirror_env)
    assert failed.returncode == 1
    assert "val.en.gz: checksum mismatch" in failed.stderr and "Traceback" not in failed.stderr
    assert not (tmp_path / "raw").exists()
