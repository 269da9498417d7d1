"""params.yaml loading: every shipped file loads; every defect is a ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from transformer.config import ConfigError, Params, load_params, params_from_dict

REPO = Path(__file__).resolve().parents[1]


def _valid() -> dict:
    """A complete, valid params mapping (the repository's params.yaml), to break one key at a time."""
    return yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))


def _with(section: str, key: str, value) -> dict:
    raw = _valid()
    raw[section][key] = value
    return raw


def test_params_yaml_and_every_preset_built_from_it_load():
    from transformer.presets import names, recipe

    assert isinstance(load_params(REPO / "params.yaml"), Params)
    for name in names(REPO):
        params = params_from_dict(recipe(name, REPO), source=name)
        assert params.data.src_lang != params.data.tgt_lang, name


def test_repo_params_yaml_values_reach_the_dataclasses():
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params = load_params(REPO / "params.yaml")
    assert params.model.d_model == raw["model"]["d_model"]
    assert params.decode.testsets == tuple(raw["decode"]["testsets"])
    assert params.to_dict()["score"]["metrics"] == raw["score"]["metrics"]


def test_params_round_trip_through_to_dict():
    params = params_from_dict(_valid())
    assert params_from_dict(params.to_dict()) == params


def test_no_config_dataclass_has_a_default_to_contradict_params_yaml():
    """params.yaml is the one place a value lives: a dataclass default would be a second copy
    that silently wins when a key is missing (as TrainConfig.epochs 10 did against 15)."""
    sections = typing.get_type_hints(Params)
    assert list(sections) == list(_valid())  # every section of params.yaml, in its order
    for cls in (Params, *sections.values()):
        defaulted = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        ]
        assert not defaulted, f"{cls.__name__} has defaults for {', '.join(defaulted)}: params.yaml holds them"


def test_int_given_for_a_float_key_is_accepted_as_float():
    params = params_from_dict(_with("train", "factor", 2))
    assert params.train.factor == 2.0 and isinstance(params.train.factor, float)


def test_missing_key_is_rejected_by_name():
    raw = _valid()
    del raw["train"]["epochs"]
    with pytest.raises(ConfigError, match="missing key") as e:
        params_from_dict(raw)
    assert "train.epochs" in str(e.value)


def test_empty_section_is_rejected_naming_its_keys():
    raw = _valid()
    raw["average"] = None
    with pytest.raises(ConfigError, match="missing key") as e:
        params_from_dict(raw)
    assert "average.last_k" in str(e.value)


@pytest.mark.parametrize(
    "raw, key",
    [
        (_with("model", "heads", 4), "model.heads"),
        (_with("train", "lr", 0.1), "train.lr"),
    ],
    ids=["model.heads", "train.lr"],
)
def test_unknown_key_is_rejected_by_name(raw, key):
    with pytest.raises(ConfigError, match="unknown key") as e:
        params_from_dict(raw)
    assert key in str(e.value)


def test_unknown_section_is_rejected_by_name():
    raw = _valid()
    raw["optimizer"] = {"lr": 0.1}
    with pytest.raises(ConfigError, match="unknown section") as e:
        params_from_dict(raw)
    assert "optimizer" in str(e.value)


def test_missing_section_is_rejected_by_name():
    raw = _valid()
    del raw["decode"]
    with pytest.raises(ConfigError, match="missing section") as e:
        params_from_dict(raw)
    assert "decode" in str(e.value)


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("model", "N", "three"),
        ("model", "N", True),  # bool is an int subclass: must still be refused
        ("model", "N", 3.0),
        ("model", "tie_embeddings", "yes"),
        ("model", "dropout", "0.1"),
        ("train", "compile", 1),
        ("train", "ddp_bf16_grads", "false"),
        ("data", "src_lang", 7),
        ("decode", "testsets", "val"),
        ("decode", "testsets", ["val", 2]),
        ("train", "seed", None),
    ],
)
def test_wrong_type_is_rejected_by_key(section, key, value):
    with pytest.raises(ConfigError) as e:
        params_from_dict(_with(section, key, value))
    assert f"{section}.{key}" in str(e.value)


def test_d_model_not_divisible_by_h_is_rejected():
    raw = _with("model", "d_model", 250)
    raw["model"]["h"] = 4
    with pytest.raises(ConfigError, match="divisible") as e:
        params_from_dict(raw)
    assert "model.d_model" in str(e.value)


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("model", "dropout", -0.1),
        ("model", "dropout", 1.0),
        ("train", "label_smoothing", -0.5),
        ("model", "N", 0),
        ("model", "decoder_N", -1),
        ("train", "warmup", -1),
        ("decode", "alpha", -0.6),
        ("model", "norm", "sandwich"),
        ("vocab", "kind", "char"),
        ("score", "metrics", ["bleu", "meteor"]),
        ("report", "label", "long run"),
        ("report", "label", "x-->"),
        ("train", "bpe_dropout", 1.0),
        ("train", "bpe_dropout", -0.1),
        ("train", "rdrop", -1.0),
        ("train", "weight_decay", -0.1),
        ("train", "rdrop_share", 0.0),
        ("train", "rdrop_share", 1.5),
        ("train", "rdrop_from", 1.0),
        ("train", "rdrop_from", -0.2),
        ("model", "word_dropout", 1.0),
        ("model", "word_dropout", -0.1),
    ],
)
def test_out_of_range_value_is_rejected_by_key(section, key, value):
    with pytest.raises(ConfigError) as e:
        params_from_dict(_with(section, key, value))
    assert f"{section}.{key}" in str(e.value)


