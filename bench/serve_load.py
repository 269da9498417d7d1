"""A bounded load test of the served model: `mlflow models serve` on loopback, concurrent clients,
a share of bad requests among the good ones.

Run from the repository root, with a pyfunc model (a directory, or any URI `mlflow models serve -m`
takes, such as models:/transformer-multi30k-de-en/1):

    python -m bench.serve_load --model <model> [--requests 2000] [--clients 1,8,32] [--bad 0.1] \\
        [--out reports/serve_load.json]

One server serves a round of `--requests` requests for each client count in turn. Each client keeps
one HTTP connection and sends its share of the round's requests one after another. A good request
holds one to four sentences and must come back 200 with one translation a sentence, the same each
time it is sent. A bad one (not JSON, not UTF-8, a number for a sentence, no sentences, too many, a
sentence longer than the model takes, 20,000 characters of it) must come back 4xx with one message
of at most MESSAGE_LIMIT characters that holds no 200 characters of the request. Each round reports
latency percentiles of each kind, requests and sentences translated a second, and the server's
resident memory (its processes together) at its start and end; it exits 1 if any request failed."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import click
import psutil

from transformer.serving.serving import MAX_SENTENCES, MESSAGE_LIMIT

SENTENCES = [
    "Ein Mann fährt Fahrrad.",
    "Zwei Hunde spielen im Schnee.",
    "Eine Frau liest ein Buch.",
    "Ein Kind läuft über die Straße.",
    "Drei Männer stehen vor einem Haus.",
    "Ein Hund springt in den See.",
    "Eine Gruppe von Menschen sitzt am Tisch.",
    "Ein Mädchen spielt Fußball.",
]
JUNK = "x" * 20_000  # no error may send this back whole
BAD = {  # name: body (bytes)
    "not JSON": b"{not json " + JUNK.encode(),
    "not UTF-8": b'{"inputs": ["\xff' + JUNK.encode() + b'"]}',
    "a number": json.dumps({"inputs": [3, JUNK]}).encode(),
    "no sentences": b'{"inputs": []}',
    "too many": json.dumps({"inputs": ["Ein Hund."] * (MAX_SENTENCES + 1)}).encode(),
    "too long": json.dumps({"inputs": [" ".join(["Hund"] * 10_000)]}).encode(),
}


@dataclass
class Answer:
    bad: str | None  # the bad request's kind; None for a good one
    ms: float
    problem: str | None  # why it failed; None if it passed


def _requests(n: int, bad_share: float, seed: int) -> list[tuple[str | None, bytes]]:
    rng = random.Random(seed)
    kinds = list(BAD)
    out = []
    for i in range(n):
        if rng.random() < bad_share:
            kind = kinds[i % len(kinds)]
            out.append((kind, BAD[kind]))
        else:
            out.append((None, json.dumps({"inputs": rng.sample(SENTENCES, rng.randint(1, 4))}).encode()))
    return out


def _check(kind: str | None, body: bytes, status: int, answer: bytes, seen: dict) -> str | None:
    """Why an answer is wrong, or None."""
    text = answer.decode("utf-8", "replace")
    if kind is None:
        if status != 200:
            return f"{status}: {text[:300]}"
        predictions = json.loads(text)["predictions"]
        if len(predictions) != len(json.loads(body)["inputs"]):
            return f"{len(predictions)} translations of {len(json.loads(body)['inputs'])} sentences"
        if seen.setdefault(body, predictions) != predictions:
            return "another translation than the first time"
        return None
    if not 400 <= status < 500:
        return f"{kind}: status {status}"
    try:
        message = json.loads(text)["message"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"{kind}: no JSON message: {text[:300]}"
    if len(message) > MESSAGE_LIMIT + 40 or "x" * 200 in text:
        return f"{kind}: the answer quotes the request ({len(text)} characters)"
    return None


def _client(port: int, work: list[tuple[str | None, bytes]], seen: dict, timeout: float) -> list[Answer]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    answers = []
    for kind, body in work:
        started = time.perf_counter()
        try:
            connection.request("POST", "/invocations", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            status, data = response.status, response.read()
            problem = _check(kind, body, status, data, seen)
        except (OSError, http.client.HTTPException) as e:
            connection.close()  # a new connection for the next request
            problem = f"{kind or 'good'}: {type(e).__name__}: {e}"
        answers.append(Answer(kind, (time.perf_counter() - started) * 1000, problem))
    connection.close()
    return answers


def _rss_mb(server: subprocess.Popen) -> float:
    """The resident memory of the server and every process it started (its workers), in MiB."""
    root = psutil.Process(server.pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return round(total / 2**20, 1)


def _percentiles(ms: list[float]) -> dict[str, float | None]:
    ranked = sorted(ms)

    def at(q: float) -> float | None:
        return round(ranked[min(len(ranked) - 1, int(q * len(ranked)))], 1) if ranked else None

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "max": round(ranked[-1], 1) if ranked else None}


def start_server(model: str, port: int, workers: int, log: Path) -> subprocess.Popen:
    """`mlflow models serve` on 127.0.0.1:port, in a session of its own; returns once /ping answers."""
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                *(str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", model),
                *("--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},  # uvicorn
        )
    deadline = time.monotonic() + 300
    while True:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise click.ClickException(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def load(port: int, server: subprocess.Popen, requests: list, clients: int, timeout: float) -> dict:
    """Sends `requests` over `clients` connections at once; the round's report."""
    seen: dict[bytes, list[str]] = {}
    _client(port, [(None, json.dumps({"inputs": SENTENCES}).encode())], seen, timeout)  # the first is slow
    rss_start = _rss_mb(server)
    sentences = sum(len(json.loads(body)["inputs"]) for kind, body in requests if kind is None)
    shares = [requests[i::clients] for i in range(clients)]
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [a for share in pool.map(lambda w: _client(port, w, seen, timeout), shares) for a in share]
    wall = time.perf_counter() - started
    good = [a for a in answers if a.bad is None]
    bad = [a for a in answers if a.bad is not None]
    problems = [a.problem for a in answers if a.problem]
    return {
        "requests": len(answers),
        "clients": clients,
        "good": len(good),
        "bad": len(bad),
        "good_failed": sum(a.problem is not None for a in good),
        "bad_failed": sum(a.problem is not None for a in bad),
        "problems": sorted(set(problems))[:20],
        "good_ms": _percentiles([a.ms for a in good]),
        "bad_ms": _percentiles([a.ms for a in bad]),
        "requests_per_s": round(len(answers) / wall, 1),
        "sentences_per_s": round(sentences / wall, 1),  # of the good requests
        "wall_s": round(wall, 1),
        "server_rss_mb": {"start": rss_start, "end": _rss_mb(server)},
    }


