"""The run config's main sections: `data`, `optim`, `train` and `mesh`.

Each section is a frozen dataclass whose fields carry their checks (`fields.py`):
`run.parse` builds them from a run config, and the defaults here are the only ones
(configs/*.py set only what differs). The `model` section is `TransformerConfig`
(model.py); each dataset's section nested in `data` is dataset_options.py; the optional
variant sections are variants.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from flaxformer_lite.config.dataset_options import (
    Names,
    NumberWords,
    ParallelText,
    SpokenNumbers,
    Tsv,
)
from flaxformer_lite.config.errors import ConfigError
from flaxformer_lite.config.fields import (
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    boolean,
    field,
    int_at_least,
    number,
    one_of,
    section,
    split_name_map,
    string,
    subsection,
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
    "bleu_tok": "max",
    "chrf": "max",
    "wer": "min",
}
SCHEDULES = ("rsqrt", "constant", "cosine")
STATE_DTYPES = ("float32", "bfloat16")  # optim.state_dtype
VOCAB_MODEL_TYPES = ("unigram", "bpe", "char", "word")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`data`: which dataset and its options, its vocabulary and how it is batched.

    Each dataset's own options are a section nested here under its name (dataset_options.py,
    e.g. `data.tsv.path`); the fields here are read by every dataset, or by several.
    """

    # number_words | names | spoken_numbers | parallel_text | tsv | a TFDS catalog name such
    # as "wmt14_translate/de-en" (flaxformer_lite/datasets.py)
    dataset: str = field("number_words", string)
    # where TFDS prepares data; "": $TFDS_DATA_DIR, else ~/tensorflow_datasets
    tfds_dir: str = field("", string)
    # the seed of the train/validation/test assignment of number_words, spoken_numbers (by
    # number) and tsv, and of the names drawn by names (not of training: train.seed)
    seed: int = field(0, NON_NEGATIVE)
    valid_fraction: float = field(0.05, FRACTION)  # share of pairs held out for validation
    test_fraction: float = field(0.05, FRACTION)  # share held out for the final test
    # parallel_text and TFDS catalog datasets: the file suffix or catalog feature of the
    # source, e.g. "en"
    source_lang: str = field("", string)
    target_lang: str = field("", string)  # the same for the target, e.g. "de"
    # parallel_text, tsv and catalog: the corpus's names for our splits, e.g. {"validation":
    # "val"}; a split not named here is looked up under its own name.
    split_names: Mapping[str, str] = field(None, split_name_map, default_factory=dict)
    number_words: NumberWords = subsection(NumberWords)
    names: Names = subsection(Names)
    spoken_numbers: SpokenNumbers = subsection(SpokenNumbers)
    parallel_text: ParallelText = subsection(ParallelText)
    tsv: Tsv = subsection(Tsv)
    # SentencePiece vocabulary size (the shared, or the source, one)
    vocab_size: int = field(256, int_at_least(2))
    shared_vocab: bool = field(True, boolean)  # one vocabulary for both sides; False: one per side
    # target vocabulary size when not shared (0: data.vocab_size)
    target_vocab_size: int = field(0, NON_NEGATIVE)
    # SentencePiece model: unigram | bpe | char | word
    vocab_model_type: str = field("unigram", one_of(*VOCAB_MODEL_TYPES))
    max_source_len: int = field(10, int_at_least(2))  # source tokens incl. EOS (longer are cut)
    max_target_len: int = field(16, int_at_least(2))  # target tokens incl. EOS
    # fixed (max shapes) | bucket (length buckets) | pack (several examples per row)
    batching: str = field("fixed", one_of(*BATCHINGS))
    # bucket: tokens per batch instead of train.batch_size rows (0: rows)
    max_tokens: int = field(0, NON_NEGATIVE)


# Where the `data` fields of earlier versions live now: run_config.json files saved before
# each dataset had its own section are read through this (`moved_data_fields`).
MOVED_DATA_FIELDS = {
    "languages": "number_words.languages",
    "max_number": "number_words.max_number",
    "always_train_below": "number_words.always_train_below",
    "shape_balance": "number_words.shape_balance",
    "num_numbers": "number_words.num_numbers",
    "names_train": "names.train",
    "names_valid": "names.valid",
    "names_test": "names.test",
    "speech_languages": "spoken_numbers.languages",
    "speech_max_number": "spoken_numbers.max_number",
    "speech_numbers": "spoken_numbers.numbers",
    "speech_always_train_below": "spoken_numbers.always_train_below",
    "speech_utterances_per_number": "spoken_numbers.utterances_per_number",
    "speech_target": "spoken_numbers.target",
    "num_mels": "spoken_numbers.num_mels",
    "speech_synthesizer": "spoken_numbers.synthesizer",
    "corpus_dir": "parallel_text.corpus_dir",
    "tsv_path": "tsv.path",
    "source_column": "tsv.source_column",
    "target_column": "tsv.target_column",
}


def data_section(values: Mapping) -> DataConfig:
    """The `data` section of a run config, checked; a field of an earlier version that moved
    into its dataset's section is refused with where it went."""
    moved = [name for name in values if name in MOVED_DATA_FIELDS]
    if moved:
        raise ConfigError(
            f"data.{moved[0]} is now data.{MOVED_DATA_FIELDS[moved[0]]}: set "
            f"--config.data.{MOVED_DATA_FIELDS[moved[0]]}"
        )
    return section(DataConfig, "data", values)


