"""params.yaml: one frozen dataclass per section, one strict loader."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from transformer.errors import ConfigError

# No field has a default: params.yaml (and each preset in params/) holds every value, and the
# loader refuses a file that leaves one out, so no second copy can silently win.


@dataclass(frozen=True)
class DataConfig:
    corpus: str
    src_lang: str
    tgt_lang: str
    registry: str
    valid: str


@dataclass(frozen=True)
class TokenizeConfig:
    max_len: int


@dataclass(frozen=True)
class VocabConfig:
    kind: str
    size: int
    min_freq: int
    seed: int  # bpe: draws the sample of training lines sentencepiece learns from (beyond vocab.SAMPLE)


@dataclass(frozen=True)
class ModelConfig:
    N: int  # the encoder's layers, and the decoder's unless decoder_N
    decoder_N: int  # the decoder's layers; 0: N (the paper's)
    d_model: int
    d_ff: int
    h: int
    dropout: float
    attn_dropout: float  # on attention weights (the Annotated Transformer's; not in the paper)
    ff_dropout: float  # inside the feed-forward layer, after the ReLU (likewise)
    word_dropout: float  # chance of zeroing each source token's embedding in training
    norm: str
    tie_embeddings: bool


@dataclass(frozen=True)
class TrainConfig:
    nproc: int
    nnodes: int
    seed: int
    members: int  # models trained, member k with seed + k, and searched as one ensemble; 1: a single model
    max_tokens: int
    pad_multiple: int  # each batch side padded to a multiple of this many tokens; 1: to its longest line
    accum: int
    epochs: int
    factor: float
    warmup: int
    cooldown: float
    label_smoothing: float
    weight_decay: (
        float  # AdamW's decoupled decay of weight matrices and embeddings, per unit of rate; 0: the paper's Adam
    )
    bpe_dropout: float  # probability of skipping each BPE merge when segmenting the training text; 0: fixed ids
    smoothing_zeroes_pad: bool  # true: no smoothing mass on <blank> (the Annotated Transformer's)
    rdrop: float  # R-Drop's alpha: the weight of the KL term between two dropout passes; 0: off (one pass)
    rdrop_from: float  # the fraction of the planned updates after which R-Drop starts; 0: from the first update
    rdrop_share: float  # the share of each micro-batch's sentences that R-Drop passes twice, drawn per batch; 1: all
    rdrop_shared_encoder: (
        bool  # true: R-Drop's two passes share one encoder pass and differ in the decoder's dropout alone
    )
    precision: str
    compile: bool
    ddp_bf16_grads: bool  # under DDP, gradients all-reduced in bf16 (half the bytes, rounded); false: fp32
    max_restarts: int  # torchrun --max-restarts: times a failed worker group restarts from the last checkpoint
    save_every: int
    keep: int
    max_steps: int
    eval_every: int  # updates between validations (loss and greedy BLEU) besides epoch ends; 0: epoch ends only
    patience: int  # stop after this many validations without a higher val BLEU; 0: never

    def member_seeds(self) -> list[int]:
        """The seeds of the models trained: member k's is seed + k."""
        return [self.seed + k for k in range(self.members)]


@dataclass(frozen=True)
class AverageConfig:
    last_k: int
    select: str  # last: the last last_k checkpoints | best: the last_k with the highest val BLEU


@dataclass(frozen=True)
class DecodeConfig:
    beam: int
    alpha: float
    max_len_extra: int
    batch_tokens: int
    testsets: tuple[str, ...]


@dataclass(frozen=True)
class ScoreConfig:
    metrics: tuple[str, ...]


@dataclass(frozen=True)
class ReportConfig:
    label: str


@dataclass(frozen=True)
class ExportConfig:
    registered_name: str  # MLflow model registry name
    quantization: str  # the CTranslate2 export's weights; none: float32


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
METRICS = {
    "bleu": "BLEU",
    "bleu_tok_lc": "BLEU tok-lc",
    "chrf": "chrF2",
    "ter": "TER",
}  # score.metrics: name in reports

CHOICES = {
    "vocab.kind": ("word", "bpe"),
    "train.precision": ("auto", "fp32", "bf16"),
    "average.select": ("last", "best"),
    "score.metrics": tuple(METRICS),
    "export.quantization": ("none", "int8", "int8_float32", "int16", "float16", "bfloat16"),
}
POSITIVE = {
    "tokenize.max_len",
    "vocab.size",
    "vocab.min_freq",
    "train.nproc",
    "train.nnodes",
    "train.members",
    "train.max_tokens",
    "train.pad_multiple",
    "train.accum",
    "train.epochs",
    "train.factor",
    "train.warmup",
    "train.keep",
    "average.last_k",
    "decode.beam",
    "decode.batch_tokens",
}
NON_NEGATIVE = {
    "vocab.seed",
    "train.save_every",
    "train.max_restarts",
    "train.max_steps",
    "train.eval_every",
    "train.patience",
    "train.rdrop",
    "train.weight_decay",
    "decode.max_len_extra",
    "decode.alpha",
}
FRACTIONS = {"train.label_smoothing", "train.cooldown", "train.bpe_dropout", "train.rdrop_from"}  # in [0, 1)
MAX_LAYERS = 64  # model.N and model.decoder_N, also bounding what a model file may ask us to build
REGISTERED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
LABEL = re.compile(r"[A-Za-z0-9_.-]*")  # it becomes part of a Markdown heading and an HTML comment
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file or directory name: no separator, no '..', no option
PATH_NAMES = ("data.corpus", "data.src_lang", "data.tgt_lang", "data.valid", "decode.testsets")


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
    sections = {name: _section(name, raw[name], source) for name in SECTIONS}
    params = Params(**sections)
    _check_values(params, source)
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


