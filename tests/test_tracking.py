"""MLflow tracking against a local sqlite store: asynchronous metrics, evaluation runs nested under the
training's, corpus files as dataset inputs, the UI's runs table."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_params

from transformer.errors import TrackingError

EXPERIMENT = "tracking-tests"  # not the toy recipe's, which the runs-table test creates


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One sqlite store for the module: creating MLflow's tables takes seconds."""
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture
def tracking(store, monkeypatch):
    from transformer import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.setenv("DVC_ROOT", str(store.parent))  # artifacts beside the store, not in the checkout
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    return tracking


def _client(store: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{store}")


def test_a_store_whose_creation_was_stopped_midway_is_made_whole_by_the_next_run(tmp_path, monkeypatch):
    """MLflow creates a new store's tables, then migrates them: stopped in between, nothing may be left
    at mlflow.db for every later run to fail on, and a killed creator's temporary file goes too."""
    import mlflow.store.db.utils as db_utils

    from transformer import tracking

    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(db_utils, "_upgrade_db", lambda engine: (_ for _ in ()).throw(KeyboardInterrupt))
        tracking.open_run(EXPERIMENT)  # stopped with the tables made, not yet migrated
    assert not store.exists()
    (tmp_path / ".mlflow.db.999999999.x1y2.tmp").write_bytes(b"half")  # a SIGKILLed creator's: no such pid
    tracker = tracking.open_run(EXPERIMENT)
    tracker.end()
    assert _client(store).get_run(tracker.run_id).info.status == "FINISHED"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    (tmp_path / ".mlflow.db.999999999.z3w4.tmp").write_bytes(b"whole")  # killed after linking the store
    tracking.open_run(EXPERIMENT).end()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_store_another_client_is_making_in_place_is_waited_for_and_an_old_one_is_not(tmp_path, monkeypatch):
    """`mlflow ui` or a notebook makes a missing store in place; a run starting meanwhile must wait for
    the migrations instead of failing on them; an old store nothing writes is not waited for."""
    import mlflow.store.db.utils as db_utils
    import sqlalchemy

    from transformer import tracking

    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(db_utils, "_upgrade_db", lambda engine: (_ for _ in ()).throw(KeyboardInterrupt))
        _client(store).search_experiments()  # the other client: tables made in place, not yet migrated
    migrate = threading.Timer(1.0, db_utils._upgrade_db, [sqlalchemy.create_engine(f"sqlite:///{store}")])
    migrate.start()
    try:
        tracker = tracking.open_run(EXPERIMENT)
    finally:
        migrate.join()
    tracker.end()
    assert _client(store).get_run(tracker.run_id).info.status == "FINISHED"
    started = time.monotonic()
    tracking.prepare_store(f"sqlite:///{store}")  # whole, just written: no wait
    assert time.monotonic() - started < 1, "waited for a whole store"

    old = tmp_path / "old" / "mlflow.db"  # a store of an older MLflow, nothing writing it
    old.parent.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{old}")
    _client(old).search_experiments()
    with contextlib.closing(sqlite3.connect(old)) as db, db:
        db.execute("UPDATE alembic_version SET version_num = '0584bdc529eb'")
    os.utime(old, (time.time() - 60, time.time() - 60))
    started = time.monotonic()
    tracking.open_run(EXPERIMENT).end()  # MLflow's to judge
    assert time.monotonic() - started < 20, "waited for a store nothing was writing"


def test_rows_logged_asynchronously_are_all_stored_when_the_run_ends(tracking, store):
    tracker = tracking.open_run(EXPERIMENT, run_name=tracking.run_name("train"))
    rows = [{"step": s, "loss": 1.0 / s, "lr": s * 1e-4} for s in range(1, 61)]
    for i in range(0, 60, 20):  # as train.py sends them: a tick's rows at once
        tracker.log_rows(rows[i : i + 20])
    tracker.end()
    run = _client(store).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "train"
    history = _client(store).get_metric_history(tracker.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(r["step"], r["loss"]) for r in rows]


def test_a_watched_run_logs_the_machines_cpu_and_memory_until_it_ends(tracking, store):
    tracker = tracking.open_run(EXPERIMENT)
    tracker.watch_system(resumed=False, every_s=0.2)
    time.sleep(1.5)
    tracker.end()
    metrics = _client(store).get_run(tracker.run_id).data.metrics
    assert metrics["system/system_memory_usage_megabytes"] > 0 and "system/cpu_utilization_percentage" in metrics
    steps = len(_client(store).get_metric_history(tracker.run_id, "system/system_memory_usage_megabytes"))
    time.sleep(0.5)  # ended: the monitor logs no more
    assert len(_client(store).get_metric_history(tracker.run_id, "system/system_memory_usage_megabytes")) == steps


def test_a_metric_the_store_refuses_fails_the_run_when_it_ends(tracking, store):
    tracker = tracking.open_run(EXPERIMENT)
    tracker.log_metrics({"x" * 300: 1.0}, 1)  # longer than a metric key may be: refused by the store, later
    with pytest.raises(TrackingError, match="MLflow logging failed"):
        tracker.end()
    assert _client(store).get_run(tracker.run_id).info.status == "FAILED"


def test_an_evaluation_is_a_named_run_under_the_training_with_its_params_scores_and_corpus_files(
    tracking, store, tmp_path, monkeypatch
):
    monkeypatch.setenv("DVC_EXP_NAME", "bushy-lynx")
    training = tracking.open_run(EXPERIMENT, run_name=tracking.run_name("train"))
    training.end()
    test, train = tmp_path / "test2016.en", tmp_path / "train.en"
    test.write_text("a b.\n")
    train.write_text("c d.\n")
    run_id = tracking.log_evaluation(
        training.run_id,
        EXPERIMENT,
        "evaluate beam=3 alpha=1.0",
        {"decode.beam": 3},
        {"test2016_bleu": 12.5},
        40,
        {"toy/test2016.en": (test, "evaluation"), "toy/train.en": (train, "training")},
        {"translations": [test]},
    )
    run = _client(store).get_run(run_id)
    assert run.info.run_name == "evaluate beam=3 alpha=1.0 · bushy-lynx"
    assert run.info.experiment_id == _client(store).get_run(training.run_id).info.experiment_id
    assert run.data.tags["mlflow.parentRunId"] == training.run_id and run.data.tags["dvc_exp_name"] == "bushy-lynx"
    assert run.data.params == {"decode.beam": "3"} and run.data.metrics == {"test2016_bleu": 12.5}
    assert [(m.step, m.value) for m in _client(store).get_metric_history(run_id, "test2016_bleu")] == [(40, 12.5)]
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    digest = hashlib.sha256(test.read_bytes()).hexdigest()
    assert inputs["toy/test2016.en"].dataset.digest == digest[:16]
    assert {t.key: t.value for t in inputs["toy/test2016.en"].tags} == {
        "mlflow.data.context": "evaluation",
        "sha256": digest,
    }
    assert {t.key: t.value for t in inputs["toy/train.en"].tags}["mlflow.data.context"] == "training"
    assert [a.path for a in _client(store).list_artifacts(run_id, "translations")] == ["translations/test2016.en"]
    assert _client(store).get_run(training.run_id).data.metrics == {}  # the training's run is left as it was


def test_an_evaluation_stopped_while_logging_leaves_no_run_beside_its_rerun(tracking, store, tmp_path, monkeypatch):
    training = tracking.open_run(EXPERIMENT)
    training.end()
    note = tmp_path / ".evaluation.json.run"
    evaluate = functools.partial(
        tracking.log_evaluation, training.run_id, EXPERIMENT, "evaluate", {"decode.beam": 3}, {"bleu": 1.0}, 7, {}, {}
    )
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(tracking.Tracker, "log_metrics", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
        evaluate(note=note)  # stopped half-logged; a SIGKILL would leave its run RUNNING instead of FAILED
    stopped = json.loads(note.read_text())["run_id"]
    run_id = evaluate(note=note)
    client = _client(store)
    experiment = client.get_run(training.run_id).info.experiment_id
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{training.run_id}'")
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].info.status == "FINISHED"
    assert client.get_run(stopped).info.lifecycle_stage == "deleted"  # kept by MLflow until `mlflow gc`
    assert json.loads(note.read_text())["run_id"] == run_id  # the stage removes it once it has recorded the id


def test_an_evaluation_logged_whole_is_not_logged_again_and_a_changed_one_is(tracking, store, tmp_path):
    """A score stage killed after logging its evaluation, before DVC recorded its outputs, reruns: the
    same evaluation finds its finished run; a changed one (other scores) opens a run of its own."""
    training = tracking.open_run(EXPERIMENT)
    training.end()
    note = tmp_path / ".evaluation.json.run"
    table = tmp_path / "scores.md"
    table.write_text("# Scores\n")
    evaluate = functools.partial(
        tracking.log_evaluation, training.run_id, EXPERIMENT, "evaluate", {"decode.beam": 3}, step=7, inputs={}
    )
    first = evaluate(metrics={"bleu": 1.0}, artifacts={"reports": [table]}, note=note)
    assert evaluate(metrics={"bleu": 1.0}, artifacts={"reports": [table]}, note=note) == first
    assert json.loads(note.read_text())["run_id"] == first
    changed = evaluate(metrics={"bleu": 2.0}, artifacts={"reports": [table]}, note=note)
    table.write_text("# Scores, another table\n")
    other_file = evaluate(metrics={"bleu": 1.0}, artifacts={"reports": [table]}, note=note)
    client = _client(store)
    experiment = client.get_run(training.run_id).info.experiment_id
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{training.run_id}'")
    assert sorted(r.info.run_id for r in runs) == sorted({first, changed, other_file})
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}  # none deleted: each one whole


