"""Shared fixtures: the toy project (bench/toy.py), tiny models, a vocabulary directory, MLflow servers."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench.toy import (  # noqa: F401  (the toy project's helpers, imported by the tests from here)
    BIN,
    DVC,
    LEXICON,
    ROOT,
    SRC_WORDS,
    TINY_PARAMS,
    free_port,
    mlflow_client,
    project_copy,
    run,
    same_values,
    tiny_params,
    tool_env,
    toy_pairs,
    write_toy_corpus,
)


class DataDependentOps(TorchDispatchMode):
    """Counts the ops whose result size or value the host must wait for on a GPU: nonzero, masked
    selection, boolean indexing and reading a scalar back."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        indices = args[1] if name.startswith("index.") and len(args) > 1 else ()
        boolean = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
        if boolean or name.split(".")[0] in ("nonzero", "masked_select", "_local_scalar_dense", "item"):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """Counts the Python calls that read a tensor's values back to the host (.item(), .tolist(),
    .cpu(), .numpy(), bool(), int(), float(), index()): on an accelerator each waits for the device."""

    READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


# The tests' smallest model's sizes (a bench.Size takes these four); tiny_config adds the rest.
TINY_SIZES = {"N": 1, "d_model": 16, "d_ff": 32, "h": 2}


def tiny_config(src_vocab: int, tgt_vocab: int, **overrides) -> dict:
    """The tests' smallest model as a model file's model_config; `overrides` name what else differs."""
    from transformer.data.vocab import PAD

    rest = {"dropout": 0.0, "norm": "pre", "tie_embeddings": False, "pad": PAD}
    return {"src_vocab": src_vocab, "tgt_vocab": tgt_vocab} | TINY_SIZES | rest | overrides


def tiny_model(**args):
    """make_model with tiny_config's sizes; `args` name the vocabularies and what else differs."""
    from transformer.model.model import make_model

    return make_model(**tiny_config(**args))


def tiny_model_file(path: Path, src, tgt, params: dict | None = None, seed: int = 0, weights=None, **overrides) -> Path:
    """A tiny untrained model (tiny_config with `overrides`, drawn after seeding `seed`) saved at `path` as
    average_checkpoints saves one: its weights (through `weights` where given), model_config, `params` (else
    params.yaml's), the vocabularies `src` and `tgt`, step 1."""
    from transformer import checkpoints
    from transformer.config import load_params

    config = tiny_config(len(src), len(tgt), **overrides)
    torch.manual_seed(seed)
    state = tiny_model(**config).state_dict()
    checkpoints.save(
        path,
        {
            "model": weights(state) if weights else state,
            "model_config": config,
            "params": params or load_params(ROOT / "params.yaml").to_dict(),
            "vocab": {"src": src.state(), "tgt": tgt.state()},
            "step": 1,
        },
    )
    return path


def wait_for_http(url: str, process: subprocess.Popen, log: Callable[[], str], seconds: float = 240) -> None:
    """Polls `url` until it answers 200. Fails at once, with the tail of `log()`, if `process` exits, and
    after `seconds`: a hang guard, since a server imports slowly on a loaded machine."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert process.poll() is None, f"{process.args[0]} exited {process.returncode}:\n{log()[-3000:]}"
        assert time.monotonic() < deadline, f"{url} did not answer within {seconds} s"
        time.sleep(0.2)


class MlflowServer:
    """`mlflow server` on a free loopback port, run in `directory`: a SQLite store there, and artifacts served
    (uploaded through the server) into `directory`/server-artifacts. Its output goes to mlflow-server.log."""

    def __init__(self, directory: Path):
        port = free_port()
        self.uri = f"http://127.0.0.1:{port}"
        self.artifacts = directory / "server-artifacts"
        log = directory / "mlflow-server.log"
        self._log = open(log, "w")
        self.process = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{directory / 'server.db'}",
                "--serve-artifacts",
                "--artifacts-destination",
                str(self.artifacts),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=directory,
            env=tool_env(),
        )
        try:
            wait_for_http(f"{self.uri}/health", self.process, log.read_text)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_group(self.process, sig)
        self._log.close()


def stop_group(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Sends `sig` to a process started with `start_new_session=True` and to everything it started (a
    server's workers); SIGKILL follows if they outlive 15 s."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(15)


def train_outputs(directory: Path):
    """Training's outputs under `directory`: checkpoints in ckpt/, the reports in reports/."""
    from transformer.training.train import Outputs

    reports = directory / "reports"
    return Outputs(
        directory / "ckpt", reports / "train_steps.tsv", reports / "train_epochs.tsv", reports / "train.json"
    )


