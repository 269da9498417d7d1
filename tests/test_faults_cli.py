"""Faults through the command line: each stage, run as its command over a good output, exits 1 with
exactly one line `error: <file or key>: ...` on stderr, no traceback, the previous output
byte-identical and no temporary file left."""

from __future__ import annotations

import hashlib
import http.server
import resource
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, MlflowServer, run, tiny_params, write_toy_corpus

STAGES = ROOT / "stages"

pytestmark = pytest.mark.slow  # every test here runs the stages


def _commands() -> dict[str, list[str]]:
    """Each stage's command line, run in a directory of outputs laid out as dvc.yaml wires them."""
    p = ["--params", "params.yaml"]
    return {
        "download": ["download.py", *p, "--out", "raw"],
        "tokenize": ["tokenize_corpus.py", *p, "--raw", "raw", "--out", "tok", "--report", "tokenize.json"],
        "build_vocab": ["build_vocab.py", *p, "--tokenized", "tok", "--out", "vocab"],
        "train": [
            "train.py",
            *p,
            "--vocab",
            "vocab",
            "--tokenized",
            "tok",
            "--checkpoints",
            "ckpt",
            "--steps",
            "reports/train_steps.tsv",
            "--epochs",
            "reports/train_epochs.tsv",
            "--summary",
            "reports/train.json",
            "--references",
            "raw/val.en",
            "--no-track",
        ],
        "average_checkpoints": [
            "average_checkpoints.py",
            *p,
            "--checkpoints",
            "ckpt",
            "--out",
            "model/model.pt",
            "--no-track",
        ],
        "decode": [
            "decode.py",
            *p,
            "--model",
            "model/model.pt",
            "--vocab",
            "vocab",
            "--source",
            "tok/val.de",
            "--out",
            "translations/val.txt",
            "--report",
            "decode.json",
        ],
        "score": [
            "score.py",
            *p,
            "--translations",
            "translations",
            "--references",
            "raw",
            "--model",
            "model/model.pt",
            "--out",
            "scores.json",
            "--signatures",
            "signatures.json",
            "--table",
            "scores.md",
            "--evaluation",
            "evaluation.json",
            "--no-track",
        ],
        "figures": [
            "figures.py",
            *p,
            "--model",
            "model/model.pt",
            "--source",
            "tok/val.de",
            "--steps",
            "reports/train_steps.tsv",
            "--epochs",
            "reports/train_epochs.tsv",
            "--out",
            "figures",
            "--no-track",
        ],
        "report": [
            "report.py",
            *p,
            "--scores",
            "scores.json",
            "--signatures",
            "signatures.json",
            "--evaluation",
            "evaluation.json",
            "--model",
            "model/model.pt",
            "--timings",
            "timings",
            "--raw",
            "raw",
            "--translations",
            "translations",
            "--out",
            "reproduction.md",
            "--references",
            "reference",
            "--verdict",
            "verdict.json",
            "--no-track",
        ],
    }


