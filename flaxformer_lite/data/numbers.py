"""The default, download-free seq2seq task: numbers in digits -> numbers in words.

Each example is a pair of UTF-8 strings:

* source: ``f"{lang} {number}"``, e.g. ``"de 4721"``;
* target: the number spelled out by ``num2words`` in that language, e.g.
  ``"viertausendsiebenhunderteinundzwanzig"``.

The task needs real reordering and composition rather than copying (German puts units before
tens, French counts in twenties above 60), yet it is generated locally, deterministically and
in seconds. Every ``(lang, number)`` with ``0 <= number <= max_number`` lands in exactly one of
the splits ``"train"``, ``"validation"`` and ``"test"``, so held-out splits measure
generalisation to unseen numbers.

The pairs are exposed in two ways: :func:`generate_pairs` returns them as Python lists, and
:class:`NumberWords` is a TFDS builder that writes them to ``array_record`` files, read back by
:func:`load_number_words` without TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow_datasets as tfds
from num2words import CONVERTER_CLASSES, num2words

from flaxformer_lite.data._tfds import Log, PairsBuilder, prepare
from flaxformer_lite.data.common import SPLITS, check_fractions, seeded_split


def supported_languages() -> list[str]:
    """Returns the sorted language codes that ``num2words`` can convert."""
    return sorted(CONVERTER_CLASSES)


def _check_languages(languages: Sequence[str]) -> tuple[str, ...]:
    """Validates ``languages`` and returns them as a tuple, preserving order."""
    if isinstance(languages, str):
        # A bare string would be silently split into characters.
        raise TypeError(f"languages must be a sequence of codes, not the string {languages!r}")
    languages = tuple(languages)
    if not languages:
        raise ValueError("languages must not be empty")
    supported = supported_languages()
    for lang in languages:
        if lang not in CONVERTER_CLASSES:
            raise ValueError(
                f"Unsupported language {lang!r}; supported languages: {', '.join(supported)}"
            )
        if " " in lang:
            raise ValueError(f"Language code {lang!r} must not contain spaces")
    if len(set(languages)) != len(languages):
        raise ValueError(f"languages contains duplicates: {languages}")
    return languages


def generate_pairs(
    languages: Sequence[str],
    max_number: int,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
) -> dict[str, list[tuple[str, str]]]:
    """Generates the (source, target) string pairs of every split.

    All ``len(languages) * (max_number + 1)`` items ``(lang, number)`` are ordered
    language-major, then assigned to splits by :func:`~.common.seeded_split`; each split keeps
    the permutation order. The result depends only on the arguments.

    Args:
        languages: ``num2words`` language codes, e.g. ``("en", "de", "fr")``.
        max_number: largest number included (inclusive); must be >= 0.
        seed: seed of the split permutation.
        valid_fraction: fraction of items held out for "validation", in [0, 1).
        test_fraction: fraction of items held out for "test", in [0, 1).

    Returns:
        ``{"train": [...], "validation": [...], "test": [...]}`` of ``(source, target)`` tuples,
        e.g. ``("de 21", "einundzwanzig")``.
    """
    languages = _check_languages(languages)
    check_fractions(valid_fraction, test_fraction)
    if max_number < 0:
        raise ValueError(f"max_number must be >= 0, got {max_number}")

    per_language = max_number + 1
    items = seeded_split(
        len(languages) * per_language,
        seed=seed,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
    )
    pairs: dict[str, list[tuple[str, str]]] = {}
    for split in SPLITS:
        split_pairs = []
        for item in items[split]:
            lang = languages[int(item) // per_language]
            number = int(item) % per_language
            split_pairs.append((f"{lang} {number}", num2words(number, lang=lang)))
        pairs[split] = split_pairs
    return pairs


class NumberWordsConfig(tfds.core.BuilderConfig):
    """Builder config of :class:`NumberWords`; its ``name`` encodes every generation argument.

    Two configs with the same arguments get the same name, hence the same directory under
    ``data_dir``, so prepared data is reused; different arguments never share files.
    """

    def __init__(
        self,
        *,
        languages: Sequence[str],
        max_number: int,
        seed: int,
        valid_fraction: float,
        test_fraction: float,
    ) -> None:
        languages = _check_languages(languages)
        check_fractions(valid_fraction, test_fraction)
        name = f"{'-'.join(languages)}_{max_number}_s{seed}_v{valid_fraction:g}_t{test_fraction:g}"
        super().__init__(
            name=name,
            version=tfds.core.Version("1.0.0"),
            description=(
                f"Numbers 0..{max_number} in languages {languages}, split with seed {seed}, "
                f"validation fraction {valid_fraction}, test fraction {test_fraction}."
            ),
        )
        self.languages = languages
        self.max_number = max_number
        self.seed = seed
        self.valid_fraction = valid_fraction
        self.test_fraction = test_fraction


class NumberWords(PairsBuilder, skip_registration=True):
    """TFDS builder of the number-words task; construct it with a :class:`NumberWordsConfig`.

    Features: ``{"source": Text, "target": Text}``; splits "train", "validation", "test".
    """

    def _description(self) -> str:
        return "Cardinal numbers in digits paired with the same number in words."

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[str, dict]]]:
        del dl_manager  # Everything is generated locally.
        config = self.builder_config
        pairs = generate_pairs(
            config.languages,
            config.max_number,
            config.seed,
            config.valid_fraction,
            config.test_fraction,
        )
        # TFDS cannot write a split without examples (e.g. test_fraction=0), so empty splits are
        # left out here and filled in by `load_number_words`.
        return {split: self._generate_examples(pairs[split]) for split in SPLITS if pairs[split]}

    def _generate_examples(
        self, pairs: list[tuple[str, str]]
    ) -> Iterator[tuple[str, dict[str, str]]]:
        # Sources are unique within a config (one per (lang, number)), so they serve as keys.
        for source, target in pairs:
            yield source, {"source": source, "target": target}


def load_number_words(
    data_dir: str | os.PathLike,
    languages: Sequence[str],
    max_number: int,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
    *,
    log: Log | None = None,
) -> dict[str, Sequence[dict[str, bytes]]]:
    """Prepares (once) and opens the number-words dataset stored under ``data_dir``.

    The first call for a given set of arguments generates and writes the ``array_record``
    files; later calls find them and only open them. No TensorFlow is needed.

    Returns:
        ``{split: source}`` for "train", "validation" and "test". Each source is a random-access
        sequence whose items are ``{"source": bytes, "target": bytes}`` (UTF-8), in the split
        order of :func:`generate_pairs`. A split with no examples (fraction 0) is an empty tuple.
        ``log``, when given, is called with progress lines.
    """
    config = NumberWordsConfig(
        languages=languages,
        max_number=max_number,
        seed=seed,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
    )
    builder = NumberWords(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
    return prepare(builder, SPLITS, log)
