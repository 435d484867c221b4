"""The datasets a run config can name: one registry entry each, with its options section,
the shared `data` fields it reads, its check and its loader, opened as train / validation
/ test splits.

  number_words    the generated default task (data.number_words.languages, max_number, ...)
  names           the generated name-copy task (data.names.train, valid, test)
  spoken_numbers  numbers spoken by espeak-ng -> words or digits (data.spoken_numbers.*)
  parallel_text   {split}.{lang} files in data.parallel_text.corpus_dir
  tsv             a tab-separated pairs file data.tsv.path, seeded split
  anything else   a TFDS catalog name such as "wmt14_translate/de-en" (`CATALOG`)

A dataset's options section is nested in `data` under the dataset's name (its dataclass
is in config/dataset_options.py). `check` runs when a run config is parsed, before any
data is read; `load_splits` opens the splits. A new dataset is one more `Dataset` in
`DATASETS`, and, when it has options, one more section in config/dataset_options.py and
`DataConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flaxformer_lite.config import ConfigError, dataset_options

if TYPE_CHECKING:
    from flaxformer_lite.config.sections import DataConfig

Log = Callable[[str], None]
Splits = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset a run config can name in data.dataset.

    options: the dataclass of its own options, the section `data.<its name>` (None: it
      has none).
    fields: the shared `data` fields it reads (besides those every dataset reads: the
      vocabulary, lengths, batching and tfds_dir).
    check: raises ConfigError, naming the field, for settings it cannot load.
    load: (data, log) -> its splits, keyed by our split names.
    features: its examples carry encoder "features" (speech) instead of source text.
    """

    options: type | None
    fields: tuple[str, ...]
    check: Callable[[DataConfig], None]
    load: Callable[[DataConfig, Log], Splits]
    features: bool = False


def load_splits(data: DataConfig) -> Splits:
    """Dataset splits as random-access sources of {"source": bytes, "target": bytes}; a speech
    dataset's examples hold {"features": float32[K, num_mels]} as well (see `has_features`).

    Keys: "train", "validation" and, when the dataset has one, "test".
    """
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    try:
        # TFDS announces preparation on stdout; keep stdout for results.
        with contextlib.redirect_stdout(sys.stderr):
            return entry(data).load(data, log)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"data: {e}") from e


def entry(data: DataConfig) -> Dataset:
    """The registry entry of data.dataset (a TFDS catalog name when it is none of ours)."""
    return DATASETS.get(data.dataset, CATALOG)


def check(data: DataConfig) -> None:
    """The dataset's check of the `data` section, before any data is read."""
    if not data.dataset:
        raise ConfigError(
            "data.dataset is empty; name number_words, parallel_text, tsv or a TFDS catalog "
            "dataset such as wmt14_translate/de-en"
        )
    entry(data).check(data)


def has_features(data: DataConfig) -> bool:
    """Whether the dataset's examples carry "features" that the encoder reads instead of the
    source text (the source is then only a description for printing)."""
    return entry(data).features


def tfds_dir(data: DataConfig) -> str:
    """Where TFDS datasets are prepared: data.tfds_dir, else $TFDS_DATA_DIR, else TFDS's default."""
    return (
        data.tfds_dir
        or os.environ.get("TFDS_DATA_DIR")
        or os.path.expanduser("~/tensorflow_datasets")
    )


# Checks.


def _num2words_languages(field: str, languages, fix: str) -> None:
    from num2words import CONVERTER_CLASSES

    for lang in languages:
        if lang not in CONVERTER_CLASSES:
            raise ConfigError(f"data.{field} has {lang!r}, which num2words cannot spell; {fix}")


def _check_held_out(d: DataConfig) -> None:
    if d.valid_fraction + d.test_fraction >= 1.0:
        raise ConfigError(
            f"data.valid_fraction={d.valid_fraction} + data.test_fraction={d.test_fraction} "
            "leave no training examples; keep their sum below 1"
        )


