"""The datasets a run config can name, opened as train / validation / test splits.

data.dataset selects the loader:
  number_words    the generated default task (data.languages, data.max_number);
  names           the generated name-copy task (data.names_train, names_valid, names_test);
  spoken_numbers  numbers spoken by espeak-ng -> words or digits (data.speech_*, num_mels);
  parallel_text   {split}.{lang} files in data.corpus_dir;
  tsv             a tab-separated pairs file data.tsv_path, seeded split;
  anything else   a TFDS catalog name such as "wmt14_translate/de-en".
The fields each one reads are checked up front by `run_config.validate`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

from flaxformer_lite.config import ConfigError

if TYPE_CHECKING:
    from flaxformer_lite.run_config import DataConfig

LOCAL_DATASETS = ("number_words", "names", "spoken_numbers", "parallel_text", "tsv")


def load_splits(data: DataConfig) -> dict[str, Any]:
    """Dataset splits as random-access sources of {"source": bytes, "target": bytes}; a speech
    dataset's examples hold {"features": float32[K, data.num_mels]} as well (see `has_features`).

    Keys: "train", "validation" and, when the dataset has one, "test".
    """
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    try:
        # TFDS announces preparation on stdout; keep stdout for results.
        with contextlib.redirect_stdout(sys.stderr):
            return _load(data, log)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"data: {e}") from e


def has_features(data: DataConfig) -> bool:
    """Whether the dataset's examples carry "features" that the encoder reads instead of the
    source text (the source is then only a description for printing)."""
    return data.dataset == "spoken_numbers"


def tfds_dir(data: DataConfig) -> str:
    """Where TFDS datasets are prepared: data.tfds_dir, else $TFDS_DATA_DIR, else TFDS's default."""
    return (
        data.tfds_dir
        or os.environ.get("TFDS_DATA_DIR")
        or os.path.expanduser("~/tensorflow_datasets")
    )


def _renamed(splits: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
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


def _load(data: DataConfig, log) -> dict[str, Any]:
    if data.dataset == "number_words":
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
    if data.dataset == "spoken_numbers":
        return _spoken_numbers(data, log)
    if data.dataset == "names":
        from flaxformer_lite.data.names import load_names

        return load_names(data.names_train, data.names_valid, data.names_test, data.seed)
    from flaxformer_lite.data import translation

    names = dict(data.split_names)
    if data.dataset == "parallel_text":
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
    if data.dataset == "tsv":
        splits = translation.load_tsv_pairs(
            data.tsv_path,
            tfds_dir=tfds_dir(data),
            source_column=data.source_column,
            target_column=data.target_column,
            seed=data.seed,
            valid_fraction=data.valid_fraction,
            test_fraction=data.test_fraction,
            log=log,
        )
        return _renamed(splits, names)
    splits = translation.load_catalog(
        data.dataset,
        source_lang=data.source_lang,
        target_lang=data.target_lang,
        tfds_dir=tfds_dir(data),
    )
    return _renamed(splits, names)


def _spoken_numbers(data: DataConfig, log) -> dict[str, Any]:
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
