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

    # number_words | names | spoken_numbers | parallel_text | tsv | a TFDS catalog name such
    # as "wmt14_translate/de-en" (flaxformer_lite/datasets.py)
    dataset: str = field("number_words", string)
    # where TFDS prepares data; "": $TFDS_DATA_DIR, else ~/tensorflow_datasets
    tfds_dir: str = field("", string)
    # number_words: which numbers in which languages (data/numbers.py).
    languages: tuple[str, ...] = field(("en", "de", "fr"), strings)  # num2words language codes
    max_number: int = field(9999, NON_NEGATIVE)  # numbers 0..max_number in every language
    # never held out: below 100 are the irregular words (zwölf, douze)
    always_train_below: int = field(100, NON_NEGATIVE)
    # repeat rarer shapes (digits, non-zero digits): 12 22x, 9700 10x
    shape_balance: float = field(0.7, number(0.0, 1.0, high_open=False))
    num_numbers: int = field(0, NON_NEGATIVE)  # > 0: only this many per language; 0: all
    # the seed of the train/validation/test assignment of number_words, spoken_numbers (by
    # number) and tsv, and of the names drawn by names (not of training: train.seed)
    seed: int = field(0, NON_NEGATIVE)
    valid_fraction: float = field(0.05, FRACTION)  # share of pairs held out for validation
    test_fraction: float = field(0.05, FRACTION)  # share held out for the final test
    names_train: int = field(20_000, POSITIVE)  # names: training examples
    names_valid: int = field(500, NON_NEGATIVE)  # names: validation examples
    names_test: int = field(1_000, NON_NEGATIVE)  # names: test examples
    # spoken_numbers: espeak-ng voices that num2words spells (data/spoken_numbers.py)
    speech_languages: tuple[str, ...] = field(("en",), strings)
    speech_max_number: int = field(999, NON_NEGATIVE)  # spoken_numbers: numbers 0..max
    # spoken_numbers: > 0: only this many numbers >= speech_always_train_below; 0: all
    speech_numbers: int = field(0, NON_NEGATIVE)
    # spoken_numbers: never held out (thirteen, douze)
    speech_always_train_below: int = field(20, NON_NEGATIVE)
    # spoken_numbers: training utterances per number and language
    speech_utterances_per_number: int = field(4, POSITIVE)
    # spoken_numbers: words (as spoken) | digits ("4630")
    speech_target: str = field("words", one_of("words", "digits"))
    # spoken_numbers: log-mel channels per 10 ms frame (= model.input_features)
    num_mels: int = field(80, POSITIVE)
    # spoken_numbers: espeak (pip install '.[speech]') | tones (a test stand-in)
    speech_synthesizer: str = field("espeak", one_of("espeak", "tones"))
    # parallel_text: {split}.{lang} files here; a relative path is read from the working
    # directory
    corpus_dir: str = field("", string)
    # parallel_text and TFDS catalog datasets: the file suffix or catalog feature of the
    # source, e.g. "en"
    source_lang: str = field("", string)
    target_lang: str = field("", string)  # the same for the target, e.g. "de"
    # parallel_text, tsv and catalog: the corpus's names for our splits, e.g. {"validation":
    # "val"}; a split not named here is looked up under its own name.
    split_names: Mapping[str, str] = field(None, split_name_map, default_factory=dict)
    tsv_path: str = field("", string)  # tsv: a file of tab-separated pairs, split by the seed
    source_column: int = field(0, NON_NEGATIVE)  # tsv: 0-based column of the source sentence
    target_column: int = field(1, NON_NEGATIVE)  # tsv: 0-based column of the target sentence
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
    eval_bleu: bool = field(False, boolean)  # also report sacreBLEU and chrF
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
