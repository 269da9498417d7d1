"""MLflow tracking: a run per training, which the stages after it add their files to, and a run per
evaluation (decode params, scores and the report section) nested under it. mlflow is imported lazily."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformer.errors import TrackingError

URI_ENV = "MLFLOW_TRACKING_URI"


def project_root() -> Path:
    """DVC_ROOT when DVC runs the stage (also in `dvc exp run --temp`), else the working directory."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd()).resolve()


def tracking_uri() -> str:
    return os.environ.get(URI_ENV) or f"sqlite:///{project_root() / 'mlflow.db'}"


def prepare_store(uri: str) -> None:
    """Fails fast, before any training work, when a tracking server does not answer; creates a SQLite
    store that does not exist yet whole (_create_sqlite_store), and waits for one that another process
    is making (_wait_while_made)."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        _create_sqlite_store(path)
        _wait_while_made(path)
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as response:
            response.read()
    except (urllib.error.URLError, OSError) as e:
        raise TrackingError(
            f"MLflow tracking server {uri} ({URI_ENV}) is unreachable: {e}. "
            f"Start it, or unset {URI_ENV} to log to {project_root() / 'mlflow.db'}"
        ) from None


def _create_sqlite_store(path: Path) -> None:
    """MLflow creates a new store's tables and then migrates them, in place: a kill in between leaves a
    store every later run fails on ('table ... already exists'). So the store is made in a temporary
    file that names this process and linked into place only once whole; a process that finds a store
    there first keeps that one. Temporary files of processes no longer alive go, store or no store."""
    for stale in path.parent.glob(f".{path.name}.*.*.tmp"):  # .mlflow.db.<pid>.<random>.tmp
        pid = stale.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    if path.exists():
        return
    from mlflow.tracking import MlflowClient

    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with store_errors():
            MlflowClient(f"sqlite:///{tmp}").search_experiments()  # creates and migrates the tables
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _wait_while_made(path: Path, quiet_s: float = 2.0, limit_s: float = 60.0) -> None:
    """Any other MLflow client (`mlflow ui`, a notebook) makes a missing store in place, over a second
    or two; a run that opens it meanwhile fails on the migrations half done. So until the store's
    schema is MLflow's latest, wait while something still writes it; a store nothing has written for
    quiet_s (an older MLflow's) is left to MLflow to open or refuse."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    latest, deadline = _get_latest_schema_revision(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1)) as db:
                if db.execute("SELECT version_num FROM alembic_version").fetchone() == (latest,):
                    return
        except sqlite3.Error:  # no alembic_version yet, or locked by the writer
            pass
        if time.time() - path.stat().st_mtime > quiet_s:
            return
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=project_root(), timeout=10
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def open_run(
    experiment: str, run_id: str | None = None, run_name: str | None = None, parent_run_id: str | None = None
) -> Tracker:
    """The MLflow run to log to: `run_id`'s where the store holds it (a resumed training's), else a new
    run in `experiment`, nested under `parent_run_id`'s where the store holds that. Fails fast, before
    any work, when a tracking server does not answer."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    prepare_store(uri)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    if run_id is not None and experiment and not _has_run(client, run_id):  # a resumed training's run
        _say(f"MLflow run {run_id}, which the checkpoint names, is not in {uri}: logging to a new run")
        run_id = None
    if parent_run_id and not _has_run(client, parent_run_id):
        _say(
            f"MLflow run {parent_run_id}, the training's, is not in {uri}: this run is logged without it, "
            f"in experiment '{experiment}'"
        )
        parent_run_id = None
    if run_id is None:
        run_id = _create_run(client, experiment, run_name, parent_run_id)
    return Tracker(client, run_id)


def attach(run_id: str) -> Tracker:
    """The run a training opened, for the stages after it."""
    return open_run("", run_id=run_id)


def _has_run(client, run_id: str) -> bool:
    """Whether the store holds the run: a checkpoint may name one of a store since deleted or replaced."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise TrackingError(f"MLflow ({tracking_uri()}): {e.message}") from None
    return True


def _create_run(client, experiment: str, run_name: str | None, parent_run_id: str | None) -> str:
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    with store_errors():
        if parent_run_id:  # nested: in the parent's experiment, shown under it
            experiment_id = client.get_run(parent_run_id).info.experiment_id
            tags = {MLFLOW_PARENT_RUN_ID: parent_run_id}
        else:
            experiment_id, tags = _experiment_id(client, experiment), None
        return client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id


def _experiment_id(client, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if tracking_uri().startswith("sqlite:"):  # artifacts beside the database, not in the cwd
        location = (project_root() / "mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


class Tracker:
    """An open MLflow run (open_run and attach open one). Metrics go through MLflow's asynchronous
    logging (its queue and threads), so the training loop never waits on the tracking store; end()
    waits for them and reports a failure."""

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id
        self._pending: list = []  # MLflow's RunOperations, waited for by end()
        self._system = None  # MLflow's system-metrics thread, once watch_system started it

    def has_run(self, run_id: str) -> bool:
        return _has_run(self.client, run_id)

    def watch_system(self, resumed: bool, every_s: float = 10.0) -> None:
        """Logs this machine's CPU, memory, disk and network use (and the GPUs', where pynvml sees them)
        every `every_s` seconds until end(), as MLflow's system/ metrics; a resumed run's continue its steps.
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides the interval."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._system = SystemMetricsMonitor(
            self.run_id, sampling_interval=every_s, resume_logging=resumed, tracking_uri=tracking_uri()
        )
        self._system.start()

    def log_params(self, params: dict[str, Any]) -> None:
        """Params the run does not have yet (a resumed training logs them again); MLflow batches them."""
        from mlflow.entities import Param

        with store_errors():
            existing = self.client.get_run(self.run_id).data.params
            self.client.log_batch(
                self.run_id, params=[Param(k, str(v)) for k, v in params.items() if k not in existing]
            )

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        with store_errors():
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.log_rows([metrics | {"step": step}])

    def log_rows(self, rows: list[dict[str, float]]) -> None:
        """Rows of metrics, each with its "step", as one batch that MLflow sends asynchronously."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(row["step"])) for row in rows for k, v in row.items() if k != "step"]
        self._pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))

    def log_inputs(self, files: dict[str, tuple[Path, str]]) -> None:
        """Corpus files as the run's dataset inputs, {name: (path, context)}, each with its sha256: in full
        as the input's tag, its first 16 hex digits as the digest (MLflow holds at most 36)."""
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource
        from mlflow.entities import DatasetInput, InputTag

        from transformer.io import sha256_file

        inputs = []
        for name, (path, context) in files.items():
            digest = sha256_file(path)
            dataset = MetaDataset(LocalArtifactDatasetSource(str(path)), name=name, digest=digest[:16])
            tags = [InputTag("mlflow.data.context", context), InputTag("sha256", digest)]
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags))
        with store_errors():
            self.client.log_inputs(self.run_id, inputs)

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        with store_errors():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        with store_errors():
            self.client.log_text(self.run_id, text, artifact_file)

    def end(self, status: str = "FINISHED") -> None:
        """Waits for the queued metrics, then closes the run; a failed write is an error unless the
        run failed already: then the error that failed it is the one to see, and this one is said."""
        from mlflow.exceptions import MlflowException

        if self._system is not None:
            self._system.finish()
            self._system = None
        error = None
        for operation in self._pending:
            try:
                operation.wait()
            except MlflowException as e:
                error = error or e
        self._pending.clear()
        try:
            with store_errors():
                self.client.set_terminated(self.run_id, "FAILED" if error else status)
        except TrackingError as e:
            if status == "FINISHED":
                raise
            _say(f"{e} (while recording the run as {status})")
        if error is not None and status == "FINISHED":
            raise TrackingError(f"MLflow logging failed: {error}")


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """A tracking store that refuses a write, or a server that died: one clear error, not a traceback."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        raise TrackingError(f"MLflow ({tracking_uri()}): {e.message}") from None
    except (OSError, ConnectionError) as e:  # requests' and urllib3's errors when no server answers any more
        raise TrackingError(
            f"MLflow ({tracking_uri()}): {(str(e).strip().splitlines() or [type(e).__name__])[0]}"
        ) from None


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def dvc_exp_name() -> str | None:
    """The experiment's name while `dvc exp run` runs the stage (DVC sets DVC_EXP_NAME), else None."""
    return os.environ.get("DVC_EXP_NAME") or None


