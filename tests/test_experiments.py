"""DVC experiments, a DVC remote and a real MLflow tracking server, end to end."""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import DVC, MlflowServer, mlflow_client, mlflow_runs, project_copy, run, tiny_params, tool_env

from transformer.evaluation.score import values

GIT = ["git", "-c", "user.name=Test", "-c", "user.email=test@example.com"]
DOWNSTREAM_OF_TRAIN = {
    "train",
    "average_checkpoints",
    "decode@val",
    "decode@test2016",
    "score",
    "figures",
    "report",
    "export",
}

# The module's baseline trains 2 epochs (58 updates) to keep the suite short: test2016 BLEU 0.4-0.6
# (measured), so the floor only says the model matched something; test_pipeline's 20-epoch run checks > 80.
TOY_BLEU_FLOOR = 0
pytestmark = pytest.mark.slow


def _ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")}


def _commit(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], repo)
    run(GIT + ["commit", "-qm", message], repo)


def _experiments(repo: Path) -> list[dict]:
    """Every commit and experiment of `dvc exp show --json`, as {name, params, scores} (scores: None until done)."""
    found = []

    def walk(node):
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            data = node.get("data")
            if isinstance(data, dict) and "params" in data:
                params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
                scores = ((data.get("metrics") or {}).get("reports/scores.json") or {}).get("data")
                found.append({"name": node.get("name"), "rev": node.get("rev"), "params": params, "scores": scores})
            for value in node.values():
                walk(value)

    walk(json.loads(run([DVC, "exp", "show", "--json"], repo).stdout))
    return found


def _with_warmup(repo: Path, warmup: int) -> list[dict]:
    return [e for e in _experiments(repo) if e["params"].get("train", {}).get("warmup") == warmup]


def _named(repo: Path, section: str, key: str, value) -> dict:
    """The one named experiment of `dvc exp show` whose params have section.key == value."""
    (exp,) = [e for e in _experiments(repo) if e["name"] and e["params"].get(section, {}).get(key) == value]
    return exp


