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

Three options shape the splits (all off: every number may be held out, each seen once):

* ``num_numbers``: instead of every number up to ``max_number``, this many distinct ones per
  language, drawn uniformly with the seed (numbers up to 10^9 make outputs of 30-40 tokens,
  long enough for one early error to derail the rest);

* ``always_train_below``: the numbers below it go to "train" in every language, and the
  held-out splits are drawn from the others. Below 100 are the words no model can infer from
  others (``zwölf``, ``douze``, ``seventeen``, ``soixante-dix``, ``quatre-vingts``): holding
  one out tests memory, not generalisation. Every number above is a composition of them.
* ``shape_balance`` (b in [0, 1]): length-balanced sampling. A number's shape is its count
  of digits and of non-zero digits (4721: 4 and 4; 9700: 4 and 2; 30: 2 and 1), which sets
  how many words it has. A training number of shape c is repeated ``round((n_max / n_c) ** b)``
  times, n_c being the training numbers of that language with shape c and n_max the largest
  such count. With b = 0 and ``max_number`` 9999, numbers below 100 are 1% of the training
  pairs and round thousands 0.1%; b = 1 gives every shape the same share; the default
  config's b = 0.7 is in between (below 100: 17%, round thousands 3.6%, numbers with 4
  non-zero digits 26% instead of 66%).

The pairs are exposed in two ways: :func:`generate_pairs` returns them as Python lists, and
:class:`NumberWords` is a TFDS builder that writes them to ``array_record`` files, read back by
:func:`load_number_words` without TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from num2words import CONVERTER_CLASSES, num2words

from flaxformer_lite.data._tfds import Log, PairsBuilder, prepare
from flaxformer_lite.data.examples import SPLITS, check_fractions, seeded_split


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


def _check_options(always_train_below: int, shape_balance: float) -> None:
    if always_train_below < 0:
        raise ValueError(f"always_train_below must be >= 0, got {always_train_below}")
    if not 0.0 <= shape_balance <= 1.0:
        raise ValueError(f"shape_balance must be in [0, 1], got {shape_balance}")


def shape(number: int) -> tuple[int, int]:
    """(digits, non-zero digits) of a number: 9700 -> (4, 2)."""
    digits = str(number)
    return len(digits), len(digits) - digits.count("0")


def shape_repeats(train_numbers: Sequence[int], shape_balance: float) -> dict[tuple[int, int], int]:
    """``{shape: repeats}`` of one language's training numbers (see the module doc)."""
    counts: dict[tuple[int, int], int] = {}
    for number in train_numbers:
        counts[shape(number)] = counts.get(shape(number), 0) + 1
    most = max(counts.values(), default=1)
    return {c: max(1, round((most / n) ** shape_balance)) for c, n in counts.items()}


def _numbers_to_split(
    num_languages: int, low: int, max_number: int, num_numbers: int, seed: int
) -> list[np.ndarray]:
    """Per language, the increasing numbers in [low, max_number] that may be held out: all of
    them, or ``num_numbers`` drawn uniformly with ``seed``."""
    if num_numbers < 0:
        raise ValueError(f"num_numbers must be >= 0, got {num_numbers}")
    eligible = max_number + 1 - low
    if not num_numbers:
        return [np.arange(low, max_number + 1)] * num_languages
    if num_numbers > eligible:
        raise ValueError(
            f"num_numbers={num_numbers} exceeds the {eligible} numbers from {low} to {max_number}"
        )
    rng = np.random.default_rng(seed)
    return [
        low + np.sort(rng.choice(eligible, num_numbers, replace=False))
        for _ in range(num_languages)
    ]


def generate_pairs(
    languages: Sequence[str],
    max_number: int,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
    always_train_below: int = 0,
    shape_balance: float = 0.0,
    num_numbers: int = 0,
) -> dict[str, list[tuple[str, str]]]:
    """Generates the (source, target) string pairs of every split.

    The items ``(lang, number)`` with ``number >= always_train_below`` are ordered
    language-major, then assigned to splits by :func:`~.examples.seeded_split`; each split keeps
    the permutation order. The numbers below ``always_train_below`` follow in "train"
    (language-major). With ``shape_balance`` > 0 each training pair is repeated, its copies
    side by side, as :func:`shape_repeats` says. The result depends only on the arguments.

    Args:
        languages: ``num2words`` language codes, e.g. ``("en", "de", "fr")``.
        max_number: largest number included (inclusive); must be >= 0.
        seed: seed of the split permutation.
        valid_fraction: fraction of the eligible items held out for "validation", in [0, 1).
        test_fraction: fraction of the eligible items held out for "test", in [0, 1).
        always_train_below: numbers below it are never held out (0: any may be).
        shape_balance: exponent b in [0, 1] of the training repeats (0: each pair once).
        num_numbers: > 0: only this many distinct numbers >= always_train_below per language,
            drawn uniformly with ``seed`` (in increasing order before the split's permutation).

    Returns:
        ``{"train": [...], "validation": [...], "test": [...]}`` of ``(source, target)`` tuples,
        e.g. ``("de 21", "einundzwanzig")``.
    """
    languages = _check_languages(languages)
    check_fractions(valid_fraction, test_fraction)
    _check_options(always_train_below, shape_balance)
    if max_number < 0:
        raise ValueError(f"max_number must be >= 0, got {max_number}")

    low = min(always_train_below, max_number + 1)
    drawn = _numbers_to_split(len(languages), low, max_number, num_numbers, seed)
    chosen = _assign_splits(languages, drawn, seed, valid_fraction, test_fraction)
    chosen["train"] += [(lang, number) for lang in languages for number in range(low)]
    return _spell_out(chosen, languages, shape_balance)


