"""The datasets a run config can name: one registry entry each, with the `data` fields it
reads, its check and its loader, opened as train / validation / test splits.

  number_words    the generated default task (data.languages, data.max_number, ...)
  names           the generated name-copy task (data.names_train, names_valid, names_test)
  spoken_numbers  numbers spoken by espeak-ng -> words or digits (data.speech_*, num_mels)
  parallel_text   {split}.{lang} files in data.corpus_dir
  tsv             a tab-separated pairs file data.tsv_path, seeded split
  anything else   a TFDS catalog name such as "wmt14_translate/de-en" (`CATALOG`)

`check` runs when a run config is parsed, before any data is read; `load_splits` opens
the splits. A new dataset is one more `Dataset` in `DATASETS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flaxformer_lite.config import ConfigError

if TYPE_CHECKING:
    from flaxformer_lite.config.sections import DataConfig

Log = Callable[[str], None]
Splits = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset a run config can name in data.dataset.

    fields: the `data` fields of its own that it reads (besides those every dataset
      reads: the vocabulary, lengths, batching and tfds_dir).
    check: raises ConfigError, naming the field, for settings it cannot load.
    load: (data, log) -> its splits, keyed by our split names.
    features: its examples carry encoder "features" (speech) instead of source text.
    """

    fields: tuple[str, ...]
    check: Callable[[DataConfig], None]
    load: Callable[[DataConfig, Log], Splits]
    features: bool = False


def load_splits(data: DataConfig) -> Splits:
    """Dataset splits as random-access sources of {"source": bytes, "target": bytes}; a speech
    dataset's examples hold {"features": float32[K, data.num_mels]} as well (see `has_features`).

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

    _num2words_languages(
        "languages", d.languages, "choose from " + ", ".join(sorted(CONVERTER_CLASSES))
    )
    if d.always_train_below > d.max_number and d.valid_fraction + d.test_fraction > 0:
        raise ConfigError(
            f"data.always_train_below={d.always_train_below} keeps every number up to "
            f"data.max_number={d.max_number} in train, leaving none to hold out: lower it "
            "(0: any number may be held out)"
        )
    if d.num_numbers > d.max_number + 1 - min(d.always_train_below, d.max_number + 1):
        raise ConfigError(
            f"data.num_numbers={d.num_numbers} is more than there are numbers from "
            f"data.always_train_below={d.always_train_below} to data.max_number={d.max_number}:"
            " lower it, or 0 for all of them"
        )
    _check_held_out(d)


def _check_spoken_numbers(d: DataConfig) -> None:
    if not d.speech_languages or len(set(d.speech_languages)) != len(d.speech_languages):
        raise ConfigError(
            f"data.speech_languages={tuple(d.speech_languages)} must name distinct languages, "
            "e.g. --config.data.speech_languages=\"('en','de')\""
        )
    _num2words_languages(
        "speech_languages",
        d.speech_languages,
        "use espeak-ng voices num2words knows, e.g. en, de, fr",
    )
    low = min(d.speech_always_train_below, d.speech_max_number + 1)
    if d.speech_numbers > d.speech_max_number + 1 - low:
        raise ConfigError(
            f"data.speech_numbers={d.speech_numbers} is more than there are numbers from "
            f"data.speech_always_train_below={d.speech_always_train_below} to "
            f"data.speech_max_number={d.speech_max_number}: lower it, or 0 for all of them"
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
    if not d.corpus_dir:
        raise ConfigError(
            "data.corpus_dir is empty; data.dataset=parallel_text reads {split}.{lang} files "
            "from it"
        )
    _check_languages(d)


def _check_tsv(d: DataConfig) -> None:
    _check_held_out(d)
    if not d.tsv_path:
        raise ConfigError("data.tsv_path is empty; data.dataset=tsv reads pairs from it")
    if d.source_column == d.target_column:
        raise ConfigError(
            f"data.source_column and data.target_column are both {d.source_column}; "
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

    return load_number_words(
        tfds_dir(data),
        tuple(data.languages),
        data.max_number,
        data.seed,
        data.valid_fraction,
        data.test_fraction,
        data.always_train_below,
        data.shape_balance,
        data.num_numbers,
    )


def _load_names(data: DataConfig, log: Log) -> Splits:
    from flaxformer_lite.data.names import load_names

    return load_names(data.names_train, data.names_valid, data.names_test, data.seed)


def _load_spoken_numbers(data: DataConfig, log: Log) -> Splits:
    """The spoken-number splits (`data/spoken_numbers.py`); a missing synthesizer is a
    one-line config error."""
    from flaxformer_lite.data import speech_synthesis, spoken_numbers
    from flaxformer_lite.data.spoken_numbers import load_spoken_numbers

    try:
        return load_spoken_numbers(
            tfds_dir(data),
            languages=tuple(data.speech_languages),
            max_number=data.speech_max_number,
            num_numbers=data.speech_numbers,
            always_train_below=data.speech_always_train_below,
            utterances_per_number=data.speech_utterances_per_number,
            num_mels=data.num_mels,
            seed=data.seed,
            valid_fraction=data.valid_fraction,
            test_fraction=data.test_fraction,
            target=data.speech_target,
            # "tones": one sine per character instead of a voice (tests, no espeak-ng).
            synthesize=spoken_numbers.tones if data.speech_synthesizer == "tones" else None,
            voice=data.speech_synthesizer,
            log=log,
        )
    except speech_synthesis.SynthesisUnavailable as e:
        raise ConfigError(f"data.dataset=spoken_numbers: {e}") from None


def _load_parallel_text(data: DataConfig, log: Log) -> Splits:
    from flaxformer_lite.data import translation

    names = dict(data.split_names)
    corpus = os.path.abspath(data.corpus_dir)
    if not os.path.isdir(corpus):
        raise ConfigError(
            f"data.corpus_dir={data.corpus_dir!r} is not a directory; point it at a "
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
        data.tsv_path,
        tfds_dir=tfds_dir(data),
        source_column=data.source_column,
        target_column=data.target_column,
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


_SPLIT = ("seed", "valid_fraction", "test_fraction")
DATASETS: dict[str, Dataset] = {
    "number_words": Dataset(
        (
            "languages",
            "max_number",
            "always_train_below",
            "shape_balance",
            "num_numbers",
            *_SPLIT,
        ),
        _check_number_words,
        _load_number_words,
    ),
    "names": Dataset(
        ("names_train", "names_valid", "names_test", "seed"), lambda d: None, _load_names
    ),
    "spoken_numbers": Dataset(
        (
            "speech_languages",
            "speech_max_number",
            "speech_numbers",
            "speech_always_train_below",
            "speech_utterances_per_number",
            "speech_target",
            "num_mels",
            "speech_synthesizer",
            *_SPLIT,
        ),
        _check_spoken_numbers,
        _load_spoken_numbers,
        features=True,
    ),
    "parallel_text": Dataset(
        ("corpus_dir", "source_lang", "target_lang", "split_names"),
        _check_parallel_text,
        _load_parallel_text,
    ),
    "tsv": Dataset(
        ("tsv_path", "source_column", "target_column", "split_names", *_SPLIT),
        _check_tsv,
        _load_tsv,
    ),
}
# Any other name: a TFDS catalog dataset such as "wmt14_translate/de-en".
CATALOG = Dataset(("source_lang", "target_lang", "split_names"), _check_languages, _load_catalog)
