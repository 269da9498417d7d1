"""params.yaml: one frozen dataclass per section, one strict loader.

Each key is one field here, `name: type = param("its one-line meaning", rules...)`: the one place
its type, the values it may take and its meaning are written. The loader checks each value
against its field's rules; rules that tie keys together are cross_key_problems and model_problems.
To add a key: its field here, and its `key: value  # meaning` line in params.yaml (the comment
opens with the meaning; after '; ' it may say why the value), then `python -m transformer.config`
rewrites docs/pipeline.md's tables. tests/test_param_docs.py holds params.yaml and the docs to it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from transformer.errors import ConfigError

# No field has a default: params.yaml (and each preset in params/) holds every value, and the
# loader refuses a file that leaves one out, so no second copy can silently win.


@dataclass(frozen=True)
class Rule:
    """What one value must be: ok(value), else the error says `why`; `shown` is its docs wording."""

    ok: Callable[[Any], bool]
    why: str
    shown: str
    choices: tuple[str, ...] = ()


def _items(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def one_of(*choices: str) -> Rule:
    """Each value (of a list, each item) one of `choices`."""
    shown = "one of " + ", ".join(f"`{c}`" for c in choices)
    return Rule(lambda v: all(x in choices for x in _items(v)), f"is not one of {', '.join(choices)}", shown, choices)


def in_range(low: float, high: float, brackets: str = "[]") -> Rule:
    """low <= value <= high, each end open where `brackets` says so: "[)" is low <= value < high."""
    shown = f"{brackets[0]}{low}, {high}{brackets[1]}"
    above = (lambda v: v >= low) if brackets[0] == "[" else (lambda v: v > low)
    below = (lambda v: v <= high) if brackets[1] == "]" else (lambda v: v < high)
    return Rule(lambda v: above(v) and below(v), f"must be in {shown}", f"in {shown}")  # NaN fails both


def matching(pattern: re.Pattern, why: str, shown: str) -> Rule:
    """Each value (of a list, each item) matching `pattern` whole."""
    return Rule(lambda v: all(pattern.fullmatch(x) for x in _items(v)), why, shown)


POSITIVE = Rule(lambda v: v > 0, "must be > 0", "> 0")  # also refuses NaN
NON_NEGATIVE = Rule(lambda v: v >= 0, "must be >= 0", "≥ 0")
FRACTION = in_range(0, 1, "[)")
RATIO = Rule(lambda v: v == 0 or v >= 1, "must be 0 (off) or >= 1", "0 (off) or ≥ 1")  # also refuses NaN
MAX_LAYERS = 64  # model.N and model.decoder_N, also bounding what a model file may ask us to build
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file or directory name: no separator, no '..', no option
FILE_NAME = matching(
    NAME,
    "becomes part of a file name: letters, digits, '_', '.' and '-' only, not starting with '.' or '-'",
    "a file name (letters, digits, `_ . -`)",
)
NOT_EMPTY = Rule(lambda v: len(v) > 0, "must name at least one test set", "at least one")
# score.metrics' choices: the name each has in reports
METRICS = {"bleu": "BLEU", "bleu_tok_lc": "BLEU tok-lc", "chrf": "chrF2", "ter": "TER"}


def param(meaning: str, *rules: Rule, older_runs: Any = dataclasses.MISSING) -> Any:
    """A params.yaml key: its one-line meaning and the rules its value must pass. `older_runs`, for
    a key that trains (TRAIN_SECTIONS) added after checkpoints were first written, is the value that
    trains as those checkpoints' runs did, so a run written before the key resumes, or joins an
    ensemble, under it."""
    return dataclasses.field(metadata={"meaning": meaning, "rules": rules, "older_runs": older_runs})


@dataclass(frozen=True)
class DataConfig:
    corpus: str = param("the corpus, a name in `data.registry`", FILE_NAME)
    src_lang: str = param("the source language", FILE_NAME)
    tgt_lang: str = param("the target language; swap it with `src_lang` for the other direction", FILE_NAME)
    registry: str = param("the corpus registry (YAML): each split's languages, sources and their sha256")
    valid: str = param("the split validated on during training", FILE_NAME)


@dataclass(frozen=True)
class TokenizeConfig:
    max_len: int = param("training pairs with a side longer than this many tokens are dropped", POSITIVE)
    max_ratio: float = param(
        "training pairs whose longer side has more than this many times the tokens of the shorter are dropped; 0: off",
        RATIO,
        older_runs=0.0,
    )
    dedupe: bool = param(
        "`true`: a training pair equal, token for token, to an earlier one is dropped", older_runs=False
    )


@dataclass(frozen=True)
class VocabConfig:
    kind: str = param(
        "`word`: a vocabulary a language | `bpe`: one joint sentencepiece BPE vocabulary, the paper's (§5.1)",
        one_of("word", "bpe"),
    )
    size: int = param("`bpe` only: pieces in the joint vocabulary", POSITIVE)
    min_freq: int = param("`word` only: rarer words become `<unk>`", POSITIVE)
    seed: int = param("`bpe` only: draws the 5M training lines BPE is learned from, where there are more", NON_NEGATIVE)


@dataclass(frozen=True)
class ModelConfig:
    N: int = param(
        "layers of the encoder, and of the decoder unless `decoder_N` (§3.1; the paper: 6)", in_range(1, MAX_LAYERS)
    )
    decoder_N: int = param(
        "layers of the decoder; 0: `N`, equal stacks as in the paper (§3.1)", in_range(0, MAX_LAYERS)
    )
    d_model: int = param("width of embeddings and sub-layer outputs (§3.1; 512); even, and divisible by `h`", POSITIVE)
    d_ff: int = param("inner width of the feed-forward layers (§3.3; 2048)", POSITIVE)
    h: int = param("attention heads, each `d_model / h` wide (§3.2.2; 8)", POSITIVE)
    dropout: float = param("P_drop on every sub-layer's output and on the embedding sums (§5.4; 0.1)", FRACTION)
    attn_dropout: float = param(
        "dropout on attention weights (the Annotated Transformer's; not in the paper)", FRACTION
    )
    ff_dropout: float = param("dropout inside the feed-forward layer, after the ReLU (likewise)", FRACTION)
    word_dropout: float = param("chance of zeroing each source token's embedding in training; 0: off", FRACTION)
    norm: str = param(
        "`post`: LayerNorm(x + Sublayer(x)), the paper's (§3.1) | `pre`: the Annotated Transformer's",
        one_of("post", "pre"),
    )
    tie_embeddings: bool = param("source, target and pre-softmax weights share one matrix (§3.4); needs `bpe`")


@dataclass(frozen=True)
class TrainConfig:
    nproc: int = param("processes per node (`torchrun --nproc-per-node`), one per GPU", POSITIVE)
    nnodes: int = param("nodes (`torchrun --nnodes`)", POSITIVE)
    seed: int = param("seeds initial weights, batch order, dropout masks and BPE-dropout")
    members: int = param("models trained, member k with seed `seed + k`, searched as one ensemble", POSITIVE)
    max_tokens: int = param("padded tokens a side per process and micro-batch (§5.1: about 25,000 an update)", POSITIVE)
    pad_multiple: int = param(
        "batch sides padded to a multiple of this (8: fewer shapes, compile needs none); 1: off",
        POSITIVE,
        older_runs=1,
    )
    accum: int = param("micro-batches per update", POSITIVE)
    epochs: int = param("passes over the training pairs", POSITIVE)
    factor: float = param("lrate = factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) (§5.3; 1)", POSITIVE)
    warmup: int = param("updates over which lrate rises linearly (§5.3; 4000)", POSITIVE)
    cooldown: float = param("last fraction of the updates, lrate falling linearly to 0; 0: none", FRACTION)
    label_smoothing: float = param("ε_ls (§5.4; 0.1)", FRACTION)
    weight_decay: float = param(
        "AdamW's decay of weight matrices and embeddings; 0: the paper's Adam (§5.3)", NON_NEGATIVE
    )
    bpe_dropout: float = param(
        "chance of skipping each BPE merge in the training text, per epoch; 0: fixed segmentation", FRACTION
    )
    smoothing_zeroes_pad: bool = param("`true`: no smoothing mass on `<blank>` (the Annotated Transformer's)")
    rdrop: float = param("R-Drop's α, the weight of the KL between two dropout passes; 0: off", NON_NEGATIVE)
    rdrop_from: float = param("fraction of the planned updates after which R-Drop starts; 0: from the first", FRACTION)
    rdrop_share: float = param(
        "share of each micro-batch's sentences R-Drop passes twice, drawn per batch; 1: all", in_range(0, 1, "(]")
    )
    rdrop_shared_encoder: bool = param("`true`: one encoder pass for both R-Drop passes")
    precision: str = param(
        "`auto`: bf16 where the hardware computes it natively, else fp16 with a gradient scaler on a GPU, "
        "else fp32 (docs/scale.md)",
        one_of("auto", "fp32", "bf16", "fp16"),
    )
    compile: bool = param("`torch.compile` the model, its generator and the loss (every batch size symbolic)")
    ddp_bf16_grads: bool = param(
        "several processes: all-reduce gradients in bf16, half the bytes but rounded; `false`: fp32",
        older_runs=False,
    )
    max_restarts: int = param(
        "torchrun's `--max-restarts`: a job whose process died restarts from the last checkpoint this many times "
        "(docs/scale.md); 0: it stops",
        NON_NEGATIVE,
        older_runs=3,
    )
    save_every: int = param("updates between mid-epoch checkpoints; 0: at epoch ends only", NON_NEGATIVE)
    keep: int = param("checkpoints kept: the last ones, and with `average.select: best` its candidates", POSITIVE)
    max_steps: int = param(
        "stop after this many updates; 0: run every epoch (the paper: 100k base, §5.2)", NON_NEGATIVE
    )
    eval_every: int = param(
        "updates between validations (loss, greedy val BLEU) besides epoch ends; 0: none", NON_NEGATIVE
    )
    patience: int = param("stop after this many validations without a higher val BLEU; 0: never", NON_NEGATIVE)

    def member_seeds(self) -> list[int]:
        """The seeds of the models trained: member k's is seed + k."""
        return [self.seed + k for k in range(self.members)]


