"""docs/using-a-model.md shows what its commands print: with the toy model at data/model/model.pt, each
command the page follows with its output, and each Python session it shows, prints exactly that."""

from __future__ import annotations

import json
import platform
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import BIN, ROOT, run, tiny_params, toy_vocab, train_options

PAGE = ROOT / "docs" / "using-a-model.md"
# torch's own kernels at the baseline x86 level and MKL's matmuls on its path for every x86 CPU: every host
# trains the toy model to the same bits and decodes it to the same scores, so one page holds for all. The
# GPU is hidden, as Translator.load and the command line would decode on it.
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}
HIDDEN_GPU = {"CUDA_VISIBLE_DEVICES": ""}
DOCTEST_OPTIONS = ["-o", "ELLIPSIS", "-o", "NORMALIZE_WHITESPACE"]
TIMING = re.compile(r"^transformer: done in [\d.]+ s\n", flags=re.M)  # the stage's last line, on stderr

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="MKL's portable path is x86's"),
]


def blocks(page: str) -> list[re.Match]:
    """The page's fenced code blocks, in order: their language and their text."""
    return list(re.finditer(r"^```(?P<lang>\w*)\n(?P<text>.*?)^```$", page, flags=re.S | re.M))


def examples(page: str) -> list[tuple[str, str]]:
    """The page's commands with their output: each ```sh block that a ```json or ```text block follows."""
    found = blocks(page)
    return [
        (command["text"], output["text"])
        for command, output in zip(found, found[1:])
        if command["lang"] == "sh"
        and output["lang"] in ("json", "text")
        and not page[command.end() : output.start()].strip()
    ]


def sessions(page: str) -> list[str]:
    """The page's Python sessions, its ```pycon blocks: statements after >>>, what they print below."""
    return [b["text"] for b in blocks(page) if b["lang"] == "pycon"]


def printed(result) -> str:
    """What a command shows on a terminal, stdout then stderr, without the time the stage took."""
    return result.stdout + TIMING.sub("", result.stderr)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A directory laid out as a trained project: the toy model (bench/toy.py's language, 20 epochs) at
    data/model/model.pt, its validation pairs at data/raw/val.de and val.en."""
    from transformer import checkpoints

    directory = tmp_path_factory.mktemp("project")
    vocab = toy_vocab(directory)
    params = directory / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(**{"train.epochs": 20})))
    train = [sys.executable, "stages/train.py", "--params", str(params), "--vocab", str(vocab)]
    run(
        [*train, *train_options(directory), "--references", str(directory / "toy/val.en"), "--no-track"],
        ROOT,
        env=PORTABLE,
    )
    model = directory / "data/model/model.pt"
    model.parent.mkdir(parents=True)
    checkpoints.save(model, checkpoints.average_checkpoints(directory / "ckpt", 2))
    (directory / "data/raw").mkdir()
    for side in ("de", "en"):
        shutil.copy(directory / f"toy/val.{side}", directory / f"data/raw/val.{side}")
    return directory


def test_the_page_shows_commands_with_their_outputs_and_python_sessions():
    page = PAGE.read_text(encoding="utf-8")
    assert len(examples(page)) >= 2 and len(sessions(page)) >= 1
    assert '"..."' not in page, "an output left as a placeholder"


def test_each_command_prints_the_output_the_page_shows(project):
    for command, shown in examples(PAGE.read_text(encoding="utf-8")):
        result = run(["bash", "-o", "pipefail", "-c", command], project, env=PORTABLE | HIDDEN_GPU)
        assert printed(result) == shown, f"`{command.strip()}` printed:\n{printed(result)}"


def test_each_python_session_prints_what_the_page_shows(project, tmp_path):
    """Run as doctest runs a session: floats shown to the digits the page gives (ELLIPSIS), and a long
    answer broken over lines (NORMALIZE_WHITESPACE)."""
    for i, session in enumerate(sessions(PAGE.read_text(encoding="utf-8"))):
        (tmp_path / f"session{i}.txt").write_text(session, encoding="utf-8")
        doctest = [sys.executable, "-m", "doctest", *DOCTEST_OPTIONS, str(tmp_path / f"session{i}.txt")]
        result = run(doctest, project, check=False, env=PORTABLE | HIDDEN_GPU)
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]


def test_the_served_answer_is_what_translate_prints_for_the_sentences_sent(project):
    """The page's answer of the server to its curl: the server answers what `transformer translate` prints
    (tests/test_serve.py holds it to that), so translate, fed the request's sentences, stands in for it."""
    page = PAGE.read_text(encoding="utf-8")
    (curl,) = [b["text"] for b in blocks(page) if b["lang"] == "sh" and b["text"].startswith("curl ")]
    words = shlex.split(curl.replace("\\\n", " "))
    sentences = json.loads(words[words.index("-d") + 1])["inputs"]
    (answer,) = [b["text"] for b in blocks(page) if b["lang"] == "json" and '"predictions"' in b["text"]]
    translate = [str(BIN / "transformer"), "translate", "--model", "data/model/model.pt"]
    result = run(translate, project, env=PORTABLE | HIDDEN_GPU, input_text="".join(s + "\n" for s in sentences))
    assert json.loads(answer) == {"predictions": result.stdout.splitlines()}
