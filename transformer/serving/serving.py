"""The averaged model as an MLflow pyfunc model: raw sentences in, translations out, so that
`mlflow models serve` answers POST /invocations. It carries the model file, its vocabulary and
this package's code; it decodes with the model's own decode params."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from transformer.serving.batcher import Batcher

# What one request may cost. MLflow reads the body whole before predict sees it (it has no cap on its
# size: put one in a proxy in front), so these bound what is done with it; time is MLflow's --timeout.
MAX_SENTENCES = 1000  # more is a batch job (transformer translate), not a request
MAX_CHARACTERS = 1_000_000  # of all sentences together, counted before the tokenizer reads them
MESSAGE_LIMIT = 240  # characters of an error's message: its start and its end, which say what was wrong
# How the server batches requests (see Batcher), set in its environment: the environment is what
# `mlflow models serve` hands a deployer.
WINDOW_MS = "TRANSFORMER_SERVE_WINDOW_MS"  # how long a search waits for requests still being prepared
BATCH_TOKENS = "TRANSFORMER_SERVE_BATCH_TOKENS"  # source tokens a search takes, at most (beyond one request)
THREADS = "TRANSFORMER_SERVE_THREADS"  # torch's threads in a server process; unset: torch's default
ADMITTED = 64  # requests a server process lets into predict at once; the others wait for one to leave
EXAMPLE = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]


class TranslationModel(mlflow.pyfunc.PythonModel):
    """A list of sentences in, a list of translations out."""

    def load_context(self, context) -> None:
        from transformer.data.vocab import load_vocabs
        from transformer.decoding.translate import Translator

        prepare_scoring_server()
        self.translator = Translator.load(context.artifacts["model"], device="cpu")
        vocab = Path(context.artifacts["vocab"])
        self.translator.check_vocab(*load_vocabs(vocab.parent), vocab)  # load_vocabs reads <dir>/vocab.pt
        self.search = self.translator.search()  # the model's decode params, checked once, at loading
        window, max_tokens, threads = _batching(default_tokens=self.search.batch_tokens // self.search.beam)
        if threads:
            import torch

            torch.set_num_threads(threads)  # once, for the process: one search runs at a time
        self.batcher = Batcher(self._translate, window=window, max_tokens=max_tokens)

    def _translate(self, lines: list[str], timeout: float) -> list[str]:
        return self.translator.translate_tokenized(lines, self.search, timeout=timeout)

    def predict(self, context, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        """MLflow reads the signature from these type hints and refuses other input with a 400. The
        sentences are translated together with those of the requests in the server at the same time
        (see Batcher). Decoding stops MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT seconds after predict
        began: the server has answered 504 by then, and without this the worker would go on
        translating for no one."""
        from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT
        from mlflow.protos.databricks_pb2 import DEADLINE_EXCEEDED, INTERNAL_ERROR

        started, limit = time.monotonic(), MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.get()
        with self.batcher.arrival() as hand_over:
            tokenized = self.translator.tokenize(_sentences(model_input))
            answer = hand_over(tokenized, tokens=self._source_tokens(tokenized), deadline=started + limit)
        try:
            return answer.result()
        except TimeoutError:
            why = f"translation stopped after {limit} s ({MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.name})"
            logging.getLogger(__name__).warning(why)  # in the server, the 504 has gone out already
            raise MlflowException(why, error_code=DEADLINE_EXCEEDED) from None
        except Exception as e:  # the search failed: the server's fault, not the request's
            raise MlflowException(f"translation failed: {type(e).__name__}: {e}", error_code=INTERNAL_ERROR) from e

    def _source_tokens(self, tokenized: list[str]) -> int:
        """The request's source tokens, or a 400 naming the first sentence longer than the model takes."""
        longest, total = self.translator.params["tokenize"]["max_len"], 0
        for i, line in enumerate(tokenized):
            tokens = len(self.translator.src_vocab.encode(line))  # as decoding sees them, less </s>
            if tokens > longest:
                raise MlflowException.invalid_parameter_value(
                    f"inputs[{i}]: {tokens} tokens, more than the model takes (tokenize.max_len = {longest})"
                )
            total += tokens + 1
        return total


def clipped(message: str) -> str:
    """An error message without MLflow's copies of the request: its "Failed to predict data
    '<request>'. Error: " before the reason and "Input: <body>" after a JSON error, then at most
    MESSAGE_LIMIT characters, the middle cut (a reason may still quote a bad input, as the type
    check's list of invalid elements and a decoding error's bytes do)."""
    message = message.split("\nInput: \n", 1)[0]
    if message.startswith("Failed to predict data '") and "\nError: " in message:
        message = message.rsplit("\nError: ", 1)[1]
    if len(message) <= MESSAGE_LIMIT:
        return message
    half = MESSAGE_LIMIT // 2
    return f"{message[:half]} [... {len(message) - 2 * half} characters cut ...] {message[-half:]}"


def prepare_scoring_server() -> None:
    """In the process of MLflow's scoring server, once: its answers to bad requests carry clipped
    messages (_clipping), and up to ADMITTED requests reach predict at once (_Admitting). The server
    imports its module before it loads the model, which is how this finds it; anywhere else (a
    notebook, a test) nothing changes."""
    server = sys.modules.get("mlflow.pyfunc.scoring_server")
    if server is None or isinstance(server.asyncio, _Admitting):
        return
    server.invocations = _clipping(server.invocations)
    server.asyncio = _Admitting()