@dataclass(frozen=True)
class AverageConfig:
    last_k: int = param("checkpoints averaged (§6.1: 5); with `select: last`, at most `train.keep`", POSITIVE)
    select: str = param(
        "`last`: the last `last_k`, as the paper (§6.1) | `best`: the `last_k` of highest val BLEU",
        one_of("last", "best"),
    )


@dataclass(frozen=True)
class DecodeConfig:
    beam: int = param("beam size (§6.1: 4); 1: greedy", POSITIVE)
    alpha: float = param("GNMT length penalty ((5 + |Y|) / 6)^α (§6.1: 0.6)", NON_NEGATIVE)
    max_len_extra: int = param("an output is at most its source's length plus this (§6.1: 50)", NON_NEGATIVE)
    batch_tokens: int = param("source tokens × beam per batch: memory and speed", POSITIVE)
    testsets: tuple[str, ...] = param(
        "splits decoded and scored, a `decode@<testset>` stage each", NOT_EMPTY, FILE_NAME
    )


@dataclass(frozen=True)
class ScoreConfig:
    metrics: tuple[str, ...] = param(
        "scores: sacreBLEU's `bleu`, `bleu_tok_lc` (tokenized, lowercased), `chrf` (chrF2), `ter`",
        one_of(*METRICS),
    )


