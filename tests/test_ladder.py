"""The ladder from the Annotated Transformer's recipe to the default (docs/ladder.yaml, docs/tools/ladder.py):
its steps start at the preset and end at the default, run last first in the workspace, and compare each
step with the one before."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import DVC, ROOT, run, tiny_model_file

from transformer.data.vocab import SPECIALS, WordVocab
from transformer.errors import ConfigError
from transformer.evaluation.compare import compare, stage_output
from transformer.presets import delta

sys.path.insert(0, str(ROOT / "docs" / "tools"))
import ladder  # noqa: E402

SPEC = yaml.safe_load((ROOT / ladder.SPEC).read_text())


def test_the_ladder_starts_at_the_preset_and_ends_at_the_default():
    found = ladder.steps()
    preset = {f"{s}.{k}": v for s, keys in delta(SPEC["preset"], ROOT).items() for k, v in keys.items()}
    assert found[0]["overrides"] == {key: v for key, v in preset.items() if key.split(".")[0] not in SPEC["names"]}
    assert found[-1]["overrides"] == {} and [step["name"] for step in found] == [f"ladder-{k}" for k in range(7)]
    for before, after, step in zip(found, found[1:], SPEC["steps"][1:]):
        assert set(before["overrides"]) - set(after["overrides"]) == set(step["to_default"])
    assert ladder.options(found[1]["overrides"])[:4] == ["-S", "vocab.kind=word", "-S", "model.tie_embeddings=false"]


def _project(tmp_path: Path, steps: list[dict]) -> Path:
    """A root holding the preset and a ladder of `steps`."""
    (tmp_path / "params").mkdir()
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "params" / f"{SPEC['preset']}.yaml", tmp_path / "params")
    (tmp_path / ladder.SPEC).write_text(yaml.safe_dump(SPEC | {"steps": steps}))
    return tmp_path


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda steps: steps[1]["to_default"].append("model.N"), "step 1 sets model.N back, which the preset or an"),
        (lambda steps: steps[2]["to_default"].append("model.norm"), "step 2 sets model.norm back"),
        (lambda steps: steps.pop(), "the last step is not the default: decode.beam, decode.alpha still differ"),
    ],
)
def test_a_ladder_that_does_not_lead_from_the_preset_to_the_default_is_refused(tmp_path, change, message):
    steps = [dict(step, to_default=list(step["to_default"])) for step in SPEC["steps"]]
    change(steps)
    with pytest.raises(ConfigError, match=f"docs/ladder.yaml: {message}"):
        ladder.steps(_project(tmp_path, steps))


def test_run_goes_last_first_and_puts_params_yaml_back_after_each_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("the default\n")
    seen = []

    def fake(argv, check=False):
        if argv[0] == "dvc":
            assert (tmp_path / "params.yaml").read_text() == "the default\n"  # each step starts from the default
            seen.append(argv[4:])
            (tmp_path / "params.yaml").write_text("set by -S\n")  # as dvc exp run -S leaves it
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(ladder.subprocess, "run", fake)
    result = CliRunner().invoke(ladder.main, ["run"])
    assert result.exit_code == 0, result.output
    found = ladder.steps()
    assert seen == [[step["name"], *ladder.options(step["overrides"])] for step in reversed(found)]
    assert (tmp_path / "params.yaml").read_text() == "the default\n"


def test_run_refuses_a_params_yaml_with_uncommitted_edits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ladder.subprocess, "run", lambda argv, check=False: subprocess.CompletedProcess(argv, 1))
    result = CliRunner().invoke(ladder.main, ["run"])
    assert result.exit_code == 2 and "params.yaml differs from the last commit" in result.output


def test_table_compares_each_step_with_the_one_before_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    words = "a man dog two women the child on bike in snow".split()
    refs = [" ".join(rng.choices(words, k=8)) for _ in range(30)]
    systems = []
    for k in range(7):  # each step keeps a few more of the reference's words
        lines = [" ".join(w if rng.random() < 0.4 + 0.08 * k else "cat" for w in r.split()) for r in refs]
        systems.append(tmp_path / f"step{k}.txt")
        systems[-1].write_text("".join(line + "\n" for line in lines))
    (tmp_path / "test2016.en").write_text("".join(r + "\n" for r in refs))
    (tmp_path / "test2016.de").write_text("".join(f"satz {i}\n" for i in range(len(refs))))
    vocab = WordVocab([*SPECIALS, "satz", *map(str, range(30)), *words])
    model = tiny_model_file(tmp_path / "model.pt", vocab, vocab)
    files = ["--sources", "test2016.de", "--refs", "test2016.en", "--model", str(model)]
    result = CliRunner().invoke(ladder.main, ["table", *map(str, systems), *files])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / ladder.RESULTS).read_text())
    # A few sentences, spread over the test set, as every step translates them.
    assert [row["line"] for row in written["examples"]] == [1, 7, 13, 19, 25]
    line = written["examples"][2]
    assert line["source"] == "satz 12" and line["reference"] == refs[12]
    assert line["translations"] == [s.read_text().splitlines()[12] for s in systems] and len(line["bleu"]) == 7
    # The last step's source attention as it writes the first of them: a distribution over the source a row.
    attention = written["attention"]
    assert attention["line"] == 1 and attention["source"] == ["satz", "0", "</s>"]
    assert attention["outputs"][-1] == "</s>" and len(attention["weights"]) == len(attention["outputs"])
    assert all(len(row) == 3 and sum(row) == pytest.approx(1, abs=1e-3) for row in attention["weights"])
    assert written["steps"] == ladder.steps() and written["testset"] == "test2016"
    rows = written["metrics"]["bleu"]["systems"]
    pair = compare(
        [("ladder-2", systems[2].read_text().splitlines()), ("ladder-3", systems[3].read_text().splitlines())],
        refs,
        "en",
        ("bleu",),
    )
    assert [row["system"] for row in rows] == [f"ladder-{k}" for k in range(7)] and rows[3] == pair["bleu"]["systems"][
        1
    ]
    short = CliRunner().invoke(ladder.main, ["table", *map(str, systems[:3]), *files])
    assert short.exit_code == 2 and "7 steps but 3 systems" in short.output
    (tmp_path / "test2016.de").write_text("satz\n")
    misaligned = CliRunner().invoke(ladder.main, ["table", *map(str, systems), *files])
    assert "test2016.de: has 1 lines, but test2016.en has 30" in str(misaligned.exception)


def test_the_committed_table_is_of_the_ladder_as_it_is_defined():
    committed = json.loads((ROOT / ladder.RESULTS).read_text())
    assert committed["steps"] == ladder.steps() and committed["testset"] == ladder.TESTSET
    assert [row["system"] for row in committed["metrics"]["bleu"]["systems"]] == [s["name"] for s in ladder.steps()]


def test_the_annotated_page_shows_the_committed_table():
    committed = json.loads((ROOT / ladder.RESULTS).read_text())
    page = (ROOT / "docs" / "annotated.md").read_text()
    for k, (step, row) in enumerate(zip(committed["steps"], committed["metrics"]["bleu"]["systems"])):
        assert f"{k}. {step['change']}\n   BLEU {row['score']:5.2f} {row['ci95']}" in page, step["name"]
    last = len(committed["steps"]) - 1
    for row in committed["examples"]:
        shown = f"  step {last}     {row['translations'][last]}  (sentence BLEU {row['bleu'][last]})"
        assert f"  source     {row['source']}\n" in page and shown in page, row["line"]
    attention = committed["attention"]
    assert f"greedy: {' '.join(attention['outputs'])}\n" in page
    assert f"Source attention of the last step's model, test2016 line {attention['line']}, greedy]" in page


def test_the_model_a_step_left_is_found_where_its_stage_writes_it():
    assert stage_output("average_checkpoints", ROOT / "dvc.yaml") == "data/model/model.pt"
    assert stage_output("decode", ROOT / "dvc.yaml", "val") == "data/translations/val.txt"


def test_a_file_is_fetched_as_the_experiment_left_it_not_as_the_workspace_holds_it(tmp_path):
    """The default of `table --model`: the last step's model from its experiment, through DVC's cache."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text("n: 1\n")
    make = "python -c \"import yaml; open('out.bin', 'wb').write(b'x' * yaml.safe_load(open('params.yaml'))['n'])\""
    stage = {"cmd": make, "params": ["n"], "outs": ["out.bin"]}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": stage}}))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["git", "init", "-q"], [DVC, "init", "-q"], ["git", "add", "-A"], [*git, "commit", "-qm", "start"]):
        run(cmd, repo)
    run([DVC, "exp", "run", "-n", "three", "-S", "n=3"], repo)
    (repo / "out.bin").write_bytes(b"changed since")
    fetched = ladder.fetched("out.bin", "three", tmp_path, root=repo)
    assert fetched.read_bytes() == b"xxx" and fetched.parent == tmp_path
