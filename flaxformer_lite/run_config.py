"""Run configs (ml_collections, `configs/*.py`) -> typed, validated sections.

A run config has the sections `model` (fields of `TransformerConfig`), `data`,
`optim`, `train` and optionally `mesh`. `parse` turns one into a `RunConfig` of
frozen dataclasses, checking every field before any data is read: each bad
value raises `ConfigError` with one line naming the flag. Fields missing from a
config take the defaults below, which are those of configs/default.py.

How a section's fields are declared and checked is config_fields.py; the
optional sections that switch on a model variant (`scheduled_sampling`, `nat`,
`copy`) are variant_sections.py, whose names are importable from here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from flaxformer_lite.config import ConfigError, TransformerConfig, from_mapping
from flaxformer_lite.config_fields import (
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    SPLITS,  # noqa: F401  (a run-config constant, importable from here)
    boolean,
    field,
    int_at_least,
    number,
    one_of,
    section,
    split_name_map,
    string,
    strings,
)
from flaxformer_lite.variant_sections import (
    CopyConfig,
    NATConfig,
    ScheduledSamplingConfig,
    check_copy,
    check_guided_attention,
    check_nat,
    copy_of,
    guided_attention_of,
    nat_of,
    scheduled_sampling_of,  # noqa: F401  (other modules import it from here)
    scheduled_sampling_section,
)

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
    "wer": "min",
}
SCHEDULES = ("rsqrt", "constant", "cosine")
STATE_DTYPES = ("float32", "bfloat16")  # optim.state_dtype
VOCAB_MODEL_TYPES = ("unigram", "bpe", "char", "word")
SECTIONS = (
    "model",
    "data",
    "optim",
    "train",
    "mesh",
    "scheduled_sampling",
    "nat",
    "copy",
    "guided_attention",
)


# {parameter path: (shape, dtype name)}, e.g. {"encoder/layer_0/mlp/wi/kernel": ((512, 2048),
# "float32")}.
ParamShapes = dict[str, tuple[tuple[int, ...], str]]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`data`: which dataset, its vocabulary and how it is batched."""

    dataset: str = field("number_words", string)  # see flaxformer_lite/datasets.py
    tfds_dir: str = field("", string)
    languages: tuple[str, ...] = field(("en", "de", "fr"), strings)  # number_words
    max_number: int = field(9999, NON_NEGATIVE)  # number_words
    always_train_below: int = field(100, NON_NEGATIVE)  # number_words
    shape_balance: float = field(0.7, number(0.0, 1.0, high_open=False))  # number_words
    num_numbers: int = field(0, NON_NEGATIVE)  # number_words: 0 = all up to max_number
    seed: int = field(0, NON_NEGATIVE)  # number_words, tsv: the seeded split; names: the draws
    valid_fraction: float = field(0.05, FRACTION)  # number_words, tsv
    test_fraction: float = field(0.05, FRACTION)  # number_words, tsv
    names_train: int = field(20_000, POSITIVE)  # names: examples per split
    names_valid: int = field(500, NON_NEGATIVE)  # names
    names_test: int = field(1_000, NON_NEGATIVE)  # names
    speech_languages: tuple[str, ...] = field(("en",), strings)  # spoken_numbers
    speech_max_number: int = field(999, NON_NEGATIVE)  # spoken_numbers
    speech_numbers: int = field(0, NON_NEGATIVE)  # spoken_numbers: 0 = all up to the max
    speech_always_train_below: int = field(20, NON_NEGATIVE)  # spoken_numbers
    speech_utterances_per_number: int = field(4, POSITIVE)  # spoken_numbers: per language
    speech_target: str = field("words", one_of("words", "digits"))  # spoken_numbers
    num_mels: int = field(80, POSITIVE)  # spoken_numbers: log-mel channels per frame
    speech_synthesizer: str = field("espeak", one_of("espeak", "tones"))  # spoken_numbers
    corpus_dir: str = field("", string)  # parallel_text
    source_lang: str = field("", string)  # parallel_text, catalog
    target_lang: str = field("", string)  # parallel_text, catalog
    # parallel_text, tsv, catalog: our split name -> the corpus's
    split_names: Mapping[str, str] = field(None, split_name_map, default_factory=dict)
    tsv_path: str = field("", string)  # tsv
    source_column: int = field(0, NON_NEGATIVE)  # tsv
    target_column: int = field(1, NON_NEGATIVE)  # tsv
    vocab_size: int = field(256, int_at_least(2))
    shared_vocab: bool = field(True, boolean)
    target_vocab_size: int = field(0, NON_NEGATIVE)
    vocab_model_type: str = field("unigram", one_of(*VOCAB_MODEL_TYPES))
    max_source_len: int = field(10, int_at_least(2))
    max_target_len: int = field(16, int_at_least(2))
    batching: str = field("fixed", one_of(*BATCHINGS))
    max_tokens: int = field(0, NON_NEGATIVE)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """`optim`: the learning-rate schedule and AdamW."""

    schedule: str = field("cosine", one_of(*SCHEDULES))
    learning_rate: float = field(3e-3, number(0.0, low_open=True))
    warmup_steps: int = field(100, NON_NEGATIVE)
    b1: float = field(0.9, FRACTION)
    b2: float = field(0.98, FRACTION)
    eps: float = field(1e-9, number(0.0, low_open=True))
    weight_decay: float = field(0.0, number(0.0))
    grad_clip_norm: float = field(0.0, number(0.0))
    state_dtype: str = field("float32", one_of(*STATE_DTYPES))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """`train`: steps, batches, evaluation, checkpoints and logging."""

    seed: int = field(0, NON_NEGATIVE)
    batch_size: int = field(128, POSITIVE)
    grad_accum_steps: int = field(1, POSITIVE)
    num_steps: int = field(1000, POSITIVE)
    label_smoothing: float = field(0.1, FRACTION)
    log_every: int = field(50, POSITIVE)
    eval_every: int = field(500, NON_NEGATIVE)
    eval_max_batches: int = field(0, NON_NEGATIVE)
    eval_batch_size: int = field(256, POSITIVE)
    eval_search: str = field("greedy", one_of(*EVAL_SEARCHES))
    eval_beam_size: int = field(4, POSITIVE)
    eval_alpha: float = field(0.6, number(0.0))
    eval_bleu: bool = field(False, boolean)
    exposure_report: bool = field(True, boolean)
    checkpoint_every: int = field(500, NON_NEGATIVE)
    keep_checkpoints: int = field(3, POSITIVE)
    async_checkpoints: bool = field(True, boolean)
    keep_best_checkpoints: int = field(1, NON_NEGATIVE)
    best_metric: str = field("loss", one_of(*BEST_METRICS))
    early_stop_patience: int = field(0, NON_NEGATIVE)
    nonfinite: str = field("stop", one_of(*NONFINITE))
    nonfinite_max_skips: int = field(10, POSITIVE)
    hang_factor: float = field(20.0, number(0.0))
    hang_min_seconds: float = field(600.0, number(0.0, low_open=True))
    preemption_check_every: int = field(10, POSITIVE)
    num_examples_to_print: int = field(8, NON_NEGATIVE)
    progress_bar: bool = field(True, boolean)
    tensorboard: bool = field(True, boolean)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """`mesh`: devices for data x fsdp x model (see parallel/partitioning.py)."""

    fsdp: int = field(1, POSITIVE)
    model: int = field(1, POSITIVE)


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


