"""Presets are deltas from params.yaml, built into a whole params.yaml by `make preset`, which
also swaps the run records (dvc.lock, metrics, plots) of the recipe left and the recipe taken."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from click.testing import CliRunner
from conftest import BIN, ROOT, run

from transformer import presets
from transformer.config import ConfigError, params_from_dict

DEFAULT = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", presets.names(ROOT))
def test_every_preset_builds_a_valid_params_file_and_repeats_no_default(name):
    changes = presets.delta(name, ROOT)
    built = presets.recipe(name, ROOT)
    params_from_dict(built, source=name)
    repeated = [f"{s}.{k}" for s, keys in changes.items() for k, v in keys.items() if DEFAULT[s][k] == v]
    assert not repeated, f"params/{name}.yaml repeats the default's {', '.join(repeated)}"
    for section, keys in DEFAULT.items():
        for key, value in keys.items():
            assert built[section][key] == changes.get(section, {}).get(key, value), f"{section}.{key}"


@pytest.mark.parametrize("name", presets.names(ROOT))
def test_every_preset_key_says_why_on_its_line(name):
    lines = presets._key_lines(presets.preset_path(name, ROOT).read_text(encoding="utf-8"))
    bare = [f"{s}.{k}" for (s, k), line in lines.items() if "#" not in line]
    assert not bare, f"params/{name}.yaml: no comment on {', '.join(bare)}"


def test_the_default_preset_changes_nothing_and_every_params_key_has_a_comment():
    assert presets.delta(presets.DEFAULT, ROOT) == {}
    text = (ROOT / "params.yaml").read_text(encoding="utf-8")
    assert presets.build(text, presets.DEFAULT, ROOT) == text
    bare = [key for key, line in presets._key_lines(text).items() if "#" not in line]
    assert not bare, f"params.yaml: no comment on {bare}"


def test_a_preset_naming_an_unknown_key_or_an_unknown_preset_is_one_clear_error(tmp_path):
    shutil.copytree(ROOT / "params", tmp_path / "params")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "params/typo.yaml").write_text("# a typo\ntrain:\n  warmpu: 10  # meant warmup\n")
    with pytest.raises(ConfigError, match=r"params/typo.yaml: unknown key train\.warmpu"):
        presets.recipe("typo", tmp_path)
    (tmp_path / "params/bad.yaml").write_text("# out of range\ntrain:\n  warmup: -1  # negative\n")
    with pytest.raises(ConfigError, match=r"'train.warmup' = -1 must be > 0"):
        presets.recipe("bad", tmp_path)
    with pytest.raises(ConfigError, match="no such preset.*multi30k_en_de"):
        presets.recipe("multi30k_en_dee", tmp_path)


@pytest.fixture
def project(tmp_path):
    """A git + DVC repository with the pipeline, the presets, and a record of a default run."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copytree(ROOT / "params", repo / "params", ignore=shutil.ignore_patterns("runs"))
    run(["git", "init", "-q"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo)
    _record(repo, "de-en")
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.name=T", "-c", "user.email=t@e", "commit", "-qm", "default"], repo)
    return repo


def _record(repo, what: str) -> None:
    (repo / "dvc.lock").write_text(f"schema: '2.0'\n# {what}\n")
    (repo / "reports/train").mkdir(parents=True, exist_ok=True)
    (repo / "reports/scores.json").write_text(json.dumps({"test2016": {"bleu": what}}))
    (repo / "reports/train/train.json").write_text(json.dumps({"run": what}))
    (repo / "reports/reproduction.md").write_text("every recipe's sections\n")


def _switch(repo, *args: str):
    return CliRunner().invoke(presets.main, list(args), catch_exceptions=False)


def test_switching_presets_swaps_params_and_run_records_and_comes_back_byte_identical(project, monkeypatch):
    monkeypatch.chdir(project)
    default = (project / "params.yaml").read_bytes()
    result = _switch(project, "multi30k_en_de")
    assert result.exit_code == 0, result.output
    assert (project / "params.yaml").read_text().startswith("# preset: multi30k_en_de")
    assert params_from_dict(yaml.safe_load((project / "params.yaml").read_text())).data.src_lang == "en"
    kept = project / "params/runs/multi30k_de_en"
    assert json.loads((kept / "reports/scores.json").read_text())["test2016"]["bleu"] == "de-en"
    assert (kept / "dvc.lock").is_file() and (kept / "reports/train/train.json").is_file()
    assert not (project / "dvc.lock").exists() and not (project / "reports/scores.json").exists()
    assert (project / "reports/reproduction.md").is_file()  # every recipe's: never swapped

    _record(project, "en-de")  # the en→de run
    assert _switch(project, "annotated_transformer").exit_code == 0  # from a preset to another
    assert (project / "params.yaml").read_text().startswith("# preset: annotated_transformer")
    assert _switch(project, "multi30k_de_en").exit_code == 0
    assert (project / "params.yaml").read_bytes() == default
    assert json.loads((project / "reports/scores.json").read_text())["test2016"]["bleu"] == "de-en"
    assert "de-en" in (project / "dvc.lock").read_text()
    en_de = project / "params/runs/multi30k_en_de/reports/scores.json"
    assert json.loads(en_de.read_text())["test2016"]["bleu"] == "en-de"
    assert (
        subprocess.run(
            ["git", "status", "--porcelain", "dvc.lock", "reports", "params.yaml"],
            cwd=project,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        == ""
    )


def test_switching_refuses_to_drop_edits_to_params_unless_forced(project, monkeypatch):
    monkeypatch.chdir(project)
    default = (project / "params.yaml").read_bytes()
    assert _switch(project, "multi30k_en_de").exit_code == 0
    edited = (project / "params.yaml").read_text().replace("  warmup: 1000", "  warmup: 4000")
    (project / "params.yaml").write_text(edited)
    result = CliRunner().invoke(presets.main, ["multi30k_de_en"])
    assert result.exit_code == 2 and "changes that preset 'multi30k_en_de' does not make" in result.output
    assert (project / "params.yaml").read_text() == edited  # untouched
    assert _switch(project, "multi30k_de_en", "--force").exit_code == 0
    assert (project / "params.yaml").read_bytes() == default


def test_make_preset_runs_the_builder():
    dry = run(["make", "-n", "preset", "P=multi30k_en_de"], ROOT).stdout
    assert "python -m transformer.presets multi30k_en_de" in dry


def test_a_preset_may_change_a_key_whose_name_holds_digits(tmp_path):
    shutil.copytree(ROOT / "params", tmp_path / "params")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "params/grads.yaml").write_text("# digits\ntrain:\n  ddp_bf16_grads: true  # a key with digits\n")
    assert presets.recipe("grads", tmp_path)["train"]["ddp_bf16_grads"] is True