def _check_values(p: Params, source: str) -> None:
    flat = {f"{s}.{k}": v for s, d in p.to_dict().items() for k, v in d.items()}

    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{source}: '{key}' = {flat[key]!r} {why}")

    for key, allowed in CHOICES.items():
        values = flat[key] if isinstance(flat[key], list) else [flat[key]]
        bad = [v for v in values if v not in allowed]
        if bad:
            fail(key, f"is not one of {', '.join(allowed)}")
    for key in POSITIVE:
        if not flat[key] > 0:  # also refuses NaN
            fail(key, "must be > 0")
    for key in NON_NEGATIVE:
        if not flat[key] >= 0:
            fail(key, "must be >= 0")
    for key in FRACTIONS:
        if not 0 <= flat[key] < 1:
            fail(key, "must be in [0, 1)")
    for key, why in model_problems(dataclasses.asdict(p.model))[:1]:
        fail(f"model.{key}", why)
    if p.model.tie_embeddings and p.vocab.kind != "bpe":
        fail("model.tie_embeddings", "needs a joint vocabulary (vocab.kind: bpe)")
    if p.train.rdrop and not (p.model.dropout or p.model.attn_dropout or p.model.ff_dropout):
        fail(
            "train.rdrop",
            "needs dropout (model.dropout, attn_dropout or ff_dropout > 0): without it both passes are the same",
        )
    if not 0 < p.train.rdrop_share <= 1:
        fail("train.rdrop_share", "must be in (0, 1]")
    if p.train.rdrop_share < 1 and p.train.rdrop_shared_encoder:
        fail(
            "train.rdrop_share",
            "< 1 needs train.rdrop_shared_encoder: false (the shared encoder passes every sentence twice)",
        )
    if p.train.bpe_dropout and p.vocab.kind != "bpe":
        fail("train.bpe_dropout", "needs vocab.kind: bpe (a word vocabulary has one segmentation)")
    if p.data.src_lang == p.data.tgt_lang:
        fail("data.tgt_lang", "equals data.src_lang")
    if not p.decode.testsets:
        fail("decode.testsets", "must name at least one test set")
    if not LABEL.fullmatch(p.report.label):
        fail("report.label", "may hold only letters, digits, '_', '.' and '-'")
    if not REGISTERED_NAME.fullmatch(p.export.registered_name):
        fail("export.registered_name", "must be letters, digits, '_', '.' or '-', starting with a letter or digit")
    for key in PATH_NAMES:
        names = flat[key] if isinstance(flat[key], list) else [flat[key]]
        if not all(NAME.fullmatch(name) for name in names):
            fail(
                key, "becomes part of a file name: letters, digits, '_', '.' and '-' only, not starting with '.' or '-'"
            )
    if p.average.select == "last" and p.average.last_k > p.train.keep:  # with best, training keeps the best last_k
        fail("average.last_k", f"exceeds train.keep = {p.train.keep} (not enough checkpoints are kept)")


def model_problems(m: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for each model hyperparameter out of range, in a `model` section or in a model
    file's config (which adds src_vocab, tgt_vocab and pad): the one place these ranges live."""
    problems = []
    for key, least in (("N", 1), ("decoder_N", 0)):  # decoder_N 0: N
        if not least <= m[key] <= MAX_LAYERS:
            problems.append((key, f"must be in [{least}, {MAX_LAYERS}]"))
    for key in ("d_model", "d_ff", "h", "src_vocab", "tgt_vocab"):
        if key in m and not m[key] > 0:  # also refuses NaN
            problems.append((key, "must be > 0"))
    for key in ("dropout", "attn_dropout", "ff_dropout", "word_dropout"):
        if not 0 <= m[key] < 1:
            problems.append((key, "must be in [0, 1)"))
    if m["norm"] not in ("post", "pre"):
        problems.append(("norm", "is not one of post, pre"))
    if m["h"] > 0 and m["d_model"] % m["h"]:
        problems.append(("d_model", f"is not divisible by model.h = {m['h']}"))
    if m["d_model"] % 2:
        problems.append(("d_model", "must be even (sinusoidal positional encoding)"))
    if "pad" in m and not 0 <= m["pad"] < min(m["src_vocab"], m["tgt_vocab"]):
        problems.append(("pad", "must be a token id of both vocabularies"))
    return problems


# train keys added since checkpoints were first written, with the value that trains as those
# checkpoints' runs did: a run written before a key resumes, or joins an ensemble, under it.
ADDED_TRAIN_KEYS = {"ddp_bf16_grads": False, "pad_multiple": 1}


def training_params(params: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The params (as Params.to_dict() gives them) that a resumed run, or each member of an ensemble,
    must share: TRAIN_SECTIONS without train.members, since training sees one member at a time (and
    a file written before ensembles lacks it); a key of ADDED_TRAIN_KEYS that a file lacks has its value there."""
    train = ADDED_TRAIN_KEYS | {k: v for k, v in params["train"].items() if k != "members"}
    return {s: params[s] for s in TRAIN_SECTIONS} | {"train": train}


def flatten(params: Params) -> dict[str, Any]:
    """'section.key' -> value, for MLflow."""
    return {f"{s}.{k}": v for s, d in params.to_dict().items() for k, v in d.items()}