def _check_number_words(d: DataConfig) -> None:
    from num2words import CONVERTER_CLASSES

    n = d.number_words
    _num2words_languages(
        "number_words.languages", n.languages, "choose from " + ", ".join(sorted(CONVERTER_CLASSES))
    )
    if n.always_train_below > n.max_number and d.valid_fraction + d.test_fraction > 0:
        raise ConfigError(
            f"data.number_words.always_train_below={n.always_train_below} keeps every number up "
            f"to data.number_words.max_number={n.max_number} in train, leaving none to hold out: "
            "lower it (0: any number may be held out)"
        )
    if n.num_numbers > n.max_number + 1 - min(n.always_train_below, n.max_number + 1):
        raise ConfigError(
            f"data.number_words.num_numbers={n.num_numbers} is more than there are numbers from "
            f"data.number_words.always_train_below={n.always_train_below} to "
            f"data.number_words.max_number={n.max_number}: lower it, or 0 for all of them"
        )
    _check_held_out(d)


def _check_spoken_numbers(d: DataConfig) -> None:
    s = d.spoken_numbers
    if len(set(s.languages)) != len(s.languages):
        raise ConfigError(
            f"data.spoken_numbers.languages={tuple(s.languages)} must name distinct languages, "
            "e.g. --config.data.spoken_numbers.languages=\"('en','de')\""
        )
    _num2words_languages(
        "spoken_numbers.languages",
        s.languages,
        "use espeak-ng voices num2words knows, e.g. en, de, fr",
    )
    low = min(s.always_train_below, s.max_number + 1)
    if s.numbers > s.max_number + 1 - low:
        raise ConfigError(
            f"data.spoken_numbers.numbers={s.numbers} is more than there are numbers from "
            f"data.spoken_numbers.always_train_below={s.always_train_below} to "
            f"data.spoken_numbers.max_number={s.max_number}: lower it, or 0 for all of them"
        )
    _check_held_out(d)


def _check_languages(d: DataConfig) -> None:
    """A corpus's two sides: data.source_lang and data.target_lang, different."""
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


def _check_parallel_text(d: DataConfig) -> None:
    if not d.parallel_text.corpus_dir:
        raise ConfigError(
            "data.parallel_text.corpus_dir is empty; data.dataset=parallel_text reads "
            "{split}.{lang} files from it"
        )
    _check_languages(d)


def _check_tsv(d: DataConfig) -> None:
    _check_held_out(d)
    t = d.tsv
    if not t.path:
        raise ConfigError("data.tsv.path is empty; data.dataset=tsv reads pairs from it")
    if t.source_column == t.target_column:
        raise ConfigError(
            f"data.tsv.source_column and data.tsv.target_column are both {t.source_column}; "
            "the source and the target must be different columns"
        )


# Loaders.


def _renamed(splits: Splits, names: dict[str, str]) -> Splits:
    """Maps the library's split names (train/validation/test) to a corpus's own names."""
    out = {}
    for ours in ("train", "validation", "test"):
        theirs = names.get(ours, ours)
        if theirs in splits:
            out[ours] = splits[theirs]
    if "train" not in out or "validation" not in out:
        raise ConfigError(
            f"the corpus has splits {sorted(splits)}, but training needs a train and a "
            "validation split; map them with data.split_names, e.g. "
            "--config.data.split_names=\"{'validation': 'val'}\""
        )
    return out


def _load_number_words(data: DataConfig, log: Log) -> Splits:
    from flaxformer_lite.data.numbers import load_number_words

    n = data.number_words
    return load_number_words(
        tfds_dir(data),
        tuple(n.languages),
        n.max_number,
        data.seed,
        data.valid_fraction,
        data.test_fraction,
        n.always_train_below,
        n.shape_balance,
        n.num_numbers,
    )


def _load_names(data: DataConfig, log: Log) -> Splits:
    from flaxformer_lite.data.names import load_names

    return load_names(data.names.train, data.names.valid, data.names.test, data.seed)


