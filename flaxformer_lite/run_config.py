"""Run configs (ml_collections, `configs/*.py`) -> typed, validated sections.

A run config has the sections `model` (fields of `TransformerConfig`), `data`,
`optim`, `train` and optionally `mesh`. `parse` turns one into a `RunConfig` of
frozen dataclasses, checking every field before any data is read: each bad
value raises `ConfigError` with one line naming the flag. Fields missing from a
config take the defaults below, which are those of configs/default.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from flaxformer_lite.config import ConfigError, TransformerConfig, from_mapping
from flaxformer_lite.objectives import scheduled_sampling

BATCHINGS = ("fixed", "bucket", "pack")
EVAL_SEARCHES = ("greedy", "beam")
NONFINITE = ("stop", "skip")
# Validation metrics that can rank checkpoints, and whether lower is better.
BEST_METRICS = {
    "loss": "min",
    "nll": "min",
    "perplexity": "min",
    "token_accuracy": "max",
    "teacher_forced_sequence_accuracy": "max",
    "exact_match": "max",
    "bleu": "max",
    "chrf": "max",
}
SCHEDULES = ("rsqrt", "constant", "cosine")
VOCAB_MODEL_TYPES = ("unigram", "bpe", "char", "word")
SPLITS = ("train", "validation", "test")
SECTIONS = ("model", "data", "optim", "train", "mesh", "scheduled_sampling", "nat", "copy")


# {parameter path: (shape, dtype name)}, e.g. {"encoder/layer_0/mlp/wi/kernel": ((512, 2048),
# "float32")}.
ParamShapes = dict[str, tuple[tuple[int, ...], str]]


# Checks: (flag, value) -> an error line, or None when the value is fine.
Check = Callable[[str, Any], "str | None"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_at_least(low: int) -> Check:
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
    return lambda flag, v: None if _is_int(v) and v >= low else f"{flag} must be {what}, got {v!r}"


def _number(low: float, high: float | None = None, *, low_open=False, high_open=True) -> Check:
    lo, hi = "(" if low_open else "[", ")" if high_open else "]"
    interval = f"{lo}{low:g}, {'inf' if high is None else f'{high:g}'}{hi}"

    def check(flag, v):
        ok = _is_number(v) and (v > low if low_open else v >= low)
        if ok and high is not None:
            ok = v < high if high_open else v <= high
        return None if ok else f"{flag} must be a number in {interval}, got {v!r}"

    return check


def _one_of(*choices: str) -> Check:
    return lambda flag, v: (
        None if v in choices else f"{flag}={v!r} is not one of {', '.join(choices)}"
    )


def _boolean(flag, v):
    return None if isinstance(v, bool) else f"{flag} must be True or False, got {v!r}"


def _string(flag, v):
    return None if isinstance(v, str) else f"{flag} must be a string, got {v!r}"


def _strings(flag, v):
    if isinstance(v, (tuple, list)) and v and all(isinstance(s, str) and s for s in v):
        return None
    return f"{flag} must be a non-empty tuple of strings, e.g. ('en', 'de'), got {v!r}"


def _split_names(flag, v):
    if not isinstance(v, Mapping) or not all(isinstance(s, str) for s in v.values()):
        return f"{flag} must map split names to the corpus's own, got {v!r}"
    unknown = sorted(set(v) - set(SPLITS))
    if unknown:
        return f"{flag} has key {unknown[0]!r}; its keys are {', '.join(SPLITS)}"
    return None


POSITIVE, NON_NEGATIVE, FRACTION = _int_at_least(1), _int_at_least(0), _number(0.0, 1.0)


def _field(default, check: Check, default_factory=None):
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"check": check})
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`data`: which dataset, its vocabulary and how it is batched."""

    dataset: str = _field("number_words", _string)  # see flaxformer_lite/datasets.py
    tfds_dir: str = _field("", _string)
    languages: tuple[str, ...] = _field(("en", "de", "fr"), _strings)  # number_words
    max_number: int = _field(9999, NON_NEGATIVE)  # number_words
    always_train_below: int = _field(100, NON_NEGATIVE)  # number_words
    shape_balance: float = _field(0.7, _number(0.0, 1.0, high_open=False))  # number_words
    num_numbers: int = _field(0, NON_NEGATIVE)  # number_words: 0 = all up to max_number
    seed: int = _field(0, NON_NEGATIVE)  # number_words, tsv: the seeded split; names: the draws
    valid_fraction: float = _field(0.05, FRACTION)  # number_words, tsv
    test_fraction: float = _field(0.05, FRACTION)  # number_words, tsv
    names_train: int = _field(20_000, POSITIVE)  # names: examples per split
    names_valid: int = _field(500, NON_NEGATIVE)  # names
    names_test: int = _field(1_000, NON_NEGATIVE)  # names
    corpus_dir: str = _field("", _string)  # parallel_text
    source_lang: str = _field("", _string)  # parallel_text, catalog
    target_lang: str = _field("", _string)  # parallel_text, catalog
    # parallel_text, tsv, catalog: our split name -> the corpus's
    split_names: Mapping[str, str] = _field(None, _split_names, default_factory=dict)
    tsv_path: str = _field("", _string)  # tsv
    source_column: int = _field(0, NON_NEGATIVE)  # tsv
    target_column: int = _field(1, NON_NEGATIVE)  # tsv
    vocab_size: int = _field(256, _int_at_least(2))
    shared_vocab: bool = _field(True, _boolean)
    target_vocab_size: int = _field(0, NON_NEGATIVE)
    vocab_model_type: str = _field("unigram", _one_of(*VOCAB_MODEL_TYPES))
    max_source_len: int = _field(10, _int_at_least(2))
    max_target_len: int = _field(16, _int_at_least(2))
    batching: str = _field("fixed", _one_of(*BATCHINGS))
    max_tokens: int = _field(0, NON_NEGATIVE)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """`optim`: the learning-rate schedule and AdamW."""

    schedule: str = _field("cosine", _one_of(*SCHEDULES))
    learning_rate: float = _field(3e-3, _number(0.0, low_open=True))
    warmup_steps: int = _field(100, NON_NEGATIVE)
    b1: float = _field(0.9, FRACTION)
    b2: float = _field(0.98, FRACTION)
    eps: float = _field(1e-9, _number(0.0, low_open=True))
    weight_decay: float = _field(0.0, _number(0.0))
    grad_clip_norm: float = _field(0.0, _number(0.0))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """`train`: steps, batches, evaluation, checkpoints and logging."""

    seed: int = _field(0, NON_NEGATIVE)
    batch_size: int = _field(128, POSITIVE)
    grad_accum_steps: int = _field(1, POSITIVE)
    num_steps: int = _field(1000, POSITIVE)
    label_smoothing: float = _field(0.1, FRACTION)
    log_every: int = _field(50, POSITIVE)
    eval_every: int = _field(500, NON_NEGATIVE)
    eval_max_batches: int = _field(0, NON_NEGATIVE)
    eval_batch_size: int = _field(256, POSITIVE)
    eval_search: str = _field("greedy", _one_of(*EVAL_SEARCHES))
    eval_beam_size: int = _field(4, POSITIVE)
    eval_alpha: float = _field(0.6, _number(0.0))
    eval_bleu: bool = _field(False, _boolean)
    exposure_report: bool = _field(True, _boolean)
    checkpoint_every: int = _field(500, NON_NEGATIVE)
    keep_checkpoints: int = _field(3, POSITIVE)
    keep_best_checkpoints: int = _field(1, NON_NEGATIVE)
    best_metric: str = _field("loss", _one_of(*BEST_METRICS))
    early_stop_patience: int = _field(0, NON_NEGATIVE)
    nonfinite: str = _field("stop", _one_of(*NONFINITE))
    nonfinite_max_skips: int = _field(10, POSITIVE)
    hang_factor: float = _field(20.0, _number(0.0))
    hang_min_seconds: float = _field(600.0, _number(0.0, low_open=True))
    num_examples_to_print: int = _field(8, NON_NEGATIVE)
    progress_bar: bool = _field(True, _boolean)
    tensorboard: bool = _field(True, _boolean)