@click.command()
@click.option("--model", required=True, help="what `mlflow models serve -m` takes: a pyfunc directory, a models:/ URI")
@click.option("--requests", "n", default=2000, show_default=True, help="requests a round")
@click.option("--clients", default="8", show_default=True, help="concurrent connections; a round each: 1,8,32")
@click.option("--bad", "bad_share", default=0.1, show_default=True, help="share of bad requests")
@click.option("--workers", default=1, show_default=True, help="the server's worker processes")
@click.option("--seed", default=0, show_default=True)
@click.option("--timeout", default=120.0, show_default=True, help="seconds a client waits for an answer")
@click.option("--out", type=click.Path(path_type=Path), help="the report (JSON); printed either way")
def main(model: str, n: int, clients: str, bad_share: float, workers: int, seed: int, timeout: float, out: Path | None):
    from transformer.io import write_json

    counts = _counts(clients)
    port = _free_port()
    log = (out.parent if out else Path(tempfile.mkdtemp())) / "serve_load.log"  # the server's output
    log.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(model, port, workers, log)
    try:
        rounds = [load(port, server, _requests(n, bad_share, seed), count, timeout) for count in counts]
    finally:
        stop_server(server)
    report = {"model": model, "workers": workers, "seed": seed, "rounds": rounds}
    click.echo(json.dumps(report, indent=2))
    if out:
        write_json(out, report)
    if any(r["good_failed"] or r["bad_failed"] for r in rounds):
        sys.exit(1)


def _counts(clients: str) -> list[int]:
    try:
        counts = [int(c) for c in clients.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{clients!r}: expected client counts >= 1, such as 1,8,32", param_hint="--clients")
    return counts


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