def moved_data_fields(values: Mapping) -> dict:
    """A saved `data` section with the flat fields of earlier versions moved into their
    dataset's section (`MOVED_DATA_FIELDS`); a section already nested is kept as it is."""
    out = {k: v for k, v in values.items() if k not in MOVED_DATA_FIELDS}
    for old, new in MOVED_DATA_FIELDS.items():
        if old in values:
            name, key = new.split(".")
            nested = out[name] = dict(out.get(name) or {})
            if key in nested:
                raise ConfigError(f"the saved data section has both data.{old} and data.{new}")
            nested[key] = values[old]
    return out


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """`optim`: the learning-rate schedule and AdamW."""

    # rsqrt (the paper's, §5.3) | constant | cosine (to 0: short runs end sharp)
    schedule: str = field("cosine", one_of(*SCHEDULES))
    # rsqrt: a multiplier of the paper's rate; else the peak rate
    learning_rate: float = field(3e-3, number(0.0, low_open=True))
    warmup_steps: int = field(100, NON_NEGATIVE)  # linear warm-up steps
    b1: float = field(0.9, FRACTION)  # Adam beta1
    b2: float = field(0.98, FRACTION)  # Adam beta2 (§5.3)
    eps: float = field(1e-9, number(0.0, low_open=True))  # Adam epsilon
    weight_decay: float = field(0.0, number(0.0))  # decoupled weight decay (AdamW) when > 0
    grad_clip_norm: float = field(0.0, number(0.0))  # global-norm clipping when > 0
    # Adam's moments and update math: float32 | bfloat16 (halves their memory)
    state_dtype: str = field("float32", one_of(*STATE_DTYPES))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """`train`: steps, batches, evaluation, checkpoints and logging."""

    seed: int = field(0, NON_NEGATIVE)  # parameter init and dropout (the data's: data.seed)
    batch_size: int = field(128, POSITIVE)  # examples per step
    # split each batch into this many sequential micro-batches
    grad_accum_steps: int = field(1, POSITIVE)
    num_steps: int = field(1000, POSITIVE)  # total optimiser steps
    # eps_ls of §5.4: hurts perplexity, helps accuracy and BLEU
    label_smoothing: float = field(0.1, FRACTION)
    log_every: int = field(50, POSITIVE)  # steps between train-metric records
    # steps between validation evaluations (0: only at the end)
    eval_every: int = field(500, NON_NEGATIVE)
    # batches per intermediate evaluation (0: the whole split)
    eval_max_batches: int = field(0, NON_NEGATIVE)
    eval_batch_size: int = field(256, POSITIVE)  # examples per evaluation batch
    eval_search: str = field("greedy", one_of(*EVAL_SEARCHES))  # decoding for evaluation
    eval_beam_size: int = field(4, POSITIVE)  # beams when eval_search is beam
    eval_alpha: float = field(0.6, number(0.0))  # GNMT length penalty of beam search
    # also report sacreBLEU and chrF; with data.target_lang, also bleu_tok (the BLEU4 on
    # lowercased Moses-tokenized text that Multi30k papers publish)
    eval_bleu: bool = field(False, boolean)
    # Exposure-bias report with every evaluation (eb_* metrics, a table at the end): TF vs
    # greedy accuracy, first errors, prefix swaps; one argmax + 5 scoring passes per batch.
    exposure_report: bool = field(True, boolean)
    checkpoint_every: int = field(500, NON_NEGATIVE)  # steps between checkpoints
    keep_checkpoints: int = field(3, POSITIVE)  # most recent checkpoints kept
    # Checksums, write and read-back of a checkpoint on a background thread (one process);
    # the step path only copies the state to host memory. False: all of it between steps.
    async_checkpoints: bool = field(True, boolean)
    # also kept: the best by the validation best_metric (0: none)
    keep_best_checkpoints: int = field(1, NON_NEGATIVE)
    # the validation metric ranking checkpoints: loss, exact_match, bleu, ...
    best_metric: str = field("loss", one_of(*BEST_METRICS))
    # stop after this many evaluations without a new best (0: never)
    early_stop_patience: int = field(0, NON_NEGATIVE)
    # a non-finite loss or gradient: stop | skip (the update; stop after nonfinite_max_skips)
    nonfinite: str = field("stop", one_of(*NONFINITE))
    nonfinite_max_skips: int = field(10, POSITIVE)  # skipped steps in a row before stopping
    # a step, evaluation or save this many times its median is a hang, and the run then
    # exits (0: no watchdog)
    hang_factor: float = field(20.0, number(0.0))
    # ... but none is a hang before this many seconds
    hang_min_seconds: float = field(600.0, number(0.0, low_open=True))
    # With several processes, agree on a stop signal (a collective) at every Nth step or
    # evaluation batch only; one process checks its own at each.
    preemption_check_every: int = field(10, POSITIVE)
    num_examples_to_print: int = field(8, NON_NEGATIVE)  # test examples printed at the end
    progress_bar: bool = field(True, boolean)  # tqdm bar on stderr
    tensorboard: bool = field(True, boolean)  # also write TensorBoard event files


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """`mesh`: devices for data x fsdp x model (see parallel/partitioning.py); data gets the
    devices that fsdp and model leave."""

    # shard parameters and optimiser state over this many devices (ZeRO-3)
    fsdp: int = field(1, POSITIVE)
    # tensor parallelism: heads, feed-forward and vocabulary split this many ways
    model: int = field(1, POSITIVE)