@dataclasses.dataclass(frozen=True)
class ScheduledSamplingConfig:
    """`scheduled_sampling` (optional section): see objectives/scheduled_sampling.py."""

    mode: str = _field("off", _one_of(*scheduled_sampling.MODES))
    schedule: str = _field("linear", _one_of(*scheduled_sampling.SCHEDULES))
    k: float = _field(1.0, _number(0.0, low_open=True))
    c: float = _field(1e-4, _number(0.0))
    eps_min: float = _field(0.0, _number(0.0, 1.0, high_open=False))
    warmup_steps: int = _field(0, NON_NEGATIVE)
    temperature: float = _field(1.0, _number(0.0, low_open=True))
    gradient: str = _field("last", _one_of(*scheduled_sampling.GRADIENTS))
    passes: int = _field(2, _int_at_least(2))


@dataclasses.dataclass(frozen=True)
class NATConfig:
    """`nat` (optional section): a run config with it trains the non-autoregressive model
    (models/non_autoregressive.py); `iterations` and `length_beam` are evaluation's."""

    length_mode: str = _field("predict", _one_of("predict", "fixed"))
    length_classes: int = _field(256, _int_at_least(2))
    length_loss_weight: float = _field(0.1, _number(0.0))
    length_stop_gradient: bool = _field(False, _boolean)
    decoder_inputs: str = _field("mask", _one_of("mask", "copy"))
    masking: str = _field("uniform", _one_of("uniform", "all"))
    iterations: int = _field(10, POSITIVE)
    length_beam: int = _field(1, POSITIVE)