@dataclass(frozen=True)
class ReportConfig:
    label: str = param(
        "names this recipe's section of `reports/reproduction.md`; empty for the default",
        matching(  # it becomes part of a Markdown heading and an HTML comment
            re.compile(r"[A-Za-z0-9_.-]*"),
            "may hold only letters, digits, '_', '.' and '-'",
            "letters, digits, `_ . -`",
        ),
    )


@dataclass(frozen=True)
class ExportConfig:
    registered_name: str = param(
        "the model's name in MLflow's model registry",
        matching(
            re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*"),
            "must be letters, digits, '_', '.' or '-', starting with a letter or digit",
            "letters, digits, `_ . -`, starting with a letter or digit",
        ),
    )
    quantization: str = param(
        "the CTranslate2 model's weights; `none`: float32",
        one_of("none", "int8", "int8_float32", "int16", "float16", "bfloat16"),
    )


@dataclass(frozen=True)
class Params:
    data: DataConfig
    tokenize: TokenizeConfig
    vocab: VocabConfig
    model: ModelConfig
    train: TrainConfig
    average: AverageConfig
    decode: DecodeConfig
    score: ScoreConfig
    report: ReportConfig
    export: ExportConfig

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(self, name)).items()
            }
            for name in SECTIONS
        }


SECTIONS = tuple(f.name for f in dataclasses.fields(Params))
TRAIN_SECTIONS = ("data", "tokenize", "vocab", "model", "train")  # what a trained model depends on
_SECTION_TYPES = typing.get_type_hints(Params)
CHOICES = {  # "section.key": the values it may take, for click options that take one of them
    f"{s}.{f.name}": rule.choices
    for s in SECTIONS
    for f in dataclasses.fields(_SECTION_TYPES[s])
    for rule in f.metadata["rules"]
    if rule.choices
}
# section -> its keys added since checkpoints were first written, each with the value that trains
# as those checkpoints' runs did (param's older_runs).
ADDED_KEYS = {
    s: {
        f.name: f.metadata["older_runs"]
        for f in dataclasses.fields(_SECTION_TYPES[s])
        if f.metadata["older_runs"] is not dataclasses.MISSING
    }
    for s in SECTIONS
}