@pytest.mark.parametrize("section, key", [("train", "factor"), ("decode", "alpha"), ("model", "dropout")])
def test_nan_is_rejected_by_key(section, key, tmp_path):
    raw = _valid()
    raw[section][key] = ".nan"  # YAML's not-a-number, written as params.yaml would hold it
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw).replace("'.nan'", ".nan"), encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_params(path)
    assert f"{section}.{key}" in str(e.value)


def test_tied_embeddings_with_word_vocabulary_is_rejected():
    raw = _with("vocab", "kind", "word")
    raw["model"]["tie_embeddings"] = True
    with pytest.raises(ConfigError, match="joint vocabulary") as e:
        params_from_dict(raw)
    assert "model.tie_embeddings" in str(e.value)
    raw["model"]["tie_embeddings"] = False
    assert params_from_dict(raw).vocab.kind == "word"


def test_partial_rdrop_on_a_shared_encoder_is_rejected():
    raw = _with("train", "rdrop_share", 0.5)
    raw["train"]["rdrop_shared_encoder"] = True
    with pytest.raises(ConfigError) as e:
        params_from_dict(raw)
    assert "train.rdrop_share" in str(e.value) and "rdrop_shared_encoder" in str(e.value)
    raw["train"]["rdrop_shared_encoder"] = False
    assert params_from_dict(raw).train.rdrop_share == 0.5


def test_bpe_dropout_with_word_vocabulary_is_rejected():
    raw = _with("vocab", "kind", "word")
    raw["model"]["tie_embeddings"] = False
    raw["train"]["bpe_dropout"] = 0.1
    with pytest.raises(ConfigError, match="vocab.kind: bpe") as e:
        params_from_dict(raw)
    assert "train.bpe_dropout" in str(e.value)
    raw["train"]["bpe_dropout"] = 0.0
    assert params_from_dict(raw).train.bpe_dropout == 0.0
    raw["vocab"]["kind"], raw["model"]["tie_embeddings"], raw["train"]["bpe_dropout"] = "bpe", True, 0.1
    assert params_from_dict(raw).train.bpe_dropout == 0.1


def test_rdrop_without_dropout_is_rejected():
    raw = _with("train", "rdrop", 5.0)
    raw["model"].update(dropout=0.0, attn_dropout=0.0, ff_dropout=0.0)
    with pytest.raises(ConfigError, match="needs dropout") as e:
        params_from_dict(raw)
    assert "train.rdrop" in str(e.value)
    raw["model"]["ff_dropout"] = 0.1
    assert params_from_dict(raw).train.rdrop == 5.0


def test_averaging_more_checkpoints_than_kept_is_rejected():
    raw = _with("average", "last_k", 6)
    raw["train"]["keep"] = 5
    with pytest.raises(ConfigError) as e:
        params_from_dict(raw)
    assert "average.last_k" in str(e.value)
    raw["average"]["select"] = "best"  # training keeps the best last_k beside the last `keep`
    assert params_from_dict(raw).average.last_k == 6


@pytest.mark.parametrize(
    "section, key, value", [("average", "select", "worst"), ("train", "eval_every", -1), ("train", "patience", -2)]
)
def test_bad_validation_and_averaging_params_are_rejected_by_key(section, key, value):
    with pytest.raises(ConfigError) as e:
        params_from_dict(_with(section, key, value))
    assert f"{section}.{key}" in str(e.value)


def test_yaml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("model:\n  N: [3\n  d_model: 256\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_params(path)
    assert str(path) in str(e.value)


def test_missing_params_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such params file"):
        load_params(tmp_path / "absent.yaml")


def test_error_from_a_file_names_file_and_key(tmp_path):
    raw = _with("model", "N", "three")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_params(path)
    assert str(path) in str(e.value) and "model.N" in str(e.value)


def test_top_level_list_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- data\n- model\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="mapping"):
        load_params(path)


def test_params_are_frozen():
    params = params_from_dict(_valid())
    with pytest.raises(AttributeError):
        params.model.N = 6


def test_model_ranges_are_checked_once_for_params_and_model_files():
    from transformer.config import MAX_LAYERS, model_problems

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["model"]["N"] = MAX_LAYERS + 1
    with pytest.raises(ConfigError, match=r"'model.N' = 65 must be in \[1, 64\]"):
        params_from_dict(raw)
    file_config = raw["model"] | {"N": 6, "h": 3, "src_vocab": 10, "tgt_vocab": 10, "pad": 10}
    assert model_problems(file_config) == [
        ("d_model", "is not divisible by model.h = 3"),
        ("pad", "must be a token id of both vocabularies"),
    ]
