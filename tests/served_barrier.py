"""A pyfunc model for the serving tests, saved from this file's code (MLflow's models from code, so no
class is pickled): a request is answered only once PARTIES requests are inside predict at once, so a
server that lets fewer in at a time answers none of them in time."""

from __future__ import annotations

import os
import threading
from typing import Any

import mlflow

PARTIES = "BARRIER_PARTIES"  # the server's environment says how many


class BarrierModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from transformer.serving.serving import prepare_scoring_server

        prepare_scoring_server()  # as the translation model does
        self.together = threading.Barrier(int(os.environ.get(PARTIES, "1")))

    def predict(self, context, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        self.together.wait(timeout=30)
        return list(model_input)


mlflow.models.set_model(BarrierModel())