def load_params(path: Path | str = "params.yaml") -> Params:
    """Reads and checks a params file; any problem raises one ConfigError naming the key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return params_from_dict(raw, source=str(path))


def params_from_dict(raw: Any, source: str = "params") -> Params:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    for name in raw:
        if name not in SECTIONS:
            raise ConfigError(f"{source}: unknown section '{name}' (known: {', '.join(SECTIONS)})")
    for name in SECTIONS:
        if name not in raw:
            raise ConfigError(f"{source}: missing section '{name}'")
    params = Params(**{name: _section(name, raw[name], source) for name in SECTIONS})
    values = params.to_dict()
    problems = [(f"{s}.{k}", why) for s in SECTIONS for k, why in _section_problems(s, values[s])]
    problems += cross_key_problems(params)
    if problems:
        key, why = problems[0]
        section, name = key.split(".")
        raise ConfigError(f"{source}: '{key}' = {values[section][name]!r} {why}")
    return params


def _section(name: str, raw: Any, source: str) -> Any:
    cls = _SECTION_TYPES[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section '{name}' must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in hints:
            known = ", ".join(hints)
            raise ConfigError(f"{source}: unknown key '{name}.{key}' (known keys of '{name}': {known})")
        values[key] = _coerce(f"{name}.{key}", value, hints[key], source)
    missing = [f"{name}.{key}" for key in hints if key not in values]
    if missing:
        raise ConfigError(
            f"{source}: missing key{'s' * (len(missing) > 1)} {', '.join(missing)} (params.yaml lists every key)"
        )
    return cls(**values)


def _coerce(key: str, value: Any, hint: Any, source: str) -> Any:
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: '{key}' must be a list of strings, got {value!r}")
        return tuple(value)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        raise ConfigError(f"{source}: '{key}' must be {hint.__name__}, got {value!r} ({type(value).__name__})")
    return float(value) if hint is float else value


def _section_problems(section: str, values: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for each value of a section that breaks one of its field's rules."""
    if section == "model":
        return model_problems(values)
    return _field_problems(_SECTION_TYPES[section], values)


def _field_problems(cls: type, values: dict[str, Any]) -> list[tuple[str, str]]:
    fields = dataclasses.fields(cls)
    return [(f.name, rule.why) for f in fields for rule in f.metadata["rules"] if not rule.ok(values[f.name])]


