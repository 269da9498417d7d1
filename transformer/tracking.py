"""MLflow tracking: one run per training, shared by the stages after it. mlflow is imported lazily."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from transformer.errors import TrackingError

URI_ENV = "MLFLOW_TRACKING_URI"


def project_root() -> Path:
    """DVC_ROOT when DVC runs the stage (also in `dvc exp run --temp`), else the working directory."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd()).resolve()


def tracking_uri() -> str:
    return os.environ.get(URI_ENV) or f"sqlite:///{project_root() / 'mlflow.db'}"


def check_reachable(uri: str) -> None:
    """Fails fast, before any training work, when a tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as response:
            response.read()
    except (urllib.error.URLError, OSError) as e:
        raise TrackingError(f"MLflow tracking server {uri} ({URI_ENV}) is unreachable: {e}. "
                            f"Start it, or unset {URI_ENV} to log to {project_root() / 'mlflow.db'}") from None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=project_root(), timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


class Tracker:
    """An MLflow run. Metrics are queued and sent in batches by a background thread, so the
    training loop never waits on the tracking store."""

    def __init__(self, experiment: str, run_id: str | None = None, run_name: str | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        uri = tracking_uri()
        check_reachable(uri)
        mlflow.set_tracking_uri(uri)
        self.client = MlflowClient(uri)
        if run_id is None:
            run_id = self.client.create_run(self._experiment_id(experiment), run_name=run_name).info.run_id
        self.run_id = run_id
        self._queue: queue.Queue = queue.Queue()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    @classmethod
    def attach(cls, run_id: str) -> Tracker:
        """The run a training opened, for the stages after it."""
        return cls("", run_id=run_id)

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if tracking_uri().startswith("sqlite:"):  # artifacts beside the database, not in the cwd
            location = (project_root() / "mlartifacts").as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        fresh = [Param(k, str(v)) for k, v in params.items() if k not in existing]
        for i in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[i:i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            if v is not None:
                self.client.set_tag(self.run_id, k, str(v))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._queue.put((dict(metrics), step))

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def _drain(self) -> None:
        import time

        from mlflow.entities import Metric

        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            now = int(time.time() * 1000)
            metrics = [Metric(k, float(v), now, step) for item in items if item for k, v in item[0].items() for step in [item[1]]]
            try:
                for i in range(0, len(metrics), 1000):
                    self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
            except Exception as e:  # reported by end(), in the training thread
                self._error = e
            for _ in items:
                self._queue.task_done()
            if any(item is None for item in items):
                return

    def end(self, status: str = "FINISHED") -> None:
        self._queue.put(None)
        self._thread.join()
        self.client.set_terminated(self.run_id, status)
        if self._error is not None and status == "FINISHED":
            raise TrackingError(f"MLflow logging failed: {self._error}")


def experiment_name(corpus: str, src_lang: str, tgt_lang: str) -> str:
    return f"{corpus}-{src_lang}-{tgt_lang}"


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