def parse(config: ml_collections.ConfigDict) -> RunConfig:
    """The typed sections of a run config, every field and their consistency checked.

    Raises:
      ConfigError: one line naming the first bad flag and what it may be.
    """
    for name in ("model", "data", "optim", "train"):
        if name not in config:
            raise ConfigError(f"run config has no '{name}' section; start from configs/default.py")
    extra = sorted(set(config.keys()) - set(SECTIONS))
    if extra:
        raise ConfigError(
            f"run config has a section '{extra[0]}'; the sections are {', '.join(SECTIONS)}"
        )
    share_embeddings = model_config(config).share_embeddings  # checks the model's fields
    data = section(DataConfig, "data", config.data)
    optim = section(OptimConfig, "optim", config.optim)
    train = section(TrainConfig, "train", config.train)
    mesh = section(MeshConfig, "mesh", config.mesh if "mesh" in config else {})
    sampling = scheduled_sampling_section(config)
    _check_dataset(data)
    _check_vocabularies(data, share_embeddings)
    model = planned_model_config(config)
    if data.dataset == "spoken_numbers" and data.batching == "pack":
        raise ConfigError(
            "data.batching=pack puts several token sources in a row; speech features batch "
            "with --config.data.batching=bucket (or fixed)"
        )
    if data.dataset == "spoken_numbers" and model.input_features != data.num_mels:
        raise ConfigError(
            f"model.input_features={model.input_features} but data.dataset=spoken_numbers gives "
            f"data.num_mels={data.num_mels} features per frame: set "
            f"--config.model.input_features={data.num_mels}"
        )
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
    if model.subsampling_layers and data.batching == "pack":
        raise ConfigError(
            "data.batching='pack' puts several examples in a row, but model.subsampling_layers "
            "convolves across them: use --config.data.batching=bucket or fixed"
        )
    nat = nat_of(config)
    if nat is not None and model.subsampling_layers:
        raise ConfigError(
            "model.subsampling_layers is not supported by the nat model (it reads one encoder "
            "position per input frame): set it to 0 or drop the nat section"
        )
    if nat is not None:
        check_nat(nat, model, data, train, sampling)
    copy = copy_of(config)
    if copy is not None:
        check_copy(copy, model, data, sampling, nat)
    check_guided_attention(guided_attention_of(config), model, sampling, nat, copy)
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