def _stage(
    d: Path,
    name: str,
    check: bool = True,
    env: dict | None = None,
    file_limit: int | None = None,
    extra: list[str] = (),
) -> subprocess.CompletedProcess:
    script, *args = _commands()[name]
    cmd = [sys.executable, str(STAGES / script), *args, *extra]

    def limit_file_size():  # a write past the limit fails as a full disk would (EFBIG instead of ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    return run(cmd, d, check=check, env=env, preexec_fn=None if file_limit is None else limit_file_size)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """Every stage's output on a small toy corpus, made by the stage commands themselves."""
    d = tmp_path_factory.mktemp("good")
    write_toy_corpus(d / "toy", {"train": 300, "val": 20, "test2016": 20})
    params = tiny_params(**{"train.epochs": 2, "decode.testsets": ["val"]})
    (d / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for name in _commands():
        _stage(d, name, extra=["--timing", f"timings/{name}.json"] if name != "report" else [])
    return d


@pytest.fixture
def work(tmp_path, good) -> Path:
    """A private copy of the good outputs, for one fault to be tried on."""
    shutil.copytree(good, tmp_path / "w")
    return tmp_path / "w"


def _snapshot(d: Path) -> dict[str, str]:
    """sha256 of every file under d, hidden ones (temporary files) included."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def _assert_fails_cleanly(d: Path, stage: str, where: str | Path, **kwargs) -> str:
    """Runs the stage: exit 1, one `error: <where>: ...` line and nothing else, every file as it was."""
    before = _snapshot(d)
    result = _stage(d, stage, check=False, **kwargs)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}: "), result.stderr[-3000:]
    after = _snapshot(d)
    assert sorted(after.keys() - before.keys()) == [], "a failed stage left new files (temporary ones?)"
    assert after == before, "a failed stage changed its previous output"
    return lines[0]


def _edit_params(d: Path, section: str, key: str, value) -> None:
    params = yaml.safe_load((d / "params.yaml").read_text())
    params[section][key] = value
    (d / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _drop_last_line(path: Path) -> None:
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))


def test_download_with_an_unknown_params_key_names_the_key(work):
    _edit_params(work, "data", "corpuss", "toy")
    line = _assert_fails_cleanly(work, "download", "params.yaml")
    assert "'data.corpuss'" in line


def test_tokenize_of_a_misaligned_val_split_names_the_file(work):
    _drop_last_line(work / "raw" / "val.en")
    line = _assert_fails_cleanly(work, "tokenize", "raw/val.de")
    assert "has 20 lines" in line and "val.en has 19" in line


def test_tokenize_on_a_full_disk_names_the_output(work):
    _assert_fails_cleanly(work, "tokenize", "tok", file_limit=4096)  # train.de alone is larger


def test_build_vocab_of_a_misaligned_val_split_names_the_file(work):
    _drop_last_line(work / "tok" / "val.en")
    line = _assert_fails_cleanly(work, "build_vocab", "tok/val.de")
    assert "misaligned" in line


def test_train_with_a_model_shape_that_does_not_divide_names_the_key(work):
    _edit_params(work, "model", "h", 3)  # d_model 32 is not divisible by 3 heads
    line = _assert_fails_cleanly(work, "train", "params.yaml")
    assert "model.d_model" in line or "model.h" in line


def test_average_with_a_truncated_newest_checkpoint_names_it(work):
    newest = sorted((work / "ckpt").glob("ckpt_*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    line = _assert_fails_cleanly(work, "average_checkpoints", newest.relative_to(work))
    assert "truncated or corrupt" in line


def test_average_on_a_full_disk_keeps_the_previous_model(work):
    limit = (work / "model" / "model.pt").stat().st_size // 2
    _assert_fails_cleanly(work, "average_checkpoints", "model/model.pt", file_limit=limit)


def test_decode_with_a_vocabulary_from_another_run_names_it(work):
    from transformer.data.vocab import build_vocabs

    shutil.rmtree(work / "vocab")
    build_vocabs(work / "tok", work / "vocab", ("de", "en"), "bpe", 100, 1, "train", "val", seed=1)
    line = _assert_fails_cleanly(work, "decode", "vocab")
    assert "does not match" in line


def test_score_of_a_short_translation_names_the_file(work):
    _drop_last_line(work / "translations" / "val.txt")
    line = _assert_fails_cleanly(work, "score", "translations/val.txt")
    assert "has 19 lines" in line


def test_figures_from_a_torn_training_report_name_it(work):
    steps = work / "reports" / "train_steps.tsv"
    steps.write_text(steps.read_text() + "12\t0.5\n")
    _assert_fails_cleanly(work, "figures", "reports/train_steps.tsv")


def test_report_from_scores_that_are_not_json_names_them(work):
    (work / "scores.json").write_text('{"val": {"bleu": 1')
    _assert_fails_cleanly(work, "report", "scores.json")


class _DyingServer:
    """An `mlflow server` behind a loopback proxy that kills it on the first artifact upload. Train
    uploads artifacts only after its checkpoints and reports are written, so the server dies
    exactly then, whatever the timing; afterwards every call is refused, as by a dead server."""

    def __init__(self, directory: Path):
        self.upstream = MlflowServer(directory)
        self.died = threading.Event()
        self.proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.uri = f"http://127.0.0.1:{self.proxy.server_port}"
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()

    def kill(self) -> None:
        self.upstream.stop(signal.SIGKILL)

    def _die(self) -> None:
        self.died.set()
        self.kill()
        threading.Thread(target=lambda: (self.proxy.shutdown(), self.proxy.server_close()), daemon=True).start()

    def _handler(self):
        server = self

        class Forward(http.server.BaseHTTPRequestHandler):
            def forward(self):
                if "/mlflow-artifacts/" in self.path or server.died.is_set():
                    server._die()
                    self.close_connection = True  # no answer: the connection just drops
                    return
                length = int(self.headers.get("Content-Length") or 0)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                request = urllib.request.Request(
                    server.upstream.uri + self.path,
                    data=self.rfile.read(length) if length else None,
                    headers=headers,
                    method=self.command,
                )
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        status, reply, body = response.status, response.headers, response.read()
                except urllib.error.HTTPError as e:
                    status, reply, body = e.code, e.headers, e.read()
                self.send_response(status)
                for k, v in reply.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

            def log_message(self, *args):
                pass

        return Forward


def test_train_whose_tracking_server_dies_after_its_outputs_fails_in_one_line_and_keeps_them(tmp_path, good):
    from transformer import checkpoints

    work = tmp_path / "w"
    shutil.copytree(good, work, ignore=shutil.ignore_patterns("ckpt", "reports"))
    server = _DyingServer(tmp_path)
    try:
        env = {
            "MLFLOW_TRACKING_URI": server.uri,
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
        }
        script, *args = _commands()["train"]
        result = run(
            [sys.executable, str(STAGES / script), *[a for a in args if a != "--no-track"]], work, check=False, env=env
        )
    finally:
        server.kill()
    assert server.died.is_set(), "train never uploaded an artifact"
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: MLflow ({server.uri}): "), result.stderr[-3000:]
    # The outputs written before the server died are whole: the same as an untracked run's.
    kept, reference = (checkpoints.listed(d / "ckpt") for d in (work, good))
    assert [p.name for p in kept] == [p.name for p in reference]
    for mine, theirs in zip(kept, reference):
        a, b = checkpoints.load(mine)["model"], checkpoints.load(theirs)["model"]
        assert all(a[k].equal(b[k]) for k in b)
    assert (work / "reports/train_epochs.tsv").read_text() == (good / "reports/train_epochs.tsv").read_text()
    assert not [p for p in work.rglob(".*.tmp")]