def _history(repo: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run with all its logged (step, value) pairs."""
    client = mlflow_client(repo)
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def _artifacts(repo: Path, run_id: str, directory: str) -> dict[str, str]:
    """path -> text of every file a run holds under `directory` of its artifacts."""
    import tempfile

    client = mlflow_client(repo)
    with tempfile.TemporaryDirectory() as d:
        return {
            a.path: Path(client.download_artifacts(run_id, a.path, d)).read_text(encoding="utf-8")
            for a in client.list_artifacts(run_id, directory)
            if not a.is_dir
        }


def _assert_report_section(repo: Path, run, exp: dict) -> None:
    """The evaluation's run holds the report section of its own scores and decoding."""
    reports = _artifacts(repo, run.info.run_id, "reports")
    assert "reports/reproduction.md" in reports, sorted(reports)
    section = reports["reports/reproduction.md"]
    beam, alpha = (exp["params"]["decode"][k] for k in ("beam", "alpha"))
    assert f"| decoding | beam {beam}, α {alpha}," in section
    assert f"| toy | de→en | test2016 | {exp['scores']['test2016']['bleu']} ± " in section  # the headline row


def _assert_evaluation_run(run, training_run_id: str, exp: dict, param: str, value) -> None:
    """An evaluation's own run: nested under the training's, with the experiment's param, name and scores."""
    assert run.data.tags["mlflow.parentRunId"] == training_run_id
    assert run.data.params[param] == str(value)
    assert run.data.tags["dvc_exp_name"] == exp["name"]
    assert run.info.run_name.startswith("evaluate ") and exp["name"] in run.info.run_name
    for testset, scores in exp["scores"].items():
        assert run.data.metrics[f"{testset}_bleu"] == scores["bleu"]
        assert run.data.metrics[f"{testset}_chrf"] == scores["chrf"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """The toy project after one `dvc repro`, everything (dvc.lock, reports) committed."""
    tmp = tmp_path_factory.mktemp("baseline")
    repo = project_copy(tmp, tiny_params(**{"train.epochs": 2}))
    run([DVC, "repro"], repo, timeout=600)
    _commit(repo, "baseline")
    return repo


@pytest.fixture
def repo(baseline: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(baseline, copy, symlinks=True)
    return copy


def _shown_by_dvc(path: Path) -> dict:
    """The metrics file as DVC shows it: the values; the intervals beside them are lists, which DVC leaves out."""
    return {t: values(s) for t, s in json.loads(path.read_text()).items()}


def _training_run_id(runs: dict) -> str:
    (found,) = [i for i, r in runs.items() if "mlflow.parentRunId" not in r.data.tags]
    return found


def test_exp_run_reruns_train_and_downstream_only_and_exp_show_lists_it(repo):
    out = run([DVC, "exp", "run", "-S", "train.warmup=50"], repo, timeout=300).stdout
    assert _ran(out) == DOWNSTREAM_OF_TRAIN, out
    exp = _named(repo, "train", "warmup", 50)
    assert exp["scores"] == _shown_by_dvc(repo / "reports/scores.json")
    assert exp["scores"]["test2016"]["bleu"] > TOY_BLEU_FLOOR, exp["scores"]
    baselines = _with_warmup(repo, 100)
    assert baselines and all(b["scores"] != exp["scores"] for b in baselines)
    changed = run([DVC, "exp", "show", "--only-changed", "--csv"], repo).stdout.splitlines()[0]
    assert "train.warmup" in changed and "model.d_model" not in changed


def test_decode_experiment_gets_an_evaluation_run_nested_under_the_unchanged_training_run(repo):
    before = mlflow_runs(repo)
    training = _training_run_id(before)
    history = _history(repo, training)
    out = run([DVC, "exp", "run", "-S", "decode.beam=1"], repo, timeout=300).stdout
    assert _ran(out) == {"decode@val", "decode@test2016", "score", "report"}, out
    exp = _named(repo, "decode", "beam", 1)
    assert exp["scores"] == _shown_by_dvc(repo / "reports/scores.json")
    assert exp["scores"]["test2016"]["bleu"] > TOY_BLEU_FLOOR, exp["scores"]
    after = mlflow_runs(repo)
    (evaluation,) = [after[i] for i in after.keys() - before.keys()]
    _assert_evaluation_run(evaluation, training, exp, "decode.beam", 1)
    assert _history(repo, training) == history  # no score lands in the training's curves
    assert not [k for k in after[training].data.params if k.startswith("decode.")]
    _assert_report_section(repo, evaluation, exp)
    assert "reports/reproduction.md" not in _artifacts(repo, training, "reports")  # no evaluation's section
    (first,) = [r for r in before.values() if r.data.tags.get("mlflow.parentRunId") == training]
    assert "| decoding | beam 2," in _artifacts(repo, first.info.run_id, "reports")["reports/reproduction.md"]

    inputs = {d.dataset.name: d for d in evaluation.inputs.dataset_inputs}
    assert set(inputs) == {f"toy/{split}.{lang}" for split in ("train", "val", "test2016") for lang in ("de", "en")}
    reference = inputs["toy/test2016.en"]
    digest = hashlib.sha256((repo / "data/raw/test2016.en").read_bytes()).hexdigest()
    assert reference.dataset.digest == digest[:16]
    assert {t.key: t.value for t in reference.tags} == {"mlflow.data.context": "evaluation", "sha256": digest}


def test_pushed_model_is_pulled_into_a_fresh_clone_without_retraining(repo, tmp_path):
    run([DVC, "remote", "add", "-d", "local", str(tmp_path / "remote")], repo)
    _commit(repo, "remote")
    run([DVC, "push"], repo)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    assert not (clone / "data/model/model.pt").exists()
    run([DVC, "pull"], clone)
    digest = [hashlib.sha256((r / "data/model/model.pt").read_bytes()).hexdigest() for r in (repo, clone)]
    assert digest[0] == digest[1]
    assert "up to date" in run([DVC, "status"], clone).stdout
    assert not _ran(run([DVC, "repro"], clone).stdout)


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path)
    try:
        yield server.uri, server.artifacts
    finally:
        server.stop()


def _api(uri: str, endpoint: str, body: dict | None = None, **query) -> dict:
    url = f"{uri}/api/2.0/mlflow/{endpoint}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def test_pipeline_logs_to_a_real_tracking_server(tmp_path, mlflow_server):
    uri, artifacts_dir = mlflow_server
    repo = project_copy(tmp_path, tiny_params(**{"train.epochs": 2}))
    run([DVC, "repro"], repo, timeout=600, env={"MLFLOW_TRACKING_URI": uri})
    assert not (repo / "mlflow.db").exists()

    experiments = _api(uri, "experiments/search", {"max_results": 100})["experiments"]
    (experiment,) = [e for e in experiments if e["name"] == "toy-de-en"]
    runs = _api(uri, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
    tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
    ((found, _), (evaluation, evaluation_tags)) = sorted(zip(runs, tags), key=lambda rt: "mlflow.parentRunId" in rt[1])
    run_id = found["info"]["run_id"]
    assert evaluation_tags["mlflow.parentRunId"] == run_id
    params = {p["key"]: p["value"] for p in found["data"]["params"]}
    metrics = {m["key"]: m["value"] for m in found["data"]["metrics"]}
    assert params["model.d_model"] == "32" and params["train.warmup"] == "100" and "val_loss" in metrics
    scored = {m["key"]: m["value"] for m in evaluation["data"]["metrics"]}
    assert scored["test2016_bleu"] == json.loads((repo / "reports/scores.json").read_text())["test2016"]["bleu"]
    loss = _api(uri, "metrics/get-history", run_id=run_id, metric_key="loss", max_results=10000)["metrics"]
    val_loss = _api(uri, "metrics/get-history", run_id=run_id, metric_key="val_loss")["metrics"]
    assert len(loss) > 20 and len(val_loss) == 2
    listed = {f["path"] for f in _api(uri, "artifacts/list", run_id=run_id).get("files", [])}
    assert {"model", "figures", "vocab"} <= listed
    evaluated = {f["path"] for f in _api(uri, "artifacts/list", run_id=evaluation["info"]["run_id"]).get("files", [])}
    assert {"translations", "reports"} <= evaluated
    figures = {f["path"] for f in _api(uri, "artifacts/list", run_id=run_id, path="figures")["files"]}
    assert "figures/lr_schedule.png" in figures
    stored = {p.name for p in artifacts_dir.rglob("*") if p.is_file()}  # went through the server, into its store
    assert {"model.pt", "test2016.txt", "lr_schedule.png"} <= stored


@pytest.mark.timeout(1800)  # two trainings at once, on a CI runner's two cores
def test_two_queued_training_experiments_run_side_by_side_each_with_its_own_runs(repo):
    """`dvc queue start -j 2`: two experiments that each train run at once, each in a temporary copy of its
    own under .dvc/tmp/exps (as `dvc exp run --temp` runs too), all logging to the repository root's
    mlflow.db, each run named and tagged with its experiment. torchrun is left to pick a free port for
    each (as it does for one node when PET_MASTER_PORT is unset), as two trainings on one host need."""
    before = mlflow_runs(repo)
    for warmup in (50, 70):
        run([DVC, "exp", "run", "--queue", "-S", f"train.warmup={warmup}"], repo)
    queued = [e for e in _experiments(repo) if e["params"]["train"]["warmup"] != 100]
    assert len(queued) == 2 and not [e for e in queued if e["scores"]]  # queued, not run
    try:
        env = {k: v for k, v in tool_env().items() if k != "PET_MASTER_PORT"}
        # The workers it starts outlive it: output to a file, as a pipe would stay open until they end.
        with (repo.parent / "queue-start.log").open("w") as log:
            subprocess.run(
                [DVC, "queue", "start", "-j", "2"], cwd=repo, env=env, stdout=log, stderr=log, check=True, timeout=300
            )
        names = _wait_for_queue(repo, seconds=1200)
    finally:
        run([DVC, "queue", "stop", "--kill"], repo, check=False)  # a failed test leaves no training running
    for name in names:
        logs = run([DVC, "queue", "logs", name], repo).stdout
        assert "Traceback" not in logs and "ERROR" not in logs, logs[-3000:]
    after, client = mlflow_runs(repo), mlflow_client(repo)
    new = {i: after[i] for i in after.keys() - before.keys()}
    trainings = [r for r in new.values() if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.data.params["train.warmup"] for r in trainings) == ["50", "70"]
    for training in trainings:
        exp = _named(repo, "train", "warmup", int(training.data.params["train.warmup"]))
        assert exp["scores"]["test2016"]["bleu"] > TOY_BLEU_FLOOR, exp["scores"]
        assert training.data.tags["dvc_exp_name"] == exp["name"] and training.info.run_name == f"train · {exp['name']}"
        (evaluation,) = [r for r in new.values() if r.data.tags.get("mlflow.parentRunId") == training.info.run_id]
        _assert_evaluation_run(evaluation, training.info.run_id, exp, "decode.beam", 2)
        _assert_report_section(repo, evaluation, exp)
        assert training.info.status == evaluation.info.status == "FINISHED"
        assert {"model", "figures", "vocab"} <= {a.path for a in client.list_artifacts(training.info.run_id)}
        assert {"translations", "reports"} <= {a.path for a in client.list_artifacts(evaluation.info.run_id)}
    assert len(new) == 4, [r.info.run_name for r in new.values()]


def _wait_for_queue(repo: Path, seconds: float) -> list[str]:
    """Waits for every queued experiment to end; their names. Fails if one failed or the wait is over."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        lines = run([DVC, "queue", "status"], repo).stdout.splitlines()[1:]  # under its header: task, name, ..., status
        rows = [line.split() for line in lines if line.strip() and not line.startswith("Worker")]
        states = {row[1]: row[-1] for row in rows if len(row) > 2}
        if states and all(s in ("Success", "Failed") for s in states.values()):
            assert set(states.values()) == {"Success"}, states
            return list(states)
        assert time.monotonic() < deadline, f"the queue did not finish in {seconds} s: {rows}"
        time.sleep(2)


def test_a_queued_seed_sweep_compares_as_a_group_whose_mean_and_spread_are_its_experiments(repo, monkeypatch):
    import dvc.api
    from click.testing import CliRunner

    from transformer.cli import main

    # Up to the score stage: the figures, the report and the export feed nothing compare reads.
    # Seed 1 is the baseline's own training, which the queue restores from DVC's run cache: one new training.
    run([DVC, "exp", "run", "--queue", "-n", "seed", "-S", "train.seed=1,2", "score"], repo)
    try:
        run([DVC, "exp", "run", "--run-all"], repo, timeout=560)  # runs the queue and waits for every result
    finally:
        run([DVC, "queue", "stop"], repo, check=False)
    # -n names a sweep's experiments name-1, name-2, ... in the order of the values, as the docs say.
    swept = {e["params"]["train"]["seed"]: e for e in _experiments(repo) if e["name"] in ("seed-1", "seed-2")}
    assert {seed: e["name"] for seed, e in swept.items()} == {1: "seed-1", 2: "seed-2"}
    group = "seed-1,seed-2"
    monkeypatch.chdir(repo)
    args = ["compare", group, "HEAD", "--refs", "data/raw/test2016.en", "--lang", "en", "--metric", "chrf", "--json"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    seeds, baseline = json.loads(result.stdout)["metrics"]["chrf"]["groups"]
    scores = [swept[seed]["scores"]["test2016"]["chrf"] for seed in (1, 2)]
    assert seeds["group"] == group and seeds["scores"] == scores
    assert seeds["mean"] == round(statistics.fmean(scores), 2) and seeds["sd"] == round(statistics.stdev(scores), 2)
    translations = {dvc.api.read("data/translations/test2016.txt", rev=swept[seed]["name"]) for seed in (1, 2)}
    assert (seeds["sd"] > 0) == (len(translations) > 1)  # a seed moves the score where it moves the translations
    # The baseline trained with seed 1: the sweep's first experiment is the same run, restored from the cache.
    assert baseline["scores"] == [scores[0]] and baseline["test"] == "student"
    assert baseline["diff"] == round(scores[0] - seeds["mean"], 2)