def test_a_later_stage_adds_its_files_to_a_finished_run_and_nothing_when_untracked(tracking, store, tmp_path):
    training = tracking.open_run(EXPERIMENT)
    training.end()
    evaluation = tracking.open_run("", parent_run_id=training.run_id)
    evaluation.end()
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    tracking.log_to_run(training.run_id, {"model": [model]})
    tracking.log_to_run(evaluation.run_id, texts={"reports/reproduction.md": "# toy\n"})
    client = _client(store)
    assert [a.path for a in client.list_artifacts(training.run_id)] == ["model"]
    assert [a.path for a in client.list_artifacts(training.run_id, "model")] == ["model/model.pt"]
    assert [a.path for a in client.list_artifacts(evaluation.run_id, "reports")] == ["reports/reproduction.md"]
    assert {client.get_run(r.run_id).info.status for r in (training, evaluation)} == {"FINISHED"}
    tracking.log_to_run(None, {"model": [tmp_path / "absent.pt"]})  # trained untracked: nothing is read


def test_runs_table_url_names_the_recipes_experiment(tracking, store, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params()))
    assert tracking.runs_table_url(params, "http://h:1") == "http://h:1/#/experiments"  # no toy-de-en run yet
    tracking.open_run("toy-de-en").end()
    experiment = _client(store).get_experiment_by_name("toy-de-en")
    assert tracking.runs_table_url(params, "http://h:1") == f"http://h:1/#/experiments/{experiment.experiment_id}/runs"


def test_runs_a_store_lacks_are_said_and_replaced_not_a_traceback(tracking, store, tmp_path, capsys):
    """A checkpoint or model file may name a run of a store since deleted: a resumed training opens a
    new run, an evaluation stands alone in its experiment, a later stage's files are not logged."""
    gone = "0123456789abcdef0123456789abcdef"
    resumed = tracking.open_run(EXPERIMENT, run_id=gone, run_name="train")
    resumed.end()
    evaluation = tracking.open_run(EXPERIMENT, run_name="evaluate", parent_run_id=gone)
    evaluation.end()
    tracking.log_to_run(gone, {"model": [tmp_path / "absent.pt"]})
    said = capsys.readouterr().err
    client = _client(store)
    assert resumed.run_id != gone and client.get_run(resumed.run_id).info.status == "FINISHED"
    run = client.get_run(evaluation.run_id)
    assert "mlflow.parentRunId" not in run.data.tags
    assert client.get_experiment(run.info.experiment_id).name == EXPERIMENT
    assert said.count(gone) == 3 and "logging to a new run" in said and "model not logged" in said
