"""Each param's meaning and rules live once, on its field in transformer/config.py: docs/pipeline.md's
tables are written from them, and params.yaml's comment on each key opens with the meaning."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from conftest import ROOT

from transformer import config
from transformer.config import ConfigError, Params, load_params, params_from_dict

FIELDS = {(s, f.name): f for s, cls in typing.get_type_hints(Params).items() for f in dataclasses.fields(cls)}


def _comments(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment on the key's line in a params.yaml text."""
    comments, section = {}, None
    for line in text.splitlines():
        if match := re.match(r"(\w+):", line):
            section = match.group(1)
        elif match := re.match(r"  (\w+): [^#]*# (.*)$", line):
            comments[section, match.group(1)] = match.group(2)
    return comments


def test_every_param_has_a_one_line_meaning():
    for key, f in FIELDS.items():
        assert f.metadata["meaning"].strip() and "\n" not in f.metadata["meaning"], key


def test_params_yaml_comments_open_with_each_keys_meaning():
    """A comment may add why the default is what it is, after '; '."""
    comments = _comments((ROOT / "params.yaml").read_text(encoding="utf-8"))
    assert set(comments) == set(FIELDS)
    for key, comment in comments.items():
        meaning = FIELDS[key].metadata["meaning"]
        assert comment == meaning or comment.startswith(meaning + "; "), f"{'.'.join(key)}: {comment!r} vs {meaning!r}"


def test_the_docs_param_tables_are_written_from_config(tmp_path):
    page = ROOT / "docs" / "pipeline.md"
    copy = tmp_path / "pipeline.md"
    copy.write_text(page.read_text(encoding="utf-8"), encoding="utf-8")
    config.write_param_docs(copy, ROOT / "params.yaml")
    assert copy.read_text(encoding="utf-8") == page.read_text(encoding="utf-8"), "run: python -m transformer.config"


def test_the_docs_have_one_row_per_param_saying_its_meaning():
    text = (ROOT / "docs" / "pipeline.md").read_text(encoding="utf-8")
    for (section, key), f in FIELDS.items():
        table = text.split(f"\n### {section}\n")[1].split("\n#")[0]
        rows = [line for line in table.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1 and f"| {f.metadata['meaning'].replace('|', chr(92) + '|')} |" in rows[0], (
            f"{section}.{key}"
        )


@pytest.mark.parametrize(
    "rule, good, bad",
    [
        (config.POSITIVE, [1, 0.5], [0, -1, float("nan")]),
        (config.NON_NEGATIVE, [0, 3.0], [-1, float("nan")]),
        (config.FRACTION, [0, 0.99], [1, -0.1, float("nan")]),
        (config.in_range(0, 1, "(]"), [1, 0.5], [0, 1.5]),
        (config.in_range(1, 64), [1, 64], [0, 65]),
        (config.one_of("a", "b"), ["a", ["a", "b"]], ["c", ["a", "c"]]),
        (config.FILE_NAME, ["val", ["val", "test2016"]], ["../x", "-val", [".."]]),
        (config.RATIO, [0, 1, 2.5], [0.5, -1, float("nan")]),
    ],
)
def test_each_rule_passes_what_it_allows_and_refuses_the_rest(rule, good, bad):
    assert all(rule.ok(v) for v in good) and not any(rule.ok(v) for v in bad)


def test_the_choices_click_options_use_come_from_the_fields():
    assert config.CHOICES["score.metrics"] == tuple(config.METRICS)
    assert "int8" in config.CHOICES["export.quantization"] and "bf16" in config.CHOICES["train.precision"]


def test_keys_added_to_train_and_tokenize_name_the_value_older_runs_trained_with():
    assert config.ADDED_KEYS["train"].items() >= {"pad_multiple": 1, "ddp_bf16_grads": False}.items()
    assert config.ADDED_KEYS["tokenize"] == {"max_ratio": 0.0, "dedupe": False}
    recorded = {"tokenize": {"max_len": 100}, "train": {"pad_multiple": 8}}
    assert config.with_added_keys(recorded)["tokenize"] == {"max_len": 100, "max_ratio": 0.0, "dedupe": False}
    assert config.with_added_keys(recorded)["train"]["pad_multiple"] == 8  # a recorded value is kept


def test_a_range_error_names_the_key_value_and_range():
    raw = load_params(ROOT / "params.yaml").to_dict()
    raw["train"]["rdrop_share"] = 1.5
    with pytest.raises(ConfigError, match=r"'train.rdrop_share' = 1.5 must be in \(0, 1\]"):
        params_from_dict(raw)