def cross_key_problems(p: Params) -> list[tuple[str, str]]:
    """(key, why) for each rule that ties a key to another."""
    m, t = p.model, p.train
    no_dropout = not (m.dropout or m.attn_dropout or m.ff_dropout)
    checks = [
        (
            m.tie_embeddings and p.vocab.kind != "bpe",
            "model.tie_embeddings",
            "needs a joint vocabulary (vocab.kind: bpe)",
        ),
        (
            t.rdrop and no_dropout,
            "train.rdrop",
            "needs dropout (model.dropout, attn_dropout or ff_dropout > 0): without it both passes are the same",
        ),
        (
            t.rdrop_share < 1 and t.rdrop_shared_encoder,
            "train.rdrop_share",
            "< 1 needs train.rdrop_shared_encoder: false (the shared encoder passes every sentence twice)",
        ),
        (
            t.bpe_dropout and p.vocab.kind != "bpe",
            "train.bpe_dropout",
            "needs vocab.kind: bpe (a word vocabulary has one segmentation)",
        ),
        (p.data.src_lang == p.data.tgt_lang, "data.tgt_lang", "equals data.src_lang"),
        (
            p.average.select == "last" and p.average.last_k > t.keep,  # with best, training keeps the best last_k
            "average.last_k",
            f"exceeds train.keep = {t.keep} (not enough checkpoints are kept)",
        ),
    ]
    return [(key, why) for failed, key, why in checks if failed]


def model_problems(m: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for each model hyperparameter out of range, in a `model` section or in a model
    file's config (which adds src_vocab, tgt_vocab and pad): the one place these ranges live."""
    problems = _field_problems(ModelConfig, m)
    problems += [(key, POSITIVE.why) for key in ("src_vocab", "tgt_vocab") if key in m and not POSITIVE.ok(m[key])]
    if m["h"] > 0 and m["d_model"] % m["h"]:
        problems.append(("d_model", f"is not divisible by model.h = {m['h']}"))
    if m["d_model"] % 2:
        problems.append(("d_model", "must be even (sinusoidal positional encoding)"))
    if "pad" in m and not 0 <= m["pad"] < min(m["src_vocab"], m["tgt_vocab"]):
        problems.append(("pad", "must be a token id of both vocabularies"))
    return problems


def with_added_keys(params: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Sections of params as a run recorded them, each key of ADDED_KEYS the record lacks at the
    value it had there: a run recorded before a key existed trained as that value does."""
    return {s: ADDED_KEYS.get(s, {}) | keys for s, keys in params.items()}


def training_params(params: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The params (as Params.to_dict() gives them) that a resumed run, or each member of an ensemble,
    must share: TRAIN_SECTIONS without train.members, since training sees one member at a time (and
    a file written before ensembles lacks it); a key of ADDED_KEYS that a file lacks has its value there."""
    sections = with_added_keys({s: params[s] for s in TRAIN_SECTIONS})
    return sections | {"train": {k: v for k, v in sections["train"].items() if k != "members"}}


def flatten(params: Params) -> dict[str, Any]:
    """'section.key' -> value, for MLflow."""
    return {f"{s}.{k}": v for s, d in params.to_dict().items() for k, v in d.items()}


_TYPE_WORDS = {int: "integer", float: "number", bool: "`true` or `false`", str: "text", tuple[str, ...]: "list of text"}


def param_tables(defaults: dict[str, dict[str, Any]]) -> str:
    """docs/pipeline.md's table of each section: every key's meaning, the values it may take,
    and its default (`defaults`, params.yaml's values). Each table ends with a blank line: without
    one, Markdown reads the heading that follows as one more row of the table."""
    lines = []
    for section in SECTIONS:
        lines += [f"### {section}", "", "| key | what it does | values | default |", "|---|---|---|---|"]
        hints = typing.get_type_hints(_SECTION_TYPES[section])
        for f in dataclasses.fields(_SECTION_TYPES[section]):
            values = ", ".join([_TYPE_WORDS[hints[f.name]]] + [rule.shown for rule in f.metadata["rules"]])
            cells = [f"`{f.name}`", f.metadata["meaning"], values, f"`{yaml_value(defaults[section][f.name])}`"]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def yaml_value(value: Any) -> str:
    """A value as params.yaml writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return f"[{', '.join(value)}]"
    return str(value) if value != "" else '""'


def write_param_docs(page: Path = Path("docs/pipeline.md"), params: Path = Path("params.yaml")) -> None:
    """Rewrites the page's param tables, from the first section's heading up to the next `## ` heading."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n### {SECTIONS[0]}\n") + 1
    end = text.index("\n## ", start) + 1
    page.write_text(text[:start] + param_tables(load_params(params).to_dict()) + text[end:], encoding="utf-8")


if __name__ == "__main__":  # python -m transformer.config, from the repository root
    write_param_docs()
