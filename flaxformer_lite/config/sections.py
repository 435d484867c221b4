"""The run config's main sections: `data`, `optim`, `train` and `mesh`.

Each section is a frozen dataclass whose fields carry their checks (`fields.py`):
`run.parse` builds them from a run config, and the defaults here are the only ones
(configs/*.py set only what differs). The `model` section is `TransformerConfig`
(model.py); the optional variant sections are variants.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from flaxformer_lite.config.fields import (
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    boolean,
    field,
    int_at_least,
    number,
    one_of,
    split_name_map,
    string,
    strings,
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
