"""The MLflow pyfunc model: logged and registered from the training's run, and served over HTTP by
`mlflow models serve` with the same translations as `transformer translate`; bad requests get a 400."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import BIN, ROOT, free_port, run, stop_group, tool_env, wait_for_http

from transformer import checkpoints
from transformer.config import load_params
from transformer.model import make_model
from transformer.vocab import PAD, WordVocab, save_vocabs

SRC_LINES = ["ein Hund läuft", "zwei Männer spielen Fußball", "eine Frau liest ein Buch", "ein Kind"]
TGT_LINES = ["a dog runs", "two men play football", "a woman reads a book", "a child"]
SENTENCES = ["ein Hund läuft.", "eine Frau liest ein Buch"]


@pytest.fixture(scope="module")
def model_and_vocab(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny untrained model file and the vocab.pt it was built with."""
    src, tgt = WordVocab.build(SRC_LINES, min_freq=1), WordVocab.build(TGT_LINES, min_freq=1)
    config = {
        "src_vocab": len(src),
        "tgt_vocab": len(tgt),
        "N": 1,
        "d_model": 16,
        "d_ff": 32,
        "h": 2,
        "dropout": 0.0,
        "norm": "pre",
        "tie_embeddings": False,
        "pad": PAD,
    }
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("served")
    save_vocabs(directory / "vocab", src, tgt)
    checkpoints.save(
        directory / "model.pt",
        {
            "model": make_model(**config).state_dict(),
            "model_config": config,
            "params": load_params(ROOT / "params.yaml").to_dict()
            | {"decode": load_params(ROOT / "params.yaml").to_dict()["decode"] | {"beam": 2}},
            "vocab": {"src": src.state(), "tgt": tgt.state()},
            "step": 1,
        },
    )
    return directory / "model.pt", directory / "vocab" / "vocab.pt"


@pytest.fixture(scope="module")
def pyfunc_dir(model_and_vocab, tmp_path_factory) -> Path:
    from transformer.serving import save_model

    out = tmp_path_factory.mktemp("pyfunc") / "model"
    save_model(*model_and_vocab, out)
    return out


def test_pyfunc_model_translates_as_the_translator_does(pyfunc_dir, model_and_vocab):
    import mlflow

    from transformer import Translator

    loaded = mlflow.pyfunc.load_model(str(pyfunc_dir))
    assert loaded.predict(SENTENCES) == Translator.load(model_and_vocab[0], device="cpu").translate(SENTENCES)
    inputs = loaded.metadata.get_input_schema().input_types()
    assert [t.name for t in inputs] == ["string"]  # the signature: a column of strings


def test_pyfunc_model_refuses_a_vocabulary_other_than_the_models(model_and_vocab, tmp_path):
    import mlflow

    from transformer.serving import save_model

    other = tmp_path / "other"
    save_vocabs(other, WordVocab.build(SRC_LINES + ["eine Katze"], min_freq=1), WordVocab.build(TGT_LINES, min_freq=1))
    save_model(model_and_vocab[0], other / "vocab.pt", tmp_path / "model")
    with pytest.raises(Exception, match="does not match"):
        mlflow.pyfunc.load_model(str(tmp_path / "model"))


def _post(port: int, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.slow
def test_served_model_answers_with_the_clis_translations_and_400_for_bad_requests(
    pyfunc_dir, model_and_vocab, tmp_path
):
    port = free_port()
    env = tool_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "models",
            "serve",
            "-m",
            str(pyfunc_dir),
            "--env-manager",
            "local",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/ping", server, lambda: server.stdout.read())
        status, body = _post(port, json.dumps({"inputs": SENTENCES}).encode())
        cli = run(
            [str(BIN / "transformer"), "translate", "--model", str(model_and_vocab[0])],
            tmp_path,
            input_text="\n".join(SENTENCES) + "\n",
        )
        assert status == 200, body
        assert body["predictions"] == cli.stdout.splitlines()
        for bad, why in (
            (json.dumps({"inputs": []}), "no sentences"),
            (json.dumps({"inputs": [3, 4]}), "Expected type str"),
            (json.dumps({"inputs": [" ".join(["Hund"] * 500)]}), "more than the model was trained on"),
            (json.dumps({"inputs": ["Hund"] * 1001}), "more than 1000"),
            ("{not json", ""),
        ):
            status, body = _post(port, bad.encode())
            assert 400 <= status < 500, (bad[:40], status, body)
            assert why in body.get("message", ""), body
        assert _post(port, json.dumps({"inputs": SENTENCES[:1]}).encode()) == (200, {"predictions": body_first(cli)})
    finally:
        stop_group(server)


def body_first(cli: subprocess.CompletedProcess) -> list[str]:
    return cli.stdout.splitlines()[:1]  # the server is still up after bad requests