def _load_spoken_numbers(data: DataConfig, log: Log) -> Splits:
    """The spoken-number splits (`data/spoken_numbers.py`); a missing synthesizer is a
    one-line config error."""
    from flaxformer_lite.data import speech_synthesis, spoken_numbers
    from flaxformer_lite.data.spoken_numbers import load_spoken_numbers

    s = data.spoken_numbers
    try:
        return load_spoken_numbers(
            tfds_dir(data),
            languages=tuple(s.languages),
            max_number=s.max_number,
            num_numbers=s.numbers,
            always_train_below=s.always_train_below,
            utterances_per_number=s.utterances_per_number,
            num_mels=s.num_mels,
            seed=data.seed,
            valid_fraction=data.valid_fraction,
            test_fraction=data.test_fraction,
            target=s.target,
            # "tones": one sine per character instead of a voice (tests, no espeak-ng).
            synthesize=spoken_numbers.tones if s.synthesizer == "tones" else None,
            voice=s.synthesizer,
            log=log,
        )
    except speech_synthesis.SynthesisUnavailable as e:
        raise ConfigError(f"data.dataset=spoken_numbers: {e}") from None


def _load_parallel_text(data: DataConfig, log: Log) -> Splits:
    from flaxformer_lite.data import translation

    names = dict(data.split_names)
    corpus_dir = data.parallel_text.corpus_dir
    corpus = os.path.abspath(corpus_dir)
    if not os.path.isdir(corpus):
        raise ConfigError(
            f"data.parallel_text.corpus_dir={corpus_dir!r} is not a directory; point it at a "
            "folder of {split}.{lang} files"
        )
    wanted = [names.get(s, s) for s in ("train", "validation", "test")]
    present = [
        s
        for s in wanted
        if any(
            os.path.exists(os.path.join(corpus, f"{s}.{data.source_lang}{gz}"))
            for gz in ("", ".gz")
        )
    ]
    splits = translation.load_parallel_text(
        corpus,
        data.source_lang,
        data.target_lang,
        tfds_dir=tfds_dir(data),
        splits=present,
        log=log,
    )
    return _renamed(splits, names)


def _load_tsv(data: DataConfig, log: Log) -> Splits:
    from flaxformer_lite.data import tsv_pairs

    splits = tsv_pairs.load_tsv_pairs(
        data.tsv.path,
        tfds_dir=tfds_dir(data),
        source_column=data.tsv.source_column,
        target_column=data.tsv.target_column,
        seed=data.seed,
        valid_fraction=data.valid_fraction,
        test_fraction=data.test_fraction,
        log=log,
    )
    return _renamed(splits, dict(data.split_names))


def _load_catalog(data: DataConfig, log: Log) -> Splits:
    from flaxformer_lite.data import catalog

    splits = catalog.load_catalog(
        data.dataset,
        source_lang=data.source_lang,
        target_lang=data.target_lang,
        tfds_dir=tfds_dir(data),
    )
    return _renamed(splits, dict(data.split_names))


# The shared `data` fields of the seeded train/validation/test assignment.
_SPLIT = ("seed", "valid_fraction", "test_fraction")
DATASETS: dict[str, Dataset] = {
    "number_words": Dataset(
        dataset_options.NumberWords, _SPLIT, _check_number_words, _load_number_words
    ),
    "names": Dataset(dataset_options.Names, ("seed",), lambda d: None, _load_names),
    "spoken_numbers": Dataset(
        dataset_options.SpokenNumbers,
        _SPLIT,
        _check_spoken_numbers,
        _load_spoken_numbers,
        features=True,
    ),
    "parallel_text": Dataset(
        dataset_options.ParallelText,
        ("source_lang", "target_lang", "split_names"),
        _check_parallel_text,
        _load_parallel_text,
    ),
    "tsv": Dataset(dataset_options.Tsv, ("split_names", *_SPLIT), _check_tsv, _load_tsv),
}
# Any other name: a TFDS catalog dataset such as "wmt14_translate/de-en".
CATALOG = Dataset(
    None, ("source_lang", "target_lang", "split_names"), _check_languages, _load_catalog
)