def run_name(what: str) -> str:
    """'train' or 'evaluate beam=4 alpha=1.0', then the DVC experiment that ran it, if any."""
    exp = dvc_exp_name()
    return f"{what} · {exp}" if exp else what


def log_to_run(
    run_id: str | None,
    artifacts: dict[str, list[Path]] | None = None,
    texts: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
) -> None:
    """A later stage's files into a finished run: the training's (its id from the model file) or an
    evaluation's (its id from the score stage's --evaluation file); nothing when run_id is None, as it is
    when that run was not tracked. artifacts: {directory: files}; texts: {artifact file: text}."""
    if not run_id or not run_in_store(run_id, ", ".join([*(artifacts or {}), *(texts or {})])):
        return
    tracker = attach(run_id)
    for directory, paths in (artifacts or {}).items():
        for path in paths:
            tracker.log_artifact(path, directory)
    for artifact_file, text in (texts or {}).items():
        tracker.log_text(text, artifact_file)
    if tags:
        tracker.set_tags(tags)
    tracker.end()


def run_in_store(run_id: str, what: str) -> bool:
    """Whether the store holds the run a model file names; where it does not (the store deleted or
    another one in use), says that `what` is not logged, for the stage to go on without it."""
    if attach(run_id).has_run(run_id):
        return True
    _say(f"MLflow run {run_id}, which the model file names, is not in {tracking_uri()}: {what} not logged")
    return False


