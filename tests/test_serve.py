"""The MLflow pyfunc model: logged and registered from the training's run, and served over HTTP by
`mlflow models serve` with the same translations as `transformer translate`; a bad request gets the
status and message docs/using-a-model.md names, and a slow one is stopped at the request timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import BIN, ROOT, free_port, run, stop_group, tiny_model_file, tool_env, wait_for_http
from test_translate import SRC_LINES, TGT_LINES, never_ending, word_vocabs

from transformer.config import load_params
from transformer.data.vocab import BpeVocab, WordVocab, save_vocabs

SENTENCES = ["ein Hund läuft.", "eine Frau liest ein Buch"]


def _save_model(directory: Path, src, tgt, weights=None, **decode) -> tuple[Path, Path]:
    """A tiny untrained model file, `weights` applied to its weights and `decode` to its decode params
    (beam 2 unless said), and the vocab.pt it was built with."""
    save_vocabs(directory / "vocab", src, tgt)
    params = load_params(ROOT / "params.yaml").to_dict()
    params["decode"] |= {"beam": 2} | decode
    return tiny_model_file(directory / "model.pt", src, tgt, params, weights=weights), directory / "vocab" / "vocab.pt"


@pytest.fixture(scope="module")
def model_and_vocab(tmp_path_factory) -> tuple[Path, Path]:
    return _save_model(tmp_path_factory.mktemp("served"), *word_vocabs())


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> tuple[Path, Path]:
    """A model file and its pyfunc model, on one BPE vocabulary for both sides as the pipeline's, whose
    translations end only at the length bound (source + 2), one sentence a batch: SLOW takes far longer
    than the timeouts below."""
    from transformer.serving.serving import save_model

    bpe = BpeVocab.train(SRC_LINES + TGT_LINES, size=40, seed=0)  # 40 pieces: "Hund" is ▁ H u n d
    directory = tmp_path_factory.mktemp("slow")
    model, vocab = _save_model(directory, bpe, bpe, never_ending, max_len_extra=2, batch_tokens=2)
    save_model(model, vocab, directory / "pyfunc")
    return model, directory / "pyfunc"


@pytest.fixture(scope="module")
def pyfunc_dir(model_and_vocab, tmp_path_factory) -> Path:
    from transformer.serving.serving import save_model

    out = tmp_path_factory.mktemp("pyfunc") / "model"
    save_model(*model_and_vocab, out)
    return out


def test_pyfunc_model_translates_as_the_translator_does(pyfunc_dir, model_and_vocab, monkeypatch):
    import mlflow

    from transformer import Translator

    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")  # a server that unpickles nothing loads it
    loaded = mlflow.pyfunc.load_model(str(pyfunc_dir))
    assert loaded.predict(SENTENCES) == Translator.load(model_and_vocab[0], device="cpu").translate(SENTENCES)
    inputs = loaded.metadata.get_input_schema().input_types()
    assert [t.name for t in inputs] == ["string"]  # the signature: a column of strings
    for module in ("serving/serving.py", "serving/batcher.py", "decoding/translate.py", "model/model.py"):
        assert (pyfunc_dir / "code" / "transformer" / module).is_file(), module  # the model carries the package


def test_pyfunc_model_refuses_a_vocabulary_other_than_the_models(model_and_vocab, tmp_path):
    import mlflow

    from transformer.serving.serving import save_model

    other = tmp_path / "other"
    save_vocabs(other, WordVocab.build(SRC_LINES + ["eine Katze"], min_freq=1), WordVocab.build(TGT_LINES, min_freq=1))
    save_model(model_and_vocab[0], other / "vocab.pt", tmp_path / "model")
    with pytest.raises(Exception, match="does not match"):
        mlflow.pyfunc.load_model(str(tmp_path / "model"))


LONG_WORD = "Hund" * 25_000  # 100,000 characters, one word: 100,001 pieces
SLOW = [" ".join(["Hund"] * 10)] * 1000  # MAX_SENTENCES of 50 tokens, 53 decoding steps each


def _refusal(loaded, sentences: list[str]) -> tuple[int, str]:
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException) as e:
        loaded.predict(sentences)
    return e.value.get_http_status_code(), e.value.message


def test_pyfunc_model_counts_a_sentences_length_in_the_models_tokens(slow_model):
    import mlflow

    loaded = mlflow.pyfunc.load_model(str(slow_model[1]))
    assert _refusal(loaded, ["ein Kind", LONG_WORD]) == (
        400,
        "inputs[1]: 100001 tokens, more than the model takes (tokenize.max_len = 100)",
    )


def test_pyfunc_model_stops_translating_at_the_request_timeout(slow_model, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT", "1")
    loaded = mlflow.pyfunc.load_model(str(slow_model[1]))
    assert _refusal(loaded, SLOW) == (504, "translation stopped after 1 s (MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT)")


ECHO = "x" * 20_000  # a request's text that no error may send back whole
BAD_REQUESTS = (  # (body, status, what the message says): each quotes ECHO, or holds it
    ("{not json" + ECHO, 400, "Ensure that input is a valid JSON formatted string"),
    (json.dumps({"inputs": [ECHO]}).replace("x", "\xff", 1), 400, "Ensure that input is a valid JSON formatted string"),
    (json.dumps({"inputs": [3, ECHO]}), 400, "Expected type str, but got int"),
    (json.dumps({"inputs": [[ECHO]]}), 400, "Expected type str, but got list"),
    (json.dumps({"inputs": {"a": ECHO}}), 400, "Expected list, but got dict"),
    (json.dumps({"inputs": [ECHO] * 51}), 400, "1020000 characters, more than 1000000 a request"),
    (json.dumps({"inputs": ["Hund"] * 1000 + [ECHO]}), 400, "1001 sentences, more than 1000 a request"),
    (json.dumps({"inputs": [ECHO + " x" * 100]}), 400, "inputs[0]: 101 tokens, more than the model takes"),
)


def test_a_bad_requests_error_says_what_is_wrong_without_sending_the_request_back(pyfunc_dir):
    import mlflow
    from mlflow.pyfunc import scoring_server  # as the server does, before it loads the model
    from starlette.testclient import TestClient

    from transformer.serving.serving import MESSAGE_LIMIT

    client = TestClient(scoring_server.init(mlflow.pyfunc.load_model(str(pyfunc_dir))))
    for body, status, says in BAD_REQUESTS:
        data = body.encode("latin-1" if "\xff" in body else "utf-8")  # a byte that UTF-8 never begins with
        answer = client.post("/invocations", content=data, headers={"Content-Type": "application/json"})
        message = answer.json()["message"]
        assert (answer.status_code, says in message) == (status, True), (body[:40], message[:500])
        assert len(message) <= MESSAGE_LIMIT + 40 and "x" * 200 not in answer.text, (body[:40], len(answer.text))
    empty = client.post("/invocations", json={"inputs": []})
    assert empty.json()["message"] == 'no sentences: send {"inputs": ["a sentence", ...]}'  # the reason alone


def _post(port: int, body: str) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _message(answer: str) -> str:
    """An error answer's text: MLflow's JSON error's `message`, or the plain text of its timeout's 504."""
    try:
        return json.loads(answer)["message"]
    except json.JSONDecodeError:
        return answer


def _served(port: int, model: Path, timeout: int, log, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *(str(BIN / "mlflow"), "models", "serve", "-m", str(model), "--env-manager", "local"),
            *("--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--timeout", str(timeout)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=tool_env(MLFLOW_TRACKING_URI=f"sqlite:///{cwd}/mlflow.db"),
        start_new_session=True,
    )


@pytest.mark.slow
def test_served_model_answers_as_the_cli_and_each_bad_request_with_the_documented_status_and_message(
    slow_model, tmp_path
):
    port, log_path = free_port(), tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = _served(port, slow_model[1], timeout=5, log=log, cwd=tmp_path)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/ping", server, log_path.read_text)
        status, answer = _post(port, json.dumps({"inputs": SENTENCES}))
        cli = run(
            [str(BIN / "transformer"), "translate", "--model", str(slow_model[0])],
            tmp_path,
            input_text="\n".join(SENTENCES) + "\n",
        )
        assert status == 200, answer
        assert json.loads(answer)["predictions"] == cli.stdout.splitlines()
        for bad, expected in (
            ("{not json", (400, "Ensure that input is a valid JSON formatted string")),
            (json.dumps({"inputs": []}), (400, 'no sentences: send {"inputs": ["a sentence", ...]}')),
            (json.dumps({"inputs": [3, 4]}), (400, "Expected type str, but got int")),
            (json.dumps({"inputs": ["Hund"] * 1001}), (400, "1001 sentences, more than 1000 a request")),
            (json.dumps({"inputs": ["a" * 1_000_001]}), (400, "1000001 characters, more than 1000000 a request")),
            (
                json.dumps({"inputs": [LONG_WORD]}),
                (400, "inputs[0]: 100001 tokens, more than the model takes (tokenize.max_len = 100)"),
            ),
            (json.dumps({"inputs": SLOW}), (504, "Request processing time exceeded limit")),
        ):
            status, answer = _post(port, bad)
            assert status == expected[0] and expected[1] in _message(answer), (bad[:40], status, answer[:500])
        stopped, waited = "translation stopped after 5 s (MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT)", time.monotonic()
        while stopped not in log_path.read_text() and time.monotonic() < waited + 30:
            time.sleep(0.2)
        assert stopped in log_path.read_text(), "the worker went on translating after its 504"
        status, answer = _post(port, json.dumps({"inputs": SENTENCES[:1]}))  # still up, and free again
        assert (status, json.loads(answer)) == (200, {"predictions": cli.stdout.splitlines()[:1]})
    finally:
        stop_group(server)


@pytest.mark.slow
def test_under_load_every_good_request_is_translated_and_every_bad_one_refused_cleanly(model_and_vocab, tmp_path):
    """bench/serve_load.py, short: rounds of 120 requests from 1, 8 and 32 clients at once, a tenth of
    them bad, to a model whose translations end two tokens past the source (an untrained one runs to
    its length bound)."""
    from transformer.data.vocab import load_vocabs
    from transformer.serving.serving import save_model

    src, tgt = load_vocabs(model_and_vocab[1].parent)
    model, vocab = _save_model(tmp_path, src, tgt, max_len_extra=2)
    save_model(model, vocab, tmp_path / "pyfunc")
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "bench.serve_load", "--model", str(tmp_path / "pyfunc"), "--requests", "120"]
    run([*cmd, "--clients", "1,8,32", "--out", str(out)], ROOT, timeout=900)
    rounds = json.loads(out.read_text())["rounds"]
    assert [(r["requests"], r["clients"]) for r in rounds] == [(120, 1), (120, 8), (120, 32)], rounds
    for r in rounds:
        assert r["good_failed"] == r["bad_failed"] == 0 and r["bad"] >= 6, r["problems"]
        assert r["sentences_per_s"] > r["requests_per_s"] * (r["good"] / r["requests"]), r  # 1 to 4 a request
        assert min(r["server_rss_mb"].values()) > 100  # MiB: torch alone takes more


def test_an_export_rerun_after_registering_adds_no_second_version_of_the_same_model(model_and_vocab, tmp_path):
    """An export killed after registering the model, then rerun, logs nothing new; another model file does."""
    import mlflow
    from mlflow import MlflowClient

    from transformer.serving.serving import log_model

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", store)
        mlflow.set_tracking_uri(store)
        run_id = MlflowClient(store).create_run(MlflowClient(store).create_experiment("toy")).info.run_id
        model, vocab = model_and_vocab
        first, again = (log_model(model, vocab, run_id, "toy-model") for _ in range(2))
        other = tmp_path / "other.pt"
        other.write_bytes(model.read_bytes() + b"\n")  # another file, as a changed average gives
        log_model(other, vocab, run_id, "toy-model")
        versions = MlflowClient(store).search_model_versions("name='toy-model'")
    assert again == first and sorted(int(v.version) for v in versions) == [1, 2]
    assert {v.run_id for v in versions} == {run_id}


GOOD_REQUESTS = [
    ["zwei Männer spielen Fußball", "ein Kind"],
    ["eine Frau liest ein Buch", "ein Hund", "Buch"],
    ["Kind"],
]
TOO_LONG = [" ".join(["Hund"] * 101)]  # tokenize.max_len is 100


def _held(served, requests: int) -> list[list[str]]:
    """Holds the served model's first search until `requests` more requests wait behind it, and
    records the (tokenized) lines of every search."""
    searches, search = [], served.batcher.translate

    def held(lines: list[str], timeout: float) -> list[str]:
        searches.append(lines)
        until = time.monotonic() + 120
        while len(searches) == 1 and served.batcher.waiting < requests:
            assert time.monotonic() < until, f"{served.batcher.waiting} requests wait, not {requests}"
            time.sleep(0.01)
        return search(lines, timeout)

    served.batcher.translate = held
    return searches


@pytest.mark.parametrize("beam", [2, 1])
def test_concurrent_requests_share_a_search_and_each_gets_what_the_translator_gives_it_alone(
    beam, model_and_vocab, tmp_path
):
    import mlflow
    from mlflow.exceptions import MlflowException

    from transformer import Translator
    from transformer.data.vocab import load_vocabs
    from transformer.serving.serving import save_model

    model, vocab = _save_model(tmp_path, *load_vocabs(model_and_vocab[1].parent), beam=beam)
    save_model(model, vocab, tmp_path / "pyfunc")
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "pyfunc"))
    searches = _held(loaded.unwrap_python_model(), requests=len(GOOD_REQUESTS))
    with ThreadPoolExecutor(len(GOOD_REQUESTS) + 2) as pool:
        first = pool.submit(loaded.predict, SENTENCES)
        while not searches:
            time.sleep(0.01)
        answers = [pool.submit(loaded.predict, lines) for lines in (*GOOD_REQUESTS, TOO_LONG)]
        with pytest.raises(MlflowException, match=r"inputs\[0\]: 101 tokens") as refused:
            answers.pop().result()  # a bad request among good ones fails alone, before any search
        answers = [first.result(), *(a.result() for a in answers)]
    translator = Translator.load(model, device="cpu")
    assert answers == [translator.translate(lines) for lines in (SENTENCES, *GOOD_REQUESTS)]
    together = [line for lines in GOOD_REQUESTS for line in lines]
    assert searches == [translator.tokenize(SENTENCES), translator.tokenize(together)]
    assert refused.value.get_http_status_code() == 400


def test_a_failed_search_fails_its_requests_with_a_server_error_and_the_next_requests_are_served(pyfunc_dir):
    import mlflow
    from mlflow.exceptions import MlflowException

    loaded = mlflow.pyfunc.load_model(str(pyfunc_dir))
    served = loaded.unwrap_python_model()
    searches, search = _held(served, requests=len(GOOD_REQUESTS)), served.batcher.translate

    def failing_second(lines: list[str], timeout: float) -> list[str]:
        found = search(lines, timeout)  # records, and holds the first search until the others wait
        if len(searches) == 2:
            raise RuntimeError("out of memory")
        return found

    served.batcher.translate = failing_second
    with ThreadPoolExecutor(len(GOOD_REQUESTS) + 1) as pool:
        first = pool.submit(loaded.predict, SENTENCES[:1])
        while not searches:
            time.sleep(0.01)
        failed = [pool.submit(loaded.predict, lines) for lines in GOOD_REQUESTS]
        assert len(first.result()) == 1
        for answer in failed:
            with pytest.raises(MlflowException, match="translation failed: RuntimeError: out of memory") as error:
                answer.result()
            assert error.value.get_http_status_code() == 500
    assert len(searches) == 2
    assert loaded.predict(SENTENCES) == mlflow.pyfunc.load_model(str(pyfunc_dir)).predict(SENTENCES)


def test_a_lone_request_is_not_held_for_the_window_and_a_bad_setting_is_named(pyfunc_dir, monkeypatch):
    import mlflow

    monkeypatch.setenv("TRANSFORMER_SERVE_WINDOW_MS", "60000")
    loaded = mlflow.pyfunc.load_model(str(pyfunc_dir))
    started = time.monotonic()
    loaded.predict(SENTENCES)
    assert time.monotonic() - started < 10  # a window's wait would be 60 s
    monkeypatch.setenv("TRANSFORMER_SERVE_BATCH_TOKENS", "0")
    with pytest.raises(ValueError, match="TRANSFORMER_SERVE_BATCH_TOKENS = '0': expected a whole number >= 1"):
        mlflow.pyfunc.load_model(str(pyfunc_dir))


@pytest.mark.slow
def test_in_the_server_every_admitted_request_reaches_predict_at_once(tmp_path):
    """MLflow's server runs predict through asyncio.to_thread, whose default pool (cores + 4 threads)
    would hold all but a few concurrent requests back from the batcher. The model here answers only
    when ADMITTED requests are inside predict together."""
    import mlflow
    from served_barrier import PARTIES

    from transformer.serving.serving import ADMITTED

    mlflow.pyfunc.save_model(tmp_path / "barrier", python_model=str(Path(__file__).with_name("served_barrier.py")))
    port, log_path = free_port(), tmp_path / "serve.log"
    with log_path.open("w") as log, pytest.MonkeyPatch.context() as env:
        env.setenv(PARTIES, str(ADMITTED))
        server = _served(port, tmp_path / "barrier", timeout=60, log=log, cwd=tmp_path)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/ping", server, log_path.read_text)
        with ThreadPoolExecutor(ADMITTED) as pool:
            answers = list(pool.map(lambda i: _post(port, json.dumps({"inputs": [str(i)]})), range(ADMITTED)))
    finally:
        stop_group(server)
    assert answers == [(200, json.dumps({"predictions": [str(i)]})) for i in range(ADMITTED)], answers[:3]