def _head_indices(flag, v):
    if isinstance(v, (tuple, list)) and all(_is_int(h) and h >= 0 for h in v):
        return None
    return f"{flag} must be a tuple of head indices >= 0 (empty: all heads), got {v!r}"


@dataclasses.dataclass(frozen=True)
class CopyConfig:
    """`copy` (optional section): a run config with it trains the pointer-generator head
    (models/pointer_generator.py) on extended ids (data/extended_ids.py)."""

    layer: int = _field(-1, lambda flag, v: None if _is_int(v) else f"{flag} must be an integer")
    heads: tuple[int, ...] = _field((), _head_indices)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """`mesh`: devices for data x fsdp x model (see parallel/partitioning.py)."""

    fsdp: int = _field(1, POSITIVE)
    model: int = _field(1, POSITIVE)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A checked run config. `model` has the vocabulary sizes asked for in `data`."""

    model: TransformerConfig
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig
    mesh: MeshConfig
    scheduled_sampling: ScheduledSamplingConfig
    nat: NATConfig | None  # None: the autoregressive model
    copy: CopyConfig | None = None  # None: the plain softmax output


def _plain(value):
    """ConfigDict values as plain Python: nested dicts, lists as tuples."""
    if isinstance(value, (ml_collections.ConfigDict, Mapping)):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(value)
    return value


def _section(cls, name: str, values: Mapping[str, Any]):
    """Builds dataclass `cls` from `values`, checking every field; missing ones take defaults."""
    fields = dataclasses.fields(cls)
    unknown = sorted(set(values) - {f.name for f in fields})
    if unknown:
        raise ConfigError(
            f"{name}.{unknown[0]} is not a {name} field; the fields are "
            + ", ".join(f.name for f in fields)
        )
    kwargs = {}
    for f in fields:
        if f.name in values:
            value = _plain(values[f.name])
        else:
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if _is_int(value) and f.type == "float":
            value = float(value)
        message = f.metadata["check"](f"{name}.{f.name}", value)
        if message:
            raise ConfigError(message)
        kwargs[f.name] = value
    return cls(**kwargs)


def parse(config: ml_collections.ConfigDict) -> RunConfig:
    """The typed sections of a run config, every field and their consistency checked.

    Raises:
      ConfigError: one line naming the first bad flag and what it may be.
    """
    for section in ("model", "data", "optim", "train"):
        if section not in config:
            raise ConfigError(
                f"run config has no '{section}' section; start from configs/default.py"
            )
    extra = sorted(set(config.keys()) - set(SECTIONS))
    if extra:
        raise ConfigError(
            f"run config has a section '{extra[0]}'; the sections are {', '.join(SECTIONS)}"
        )
    share_embeddings = model_config(config).share_embeddings  # checks the model's fields
    data = _section(DataConfig, "data", config.data)
    optim = _section(OptimConfig, "optim", config.optim)
    train = _section(TrainConfig, "train", config.train)
    mesh = _section(MeshConfig, "mesh", config.mesh if "mesh" in config else {})
    sampling = _scheduled_sampling_section(config)
    _check_dataset(data)
    _check_vocabularies(data, share_embeddings)
    model = planned_model_config(config)
    if model.positions == "learned" and max(data.max_source_len, data.max_target_len) > (
        model.max_len
    ):
        raise ConfigError(
            f"model.max_len={model.max_len} is shorter than data.max_source_len="
            f"{data.max_source_len} / data.max_target_len={data.max_target_len}, but learned "
            "positions have one row per position: raise model.max_len"
        )
    if train.batch_size % train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={train.grad_accum_steps} must divide "
            f"train.batch_size={train.batch_size}"
        )
    if train.best_metric in ("bleu", "chrf") and not train.eval_bleu:
        raise ConfigError(
            f"train.best_metric={train.best_metric!r} is computed only with "
            "--config.train.eval_bleu=True; set it, or rank checkpoints by loss or exact_match"
        )
    if train.early_stop_patience and not train.eval_every:
        raise ConfigError(
            f"train.early_stop_patience={train.early_stop_patience} counts validation "
            "evaluations, but train.eval_every=0 evaluates only at the end: set "
            "--config.train.eval_every"
        )
    if optim.schedule == "rsqrt" and optim.warmup_steps == 0:
        raise ConfigError(
            "optim.warmup_steps=0, but the rsqrt schedule divides by it: use warmup_steps >= 1 "
            "or another optim.schedule"
        )
    nat = nat_of(config)
    if nat is not None:
        _check_nat(nat, model, data, train, sampling)
    copy = copy_of(config)
    if copy is not None:
        _check_copy(copy, model, data, sampling, nat)
    return RunConfig(
        model=model,
        data=data,
        optim=optim,
        train=train,
        mesh=mesh,
        scheduled_sampling=sampling,
        nat=nat,
        copy=copy,
    )


def copy_of(config: ml_collections.ConfigDict | Mapping) -> CopyConfig | None:
    """The `copy` section of a run config (or of a workdir's saved one); None: no copy head."""
    if "copy" not in config or config["copy"] is None:
        return None
    return _section(CopyConfig, "copy", config["copy"])


def _check_copy(copy, model, data, sampling, nat) -> None:
    layers, heads = model.num_decoder_layers, model.num_heads
    if not -layers <= copy.layer < layers:
        raise ConfigError(
            f"copy.layer={copy.layer} names no decoder layer: the model has {layers} "
            f"(use 0..{layers - 1}, or -1 for the last)"
        )
    if any(h >= heads for h in copy.heads):
        raise ConfigError(
            f"copy.heads={tuple(copy.heads)} names a head the model lacks: it has {heads} "
            f"(use indices 0..{heads - 1}, or () for all)"
        )
    if nat is not None:
        raise ConfigError(
            "the copy head extends the autoregressive decoder, but this run config also has a "
            "nat section: drop one of them"
        )
    if model.input_features:
        raise ConfigError(
            "the copy head copies source tokens, but model.input_features reads features: "
            "drop the copy section or use token inputs"
        )
    if not data.shared_vocab:
        raise ConfigError(
            "the copy head emits a source token by its id, which needs one vocabulary for both "
            "sides: set --config.data.shared_vocab=True and --config.model.share_embeddings=True"
        )
    if data.batching == "pack":
        raise ConfigError(
            "data.batching='pack' puts several examples in a row, but extended ids are numbered "
            "per example: use --config.data.batching=bucket or fixed with the copy head"
        )
    if sampling.mode != "off":
        raise ConfigError(
            f"scheduled_sampling.mode={sampling.mode!r} is not supported with the copy head "
            "(its fed predictions would need extended ids): drop one of them"
        )


def nat_of(config: ml_collections.ConfigDict) -> NATConfig | None:
    """The `nat` section of a run config (None: it trains the autoregressive model)."""
    if "nat" not in config or config.nat is None:
        return None
    return _section(NATConfig, "nat", config.nat)


def _check_nat(nat, model, data, train, sampling) -> None:
    if sampling.mode != "off":
        raise ConfigError(
            f"scheduled_sampling.mode={sampling.mode!r} feeds an autoregressive decoder its "
            "own predictions, but this run config has a nat section: drop one of them"
        )
    if data.batching == "pack":
        raise ConfigError(
            "data.batching='pack' puts several examples in a row, but the non-autoregressive "
            "decoder reads one per row: use --config.data.batching=bucket or fixed"
        )
    if train.exposure_report:
        raise ConfigError(
            "train.exposure_report compares teacher forcing with autoregressive decoding, "
            "which a nat run has not: set --config.train.exposure_report=False"
        )
    if nat.decoder_inputs == "copy" and model.input_features:
        raise ConfigError(
            "nat.decoder_inputs='copy' copies source token embeddings, but the encoder reads "
            "features: use nat.decoder_inputs='mask'"
        )
    if nat.length_mode == "fixed" and nat.length_beam > 1:
        raise ConfigError(
            f"nat.length_beam={nat.length_beam} decodes several predicted lengths, but "
            "nat.length_mode='fixed' has one: set length_beam=1 or length_mode='predict'"
        )


def _scheduled_sampling_section(config: ml_collections.ConfigDict) -> ScheduledSamplingConfig:
    values = config.scheduled_sampling if "scheduled_sampling" in config else {}
    s = _section(ScheduledSamplingConfig, "scheduled_sampling", values)
    if s.schedule == "exponential" and not s.k < 1.0:
        raise ConfigError(
            f"scheduled_sampling.k={s.k} with the exponential schedule k**i never decays: "
            "use 0 < k < 1, e.g. 0.999"
        )
    if s.schedule == "inverse_sigmoid" and s.k < 1.0:
        raise ConfigError(
            f"scheduled_sampling.k={s.k}: the inverse sigmoid k / (k + exp(i / k)) needs "
            "k >= 1 (the step where eps is 0.5 grows with k), e.g. 500"
        )
    if s.gradient == "all" and s.mode in ("argmax", "sample"):
        raise ConfigError(
            f"scheduled_sampling.gradient='all' passes gradients through the fed predictions, "
            f"but mode={s.mode!r} feeds discrete tokens, which have none: use mode='soft' or "
            "gradient='last'"
        )
    return s


def scheduled_sampling_of(
    config: ml_collections.ConfigDict,
) -> scheduled_sampling.ScheduledSampling:
    """The model's scheduled-sampling settings of a run config (off when it has none)."""
    section = _scheduled_sampling_section(config)
    return scheduled_sampling.ScheduledSampling(**dataclasses.asdict(section))


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks what can be checked before any data is read (see `parse`). Raises ConfigError."""
    parse(config)


def _check_dataset(d: DataConfig) -> None:
    """The fields the selected dataset reads (see flaxformer_lite/datasets.py)."""
    if not d.dataset:
        raise ConfigError(
            "data.dataset is empty; name number_words, parallel_text, tsv or a TFDS catalog "
            "dataset such as wmt14_translate/de-en"
        )
    if d.dataset == "number_words":
        from num2words import CONVERTER_CLASSES

        for lang in d.languages:
            if lang not in CONVERTER_CLASSES:
                raise ConfigError(
                    f"data.languages has {lang!r}, which num2words cannot spell; choose from "
                    + ", ".join(sorted(CONVERTER_CLASSES))
                )
    if (
        d.dataset == "number_words"
        and d.always_train_below > d.max_number
        and d.valid_fraction + d.test_fraction > 0
    ):
        raise ConfigError(
            f"data.always_train_below={d.always_train_below} keeps every number up to "
            f"data.max_number={d.max_number} in train, leaving none to hold out: lower it "
            "(0: any number may be held out)"
        )
    if d.dataset == "number_words" and d.num_numbers > d.max_number + 1 - min(
        d.always_train_below, d.max_number + 1
    ):
        raise ConfigError(
            f"data.num_numbers={d.num_numbers} is more than there are numbers from "
            f"data.always_train_below={d.always_train_below} to data.max_number={d.max_number}:"
            " lower it, or 0 for all of them"
        )
    if d.dataset in ("number_words", "tsv") and d.valid_fraction + d.test_fraction >= 1.0:
        raise ConfigError(
            f"data.valid_fraction={d.valid_fraction} + data.test_fraction={d.test_fraction} "
            "leave no training examples; keep their sum below 1"
        )
    if d.dataset == "parallel_text" and not d.corpus_dir:
        raise ConfigError(
            "data.corpus_dir is empty; data.dataset=parallel_text reads {split}.{lang} files "
            "from it"
        )
    if d.dataset == "tsv":
        if not d.tsv_path:
            raise ConfigError("data.tsv_path is empty; data.dataset=tsv reads pairs from it")
        if d.source_column == d.target_column:
            raise ConfigError(
                f"data.source_column and data.target_column are both {d.source_column}; "
                "the source and the target must be different columns"
            )
    if d.dataset not in ("number_words", "names", "tsv"):
        for name in ("source_lang", "target_lang"):
            if not getattr(d, name):
                raise ConfigError(
                    f"data.{name} is empty; data.dataset={d.dataset!r} needs the language "
                    "of each side, e.g. --config.data.source_lang=en"
                )
        if d.source_lang == d.target_lang:
            raise ConfigError(
                f"data.source_lang and data.target_lang are both {d.source_lang!r}; "
                "translation needs two languages"
            )


def _check_vocabularies(d: DataConfig, share_embeddings: bool) -> None:
    if d.target_vocab_size == 1:
        raise ConfigError(
            "data.target_vocab_size must be 0 (same as data.vocab_size) or an integer >= 2, got 1"
        )
    if d.shared_vocab and d.target_vocab_size not in (0, d.vocab_size):
        raise ConfigError(
            f"data.target_vocab_size={d.target_vocab_size} needs separate vocabularies: set "
            "--config.data.shared_vocab=False (and --config.model.share_embeddings=False)"
        )
    if not d.shared_vocab and share_embeddings:
        raise ConfigError(
            "data.shared_vocab=False gives the source and the target their own vocabularies, "
            "which cannot share one embedding table: set --config.model.share_embeddings=False"
        )


def model_config(
    config: ml_collections.ConfigDict,
    vocab_size: int | None = None,
    target_vocab_size: int | None = None,
    **overrides,
) -> TransformerConfig:
    """The model config of a run.

    `vocab_size` and `target_vocab_size` (from the trained vocabularies; the
    latter None when one vocabulary is shared) override the config's.
    """
    values = dict(config.model.to_dict())
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
        values["target_vocab_size"] = target_vocab_size
    values.update(overrides)
    return from_mapping(values)


def planned_model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
    """The model a run will build before its vocabularies exist: the vocabulary sizes are
    the ones asked for in `data` (SentencePiece may return fewer pieces for small data)."""
    d = _section(DataConfig, "data", config.data)
    target = 0 if d.shared_vocab else d.target_vocab_size
    return model_config(config, d.vocab_size, target or None)


def to_saved_dict(config: ml_collections.ConfigDict, model: TransformerConfig) -> dict[str, Any]:
    """JSON-friendly run config with the resolved model config (as saved in a workdir)."""
    out = config.to_dict()
    out["model"] = model.to_dict()
    return _jsonable(out)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