EVALUATION_SHA256 = "evaluation_sha256"  # the tag that identifies an evaluation logged whole


def log_evaluation(
    training_run_id: str,
    experiment: str,
    what: str,
    params: dict[str, Any],
    metrics: dict[str, float],
    step: int,
    inputs: dict[str, tuple[Path, str]],
    artifacts: dict[str, list[Path]],
    *,
    note: Path | None = None,
) -> str:
    """One evaluation of a trained model as a run of its own, nested under the training's run (in
    `experiment` alone where the store lacks that run): the params that made it, its scores, the corpus
    files it read ({name: (path, context)}) and the DVC experiment that ran it. Returns its id.

    An evaluation the store holds whole already (a finished run of the same name under the same
    training run, with the same params, scores, step and files: its `evaluation_sha256` tag) is not
    logged again: a score stage killed after logging, before DVC recorded its outputs, reruns to the
    same run. `note` holds the run's id from the moment it opens until the caller, having recorded the
    id, removes it: a rerun after a kill finds it and deletes the half-logged run (MLflow keeps deleted
    runs until `mlflow gc`), so the store holds one evaluation, as after an uninterrupted run."""
    name = run_name(what)
    identity = _evaluation_sha256([training_run_id, name, params, metrics, step], artifacts)
    logged = _finished_run_tagged(EVALUATION_SHA256, identity)
    tracker = attach(logged) if logged else open_run(experiment, run_name=name, parent_run_id=training_run_id)
    if note is not None:
        _replace_noted_run(tracker, note)
    if logged:
        return logged
    try:
        tracker.log_params(params)
        tracker.set_tags({"dvc_exp_name": dvc_exp_name(), "git_commit": git_commit(), EVALUATION_SHA256: identity})
        tracker.log_inputs(inputs)
        tracker.log_metrics(metrics, step)
        for directory, paths in artifacts.items():
            for path in paths:
                tracker.log_artifact(path, directory)
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end()
    return tracker.run_id


def _evaluation_sha256(record: list, artifacts: dict[str, list[Path]]) -> str:
    """sha256 of `record` (JSON) and of every artifact's name and bytes."""
    import hashlib
    import json

    from transformer.io import sha256_file

    files = {f"{directory}/{path.name}": sha256_file(path) for directory, paths in artifacts.items() for path in paths}
    return hashlib.sha256(json.dumps([record, files], sort_keys=True).encode()).hexdigest()


def _finished_run_tagged(tag: str, value: str) -> str | None:
    """The id of a finished run of any experiment whose `tag` is `value`, if the store holds one."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    prepare_store(uri)
    client = MlflowClient(uri)
    with store_errors():
        experiments = [e.experiment_id for e in client.search_experiments()]
        found = experiments and client.search_runs(experiments, f"tags.{tag} = '{value}' and status = 'FINISHED'")
    return found[0].info.run_id if found else None


def _replace_noted_run(tracker: Tracker, note: Path) -> None:
    """Deletes the run `note` names where it is a half-logged one (a killed evaluation's: not finished)
    and notes `tracker`'s in its place."""
    import json

    from transformer.io import write_json

    if note.exists():
        stale = json.loads(note.read_text(encoding="utf-8"))["run_id"]
        if stale != tracker.run_id and tracker.has_run(stale):
            if tracker.client.get_run(stale).info.status != "FINISHED":
                tracker.client.delete_run(stale)
    write_json(note, {"run_id": tracker.run_id})


def experiment_name(corpus: str, src_lang: str, tgt_lang: str) -> str:
    return f"{corpus}-{src_lang}-{tgt_lang}"


def runs_table_url(params_path: Path | str, ui: str) -> str:
    """The MLflow UI's runs table for the recipe in params_path (MLflow 3 opens on its GenAI overview);
    the experiments list until a training has created the experiment."""
    from mlflow.tracking import MlflowClient

    from transformer.config import load_params

    d = load_params(params_path).data
    found = MlflowClient(tracking_uri()).get_experiment_by_name(experiment_name(d.corpus, d.src_lang, d.tgt_lang))
    return f"{ui}/#/experiments/{found.experiment_id}/runs" if found else f"{ui}/#/experiments"


def installed_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ("torch", "spacy", "sentencepiece", "dvc", "mlflow", "sacrebleu", "sacremoses", "pandas", "click")
    out = {}
    for name in names:
        try:
            out[f"version.{name}"] = version(name)
        except PackageNotFoundError:
            pass
    return out