def _clipping(invocations):
    """The server's `invocations`, which it calls for each request, with the message of any
    MlflowException clipped on its way out.

    The server puts the request, whole, in the message of every error predict raises, and a body
    that is not JSON after its own: a 1 MB request came back as a 1 MB error, a client's secrets
    with it."""

    @functools.wraps(invocations)
    def clipping(*args, **kwargs):
        try:
            return invocations(*args, **kwargs)
        except MlflowException as e:
            e.message = clipped(e.message)
            raise

    return clipping


class _Admitting(types.ModuleType):
    """asyncio, but `to_thread` runs on a pool of ADMITTED threads.

    The server runs each request's predict through its module's `asyncio.to_thread`, on the event
    loop's default pool of min(32, cores + 4) threads: on 2 cores a seventh concurrent request waited
    for a thread before the batcher could see it, so no search held more than six requests. The
    server loads the model before its event loop exists (uvicorn imports the app first), so no loop's
    pool can be set; the server module's view of asyncio is this instead. A thread in predict spends
    its time waiting for its search, so a wide pool costs little."""

    def __init__(self) -> None:
        super().__init__("asyncio")
        self.pool = ThreadPoolExecutor(max_workers=ADMITTED, thread_name_prefix="predict")

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def to_thread(self, func, /, *args, **kwargs):
        call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)  # as asyncio's does
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)


def _batching(default_tokens: int) -> tuple[float, int, int]:
    """The window (seconds), the cap of a search's source tokens and torch's threads (0: torch's
    default), from the server's environment; a value that is not a whole number in range stops the
    model's loading with a message naming its variable."""
    import os

    def read(name: str, default: int, least: int) -> int:
        text = os.environ.get(name, str(default))
        if not text.strip().isdigit() or int(text) < least:
            raise ValueError(f"{name} = {text!r}: expected a whole number >= {least}")
        return int(text)

    return read(WINDOW_MS, 20, 0) / 1000, read(BATCH_TOKENS, max(1, default_tokens), 1), read(THREADS, 0, 0)


def _sentences(model_input: list[str]) -> list[str]:
    """The request's sentences (MLflow has checked they are strings), or a 400 saying what is wrong."""
    sentences = list(model_input)
    if not sentences:
        raise MlflowException.invalid_parameter_value('no sentences: send {"inputs": ["a sentence", ...]}')
    if len(sentences) > MAX_SENTENCES:
        raise MlflowException.invalid_parameter_value(
            f"{len(sentences)} sentences, more than {MAX_SENTENCES} a request"
        )
    characters = sum(map(len, sentences))
    if characters > MAX_CHARACTERS:
        raise MlflowException.invalid_parameter_value(f"{characters} characters, more than {MAX_CHARACTERS} a request")
    return sentences


def _options(model_path: Path, vocab_path: Path) -> dict[str, Any]:
    """What save_model and log_model share: the model's code file, artifacts, example, code and
    requirements (the signature, a list of strings in and out, comes from predict's type hints)."""
    from importlib.metadata import version

    from transformer.serving import served  # the file MLflow runs, imported so that it is a dependency

    package = Path(__file__).resolve().parents[1]  # all of `transformer`, which the model's code imports
    requirements = [
        f"{name}=={version(name)}" for name in ("torch", "mlflow", "sentencepiece", "spacy", "tqdm", "pandas")
    ]
    return {
        "python_model": served.__file__,
        "artifacts": {"model": str(model_path), "vocab": str(vocab_path)},
        "input_example": EXAMPLE,
        "code_paths": [str(package)],
        "pip_requirements": requirements,
    }


def save_model(model_path: Path, vocab_path: Path, out: Path) -> None:
    """The pyfunc model in a directory (`mlflow models serve -m <out>`)."""
    mlflow.pyfunc.save_model(str(out), **_options(model_path, vocab_path))


def log_model(model_path: Path, vocab_path: Path, run_id: str, registered_name: str) -> str:
    """Logs the pyfunc model to the training's MLflow run (a LoggedModel named "model") and
    registers a new version of `registered_name`; returns the model's URI. A version the run has
    registered from the same model and vocabulary files already is kept and its URI returned: an
    export killed after registering, then rerun, adds no second version of one model."""
    from mlflow import MlflowClient

    from transformer.io import sha256_file
    from transformer.tracking import prepare_store, tracking_uri

    uri = tracking_uri()
    prepare_store(uri)
    mlflow.set_tracking_uri(uri)
    files = {"model_sha256": sha256_file(model_path), "vocab_sha256": sha256_file(vocab_path)}
    for version in MlflowClient(uri).search_model_versions(f"name='{registered_name}' and run_id='{run_id}'"):
        if all(version.tags.get(k) == v for k, v in files.items()):
            return version.source
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(name="model", **_options(model_path, vocab_path))
    mlflow.register_model(info.model_uri, registered_name, tags=files)  # the version and its tags at once
    return info.model_uri


def promote(registered_name: str, version: int, alias: str) -> None:
    """Points `alias` (models:/<name>@<alias>) at a registered version."""
    from mlflow import MlflowClient

    from transformer.tracking import tracking_uri

    client = MlflowClient(tracking_uri())
    try:
        client.get_model_version(registered_name, str(version))
    except MlflowException:
        from transformer.errors import TrackingError

        raise TrackingError(f"model '{registered_name}' has no version {version} in {tracking_uri()}") from None
    client.set_registered_model_alias(registered_name, alias, str(version))