def train_options(directory: Path) -> list[str]:
    """stages/train.py's output options for train_outputs(directory)."""
    out = train_outputs(directory)
    return [
        "--checkpoints",
        str(out.checkpoints),
        "--steps",
        str(out.steps),
        "--epochs",
        str(out.epochs),
        "--summary",
        str(out.summary),
    ]


def toy_vocab(directory: Path, train: int = 600) -> Path:
    """A toy corpus under `directory` (`train` pairs, 40 to validate on), tokenized and turned into a BPE
    vocabulary with token-id arrays: the vocabulary's directory, `directory`/vocab."""
    from transformer.data.tokenize import tokenize_corpus
    from transformer.data.vocab import build_vocabs

    raw = write_toy_corpus(directory / "toy", {"train": train, "val": 40}).parent
    tokenize_corpus(raw, directory / "tok", ["train", "val"], ("de", "en"), "train", 100)
    build_vocabs(directory / "tok", directory / "vocab", ("de", "en"), "bpe", 120, 1, "train", "val", seed=1)
    return directory / "vocab"


@pytest.fixture
def vocab_dir(tmp_path: Path) -> Path:
    return toy_vocab(tmp_path)


def tgz(path: Path, members: dict[str, str]) -> None:
    """A gzipped tar at path holding each member name with its text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def mlflow_runs(repo: Path, name: str = "toy-de-en") -> dict[str, object]:
    """run id -> run, every run of an MLflow experiment in the repo's mlflow.db."""
    client = mlflow_client(repo)
    (experiment,) = [e for e in client.search_experiments() if e.name == name]
    return {r.info.run_id: r for r in client.search_runs([experiment.experiment_id])}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models spend their time waking threads: one is faster, and the same on any machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The fault and bad-input suite: each category lists the tests (file::name prefixes) that