def _assign_splits(
    languages: tuple[str, ...],
    drawn: list[np.ndarray],
    seed: int,
    valid_fraction: float,
    test_fraction: float,
) -> dict[str, list[tuple[str, int]]]:
    """``{split: [(lang, number), ...]}`` of the numbers that may be held out.

    ``drawn[l]`` holds language ``l``'s numbers (all languages the same count); the items are
    ordered language-major and split by :func:`~.examples.seeded_split`, each split in its
    permutation order.
    """
    per_language = len(drawn[0])
    items = seeded_split(
        len(languages) * per_language,
        seed=seed,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
    )
    return {
        split: [
            (
                languages[int(i) // per_language],
                int(drawn[int(i) // per_language][int(i) % per_language]),
            )
            for i in items[split]
        ]
        for split in SPLITS
    }


def _spell_out(
    chosen: dict[str, list[tuple[str, int]]], languages: tuple[str, ...], shape_balance: float
) -> dict[str, list[tuple[str, str]]]:
    """The ``(source, target)`` string pairs of every split's ``(lang, number)`` items, each
    training pair repeated (copies side by side) as :func:`shape_repeats` says."""
    repeats = {
        lang: shape_repeats([n for code, n in chosen["train"] if code == lang], shape_balance)
        for lang in languages
    }
    pairs: dict[str, list[tuple[str, str]]] = {}
    for split in SPLITS:
        split_pairs = []
        for lang, number in chosen[split]:
            pair = (f"{lang} {number}", num2words(number, lang=lang))
            copies = repeats[lang][shape(number)] if split == "train" else 1
            split_pairs.extend([pair] * copies)
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
        always_train_below: int = 0,
        shape_balance: float = 0.0,
        num_numbers: int = 0,
    ) -> None:
        languages = _check_languages(languages)
        check_fractions(valid_fraction, test_fraction)
        _check_options(always_train_below, shape_balance)
        name = f"{'-'.join(languages)}_{max_number}_s{seed}_v{valid_fraction:g}_t{test_fraction:g}"
        # The options join the name only when set, so that older data keeps its directory.
        name += f"_a{always_train_below}" if always_train_below else ""
        name += f"_sb{shape_balance:g}" if shape_balance else ""
        name += f"_n{num_numbers}" if num_numbers else ""
        super().__init__(
            name=name,
            version=tfds.core.Version("1.0.0"),
            description=(
                f"Numbers 0..{max_number} in languages {languages}, split with seed {seed}, "
                f"validation fraction {valid_fraction}, test fraction {test_fraction}, "
                f"numbers below {always_train_below} always in train, digit balance "
                f"{shape_balance}, {num_numbers or 'all'} numbers per language."
            ),
        )
        self.languages = languages
        self.max_number = max_number
        self.seed = seed
        self.valid_fraction = valid_fraction
        self.test_fraction = test_fraction
        self.always_train_below = always_train_below
        self.shape_balance = shape_balance
        self.num_numbers = num_numbers


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
            config.always_train_below,
            config.shape_balance,
            config.num_numbers,
        )
        # TFDS cannot write a split without examples (e.g. test_fraction=0), so empty splits are
        # left out here and filled in by `load_number_words`.
        return {split: self._generate_examples(pairs[split]) for split in SPLITS if pairs[split]}

    def _generate_examples(
        self, pairs: list[tuple[str, str]]
    ) -> Iterator[tuple[str, dict[str, str]]]:
        # A source appears once per split, or in copies side by side (shape_balance): the
        # source and its copy number make a unique key.
        copy = 0
        for i, (source, target) in enumerate(pairs):
            copy = copy + 1 if i and pairs[i - 1][0] == source else 0
            yield f"{source}#{copy}" if copy else source, {"source": source, "target": target}


def load_number_words(
    data_dir: str | os.PathLike,
    languages: Sequence[str],
    max_number: int,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
    always_train_below: int = 0,
    shape_balance: float = 0.0,
    num_numbers: int = 0,
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
        always_train_below=always_train_below,
        shape_balance=shape_balance,
        num_numbers=num_numbers,
    )
    builder = NumberWords(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
    return prepare(builder, SPLITS, log)
