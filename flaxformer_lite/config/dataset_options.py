"""Each dataset's own options: one section per dataset, nested in `data` under its name.

`data.number_words`, `data.names`, `data.spoken_numbers`, `data.parallel_text` and
`data.tsv` are read only by their dataset's registry entry (datasets.py), which names
its section here; a run config sets them as `--config.data.tsv.path=pairs.tsv`. What
several datasets read (the seeded split, the two languages, the split names) stays in
`data` itself (sections.py). The fields are checked alone here, and against the rest
of `data` by their dataset's check.
"""

from __future__ import annotations

import dataclasses

from flaxformer_lite.config.fields import (
    NON_NEGATIVE,
    POSITIVE,
    check_fields,
    field,
    number,
    one_of,
    string,
    strings,
)


@dataclasses.dataclass(frozen=True)
class NumberWords:
    """`data.number_words`: the generated default task, numbers in digits -> words
    (data/numbers.py), split by data.seed and the fractions."""

    languages: tuple[str, ...] = field(("en", "de", "fr"), strings)  # num2words language codes
    max_number: int = field(9999, NON_NEGATIVE)  # numbers 0..max_number in every language
    # never held out: below 100 are the irregular words (zwölf, douze)
    always_train_below: int = field(100, NON_NEGATIVE)
    # repeat rarer shapes (digits, non-zero digits): 12 22x, 9700 10x
    shape_balance: float = field(0.7, number(0.0, 1.0, high_open=False))
    num_numbers: int = field(0, NON_NEGATIVE)  # > 0: only this many per language; 0: all

    def __post_init__(self):
        check_fields(self, "data.number_words")


@dataclasses.dataclass(frozen=True)
class Names:
    """`data.names`: the generated name-copy task (data/names.py), its examples drawn
    with data.seed."""

    train: int = field(20_000, POSITIVE)  # training examples
    valid: int = field(500, NON_NEGATIVE)  # validation examples, of names training lacks
    test: int = field(1_000, NON_NEGATIVE)  # test examples, of names training lacks

    def __post_init__(self):
        check_fields(self, "data.names")


@dataclasses.dataclass(frozen=True)
class SpokenNumbers:
    """`data.spoken_numbers`: numbers spoken by espeak-ng (data/spoken_numbers.py); the split
    (data.seed and the fractions) is by number, in every language at once."""

    languages: tuple[str, ...] = field(("en",), strings)  # espeak-ng voices num2words spells
    max_number: int = field(999, NON_NEGATIVE)  # numbers 0..max_number
    numbers: int = field(0, NON_NEGATIVE)  # > 0: only this many >= always_train_below; 0: all
    always_train_below: int = field(20, NON_NEGATIVE)  # never held out (thirteen, douze)
    utterances_per_number: int = field(4, POSITIVE)  # training utterances per number, language
    target: str = field("words", one_of("words", "digits"))  # words (as spoken) | digits ("4630")
    num_mels: int = field(80, POSITIVE)  # log-mel channels per 10 ms frame (= model.input_features)
    # espeak (pip install '.[speech]') | tones (one sine per character: a test stand-in)
    synthesizer: str = field("espeak", one_of("espeak", "tones"))

    def __post_init__(self):
        check_fields(self, "data.spoken_numbers")


@dataclasses.dataclass(frozen=True)
class ParallelText:
    """`data.parallel_text`: {split}.{lang} files (optionally .gz), one sentence a line; the
    languages are data.source_lang and data.target_lang."""

    corpus_dir: str = field("", string)  # a relative path is read from the working directory

    def __post_init__(self):
        check_fields(self, "data.parallel_text")


@dataclasses.dataclass(frozen=True)
class Tsv:
    """`data.tsv`: a file of tab-separated pairs (e.g. Tatoeba's fra.txt), split by data.seed
    and the fractions."""

    path: str = field("", string)  # a relative path is read from the working directory
    source_column: int = field(0, NON_NEGATIVE)  # 0-based column of the source sentence
    target_column: int = field(1, NON_NEGATIVE)  # 0-based column of the target sentence

    def __post_init__(self):
        check_fields(self, "data.tsv")