# prove a clear error, a non-zero exit or no partial output for one kind of fault.
FAULTS = {
    "1 params": [
        "test_config.py::test_unknown_",
        "test_config.py::test_missing_section",
        "test_config.py::test_missing_key",
        "test_config.py::test_empty_section",
        "test_config.py::test_wrong_type",
        "test_config.py::test_d_model_not_divisible",
        "test_config.py::test_out_of_range",
        "test_config.py::test_nan",
        "test_config.py::test_yaml_syntax",
        "test_config.py::test_error_from_a_file",
        "test_scale_out.py::test_params_that_become_path_components",
    ],
    "2 download": [
        "test_download.py::test_checksum_mismatch",
        "test_download.py::test_truncated_gzip",
        "test_download.py::test_file_missing_from_mirror",
        "test_download.py::test_archive_with_",
        "test_download.py::test_failure_keeps",
        "test_download.py::test_a_network_error",
        "test_download.py::test_a_redirect_from_https",
        "test_pipeline.py::test_download_stage",
        "test_scale_out.py::test_gzip_bomb",
        "test_scale_out.py::test_archive_member_beyond",
        "test_scale_out.py::test_plain_http",
        "test_scale_out.py::test_registry_names",
    ],
    "3 corpus": [
        "test_tokenize.py::test_misaligned",
        "test_tokenize.py::test_non_utf8",
        "test_tokenize.py::test_empty_",
        "test_tokenize.py::test_train_split_with_nothing",
        "test_download.py::test_non_utf8",
        "test_download.py::test_lines_split_only_at_newlines",
    ],
    "4 vocabulary": ["test_translate.py::test_other_vocabulary", "test_translate.py::test_weights_that_do_not_fit"],
    "5 checkpoint": [
        "test_checkpoints.py::test_truncated",
        "test_checkpoints.py::test_checkpoint_with_code",
        "test_checkpoints.py::test_checkpoint_lacking_keys",
        "test_checkpoints.py::test_file_that_is_not",
        "test_scale_out.py::test_model_file_config_is_bounded",
    ],
    "6 training": [
        "test_train.py::test_diverging",
        "test_checkpoints.py::test_failed_save",
        "test_resume.py::test_a_launch_of_another_world_size",
        "test_writer.py::test_a_failed_background_write",
    ],
    "7 tracking": ["test_train.py::test_unreachable_tracking"],
    "8 interruptions": [
        "test_train.py::test_killed_training",
        "test_interruptions.py::test_decode_killed",
        "test_pipeline.py::test_repro_killed",
        "test_io.py::test_a_second_run_killed",
        "test_writer.py::test_a_kill_during",
    ],
    "9 ddp": [
        "test_interruptions.py::test_dead_ddp_worker",
        "test_interruptions.py::test_a_killed_launcher",
        "test_scale_out.py::test_two_ranks_with_dropout_resume",
        "test_scale_out.py::test_two_nodes_without_a_shared_disk",
        "test_scale_out.py::test_nodes_with_other_params",
    ],
    "10 command line": ["test_faults_cli.py::"],
}
_fault_results: dict[str, dict[str, str]] = {}  # category -> {test: outcome}


def _fault_category(nodeid: str) -> str | None:
    name = nodeid.split("tests/", 1)[-1]
    return next((c for c, prefixes in FAULTS.items() if any(name.startswith(p) for p in prefixes)), None)


def pytest_runtest_logreport(report):
    """One outcome per test: its call's, or its setup's where that failed or skipped it (a failed
    teardown fails it too)."""
    category = _fault_category(report.nodeid)
    if category and (report.when == "call" or not report.passed):
        outcomes = _fault_results.setdefault(category, {})
        if report.failed or report.nodeid not in outcomes:
            outcomes[report.nodeid] = report.outcome


def fault_summary(outcomes: dict[str, str]) -> str:
    counts = {k: list(outcomes.values()).count(k) for k in ("passed", "failed", "skipped")}
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n or k != "skipped")


def pytest_terminal_summary(terminalreporter):
    if not _fault_results:
        return
    terminalreporter.section("fault and bad-input suite")
    for category in FAULTS:
        if _fault_results.get(category):
            terminalreporter.write_line(f"{category}: {fault_summary(_fault_results[category])}")


def write_params(directory: Path, **overrides) -> Path:
    """tiny_params with `overrides` as directory/params.yaml."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump(tiny_params(**overrides)))
    return path


def torchrun(nnodes: int, nproc: int, node_rank: int = 0, port: int | None = None) -> list[str]:
    """torchrun's command line; with `port`, node `node_rank` of torchrun's static rendezvous, which
    node 0 hosts on 127.0.0.1:port, as docs/scale.md has nodes meet (node ranks as given, whichever
    node starts first)."""
    cmd = [str(BIN / "torchrun"), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    if port is not None:
        cmd += ["--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return cmd


def train_cmd(params: Path, vocab: Path, out: Path, track: bool = False) -> list[str]:
    """stages/train.py's arguments for a vocab_dir-style toy corpus, outputs under `out`, tracked or not."""
    return [
        "stages/train.py",
        "--params",
        str(params),
        "--vocab",
        str(vocab),
        *train_options(out),
        "--references",
        str(vocab.parent / "toy" / "val.en"),
        "--track" if track else "--no-track",
    ]