def validate(config: ml_collections.ConfigDict, *, platform: bool = True) -> None:
    """Checks what can be checked before any data is read (see `parse`), and that a kernel
    forced by `model.attention_impl` exists on this platform. `platform=False` leaves
    the platform's part out and never touches JAX's backends (before a multi-process
    job is joined). Raises ConfigError."""
    from flaxformer_lite.nn import kernels

    if not platform:
        with kernels.platform_unknown():
            parse(config)
        return
    parse(config)
    kernels.check_platform(config.model.attention_impl)


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
    if d.dataset == "spoken_numbers":
        _check_spoken_numbers(d)
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
    held_out = d.valid_fraction + d.test_fraction
    if d.dataset in ("number_words", "spoken_numbers", "tsv") and held_out >= 1.0:
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
    if d.dataset not in ("number_words", "names", "spoken_numbers", "tsv"):
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


def _check_spoken_numbers(d: DataConfig) -> None:
    from num2words import CONVERTER_CLASSES

    if not d.speech_languages or len(set(d.speech_languages)) != len(d.speech_languages):
        raise ConfigError(
            f"data.speech_languages={tuple(d.speech_languages)} must name distinct languages, "
            "e.g. --config.data.speech_languages=\"('en','de')\""
        )
    for lang in d.speech_languages:
        if lang not in CONVERTER_CLASSES:
            raise ConfigError(
                f"data.speech_languages has {lang!r}, which num2words cannot spell; use "
                "espeak-ng voices num2words knows, e.g. en, de, fr"
            )
    low = min(d.speech_always_train_below, d.speech_max_number + 1)
    if d.speech_numbers > d.speech_max_number + 1 - low:
        raise ConfigError(
            f"data.speech_numbers={d.speech_numbers} is more than there are numbers from "
            f"data.speech_always_train_below={d.speech_always_train_below} to "
            f"data.speech_max_number={d.speech_max_number}: lower it, or 0 for all of them"
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
    d = section(DataConfig, "data", config.data)
    target = 0 if d.shared_vocab else d.target_vocab_size
    return model_config(config, d.vocab_size, target or None)


def to_saved_dict(config: ml_collections.ConfigDict, model: TransformerConfig) -> dict[str, Any]:
    """JSON-friendly run config with the resolved model config (as saved in a workdir)."""
    out = config.to_dict()
    out["model"] = model.to_dict()
    if config.model.get("dtype") == "auto":  # the platform's, wherever the workdir is read
        out["model"]["dtype"] = "auto"
    return _jsonable(out)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
