"""A download-free speech task: numbers spoken by espeak-ng -> their words or digits.

The number task (:mod:`~.numbers`) in reverse. Each example is an utterance:

* features: ``float32[K, M]`` log-mel frames (25 ms windows every 10 ms, utterance CMVN,
  :func:`~.audio_features.speech_features`) of ``num2words(number, lang)`` spoken by espeak-ng;
* target: the transcript, ``"words"`` (``"four thousand six hundred and thirty"``, in the
  order they are spoken) or ``"digits"`` (``"4630"``: for ``"de"`` the model must put the
  units it hears before the tens in their place);
* source: a description for printing, ``"de 4630 (m3, 172 wpm, pitch 41, 24.3 dB)"``.

Every utterance draws, from a generator seeded with ``(seed, language, number, copy)``, an
espeak variant of :data:`VARIANTS`, a rate of 130..210 words per minute, a pitch of 30..70 and
white noise at an SNR of 20..30 dB (of the utterance's mean power). The split is by number, in
every language at once: a validation or test number is never heard in training, in any
language or voice. The numbers below ``always_train_below`` (the words no model can infer,
"thirteen", "douze") are always in train; of the others, ``num_numbers`` are drawn (0: all up
to ``max_number``) and split with :func:`~.examples.seeded_split`. Training numbers are spoken
``utterances_per_number`` times per language, held-out ones once.

:class:`SpokenNumbers` is the TFDS builder that synthesises them once into ``array_record``
files; :func:`load_spoken_numbers` opens them (no TensorFlow, no espeak-ng once written).
Features are stored as float16: after CMVN they are O(1) values whose float16 rounding
(relative 5e-4) is far below the added noise, and it halves the disk and the read time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds
from num2words import num2words

from flaxformer_lite.data import speech_synthesis
from flaxformer_lite.data._tfds import Log, prepare
from flaxformer_lite.data.audio_features import speech_features
from flaxformer_lite.data.examples import SPLITS, check_fractions, seeded_split
from flaxformer_lite.data.numbers import _check_languages, _numbers_to_split

VARIANTS = ("m1", "m3", "m5", "m7", "f2", "f4", "f5")  # espeak-ng voice variants
RATES_WPM = (130, 210)  # words per minute, inclusive
PITCHES = (30, 70)
SNR_DB = (20.0, 30.0)
TARGETS = ("words", "digits")
FEATURES_FIELD = "features"

# synthesize(text, language, voice_variant, rate_wpm, pitch) -> (samples[N], sample_rate)
Synthesizer = Callable[[str, str, str, int, int], tuple[np.ndarray, int]]


def digits_target(number: int) -> str:
    """The digits transcript: ``str(number)``, the same in every language."""
    return str(number)


def split_numbers(
    max_number: int,
    num_numbers: int,
    always_train_below: int,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
) -> dict[str, list[int]]:
    """The numbers of each split, shared by all languages (module docstring).

    Returns:
        ``{"train": [...], "validation": [...], "test": [...]}``: disjoint increasing lists.
    """
    check_fractions(valid_fraction, test_fraction)
    low = min(always_train_below, max_number + 1)
    drawn = _numbers_to_split(1, low, max_number, num_numbers, seed)[0]
    items = seeded_split(
        len(drawn), seed=seed, valid_fraction=valid_fraction, test_fraction=test_fraction
    )
    out = {split: sorted(int(drawn[i]) for i in items[split]) for split in SPLITS}
    out["train"] = sorted(out["train"] + list(range(low)))
    return out


def utterance(
    synthesize: Synthesizer,
    language: str,
    number: int,
    copy: int,
    seed: int,
    num_mels: int,
) -> dict[str, Any]:
    """One utterance's record: ``{"features": float16[K, M], "words", "digits", "source"}``."""
    rng = np.random.default_rng([seed, sum(map(ord, language)), number, copy])
    variant = VARIANTS[rng.integers(len(VARIANTS))]
    rate = int(rng.integers(RATES_WPM[0], RATES_WPM[1] + 1))
    pitch = int(rng.integers(PITCHES[0], PITCHES[1] + 1))
    snr = float(rng.uniform(*SNR_DB))
    words = num2words(number, lang=language)
    samples, sample_rate = synthesize(words, language, variant, rate, pitch)
    x = np.asarray(samples, dtype=np.float64)
    if np.asarray(samples).dtype == np.int16:
        x = x / 32768.0
    power = max(float(np.mean(x**2)), 1e-12)
    x = x + rng.standard_normal(x.size) * np.sqrt(power / 10 ** (snr / 10))
    return {
        FEATURES_FIELD: speech_features(x, sample_rate, num_mels).astype(np.float16),
        "words": words,
        "digits": digits_target(number),
        "source": f"{language} {number} ({variant}, {rate} wpm, pitch {pitch}, {snr:.1f} dB)",
    }


def tones(
    text: str, language: str, voice_variant: str, rate_wpm: int, pitch: int
) -> tuple[np.ndarray, int]:
    """A :data:`Synthesizer` without espeak-ng, for tests: ``float32[N]`` at 8000 Hz, one sine
    tone per character of ``text`` (frequency by character, length by ``rate_wpm``, shifted
    by ``pitch``), so that features still determine the transcript."""
    del language, voice_variant
    rate, seconds = 8000, 6.0 / rate_wpm  # 175 wpm: 34 ms a character
    t = np.arange(int(rate * seconds)) / rate
    pieces = [
        0.3 * np.sin(2 * np.pi * (150 + 45 * (ord(c) % 64) + pitch) * t) if c != " " else 0 * t
        for c in text
    ]
    return np.concatenate(pieces + [0 * t]).astype(np.float32), rate


class SpokenNumbersConfig(tfds.core.BuilderConfig):
    """Builder config of :class:`SpokenNumbers`; its name encodes every generation argument
    and the voice (``"espeak"``, or another synthesizer's tag), so data is reused only when
    all agree."""

    def __init__(
        self,
        *,
        languages: Sequence[str],
        max_number: int,
        num_numbers: int,
        always_train_below: int,
        utterances_per_number: int,
        num_mels: int,
        seed: int,
        valid_fraction: float,
        test_fraction: float,
        voice: str = "espeak",
    ) -> None:
        languages = _check_languages(languages)
        check_fractions(valid_fraction, test_fraction)
        if utterances_per_number < 1 or num_mels < 1:
            raise ValueError(
                f"utterances_per_number ({utterances_per_number}) and num_mels ({num_mels}) "
                "must be >= 1"
            )
        name = (
            f"{'-'.join(languages)}_{max_number}_n{num_numbers}_a{always_train_below}"
            f"_u{utterances_per_number}_m{num_mels}_s{seed}_v{valid_fraction:g}"
            f"_t{test_fraction:g}_{voice}"
        )
        super().__init__(
            name=name,
            version=tfds.core.Version("1.0.0"),
            description=f"Spoken numbers ({name}).",
        )
        self.languages, self.max_number, self.num_numbers = languages, max_number, num_numbers
        self.always_train_below = always_train_below
        self.utterances_per_number, self.num_mels, self.seed = utterances_per_number, num_mels, seed
        self.valid_fraction, self.test_fraction, self.voice = valid_fraction, test_fraction, voice


class SpokenNumbers(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """TFDS builder of the spoken-number task; construct it with a :class:`SpokenNumbersConfig`
    and the ``synthesize`` function (default: espeak-ng).

    Features: ``{"features": float16[K, M], "words": Text, "digits": Text, "source": Text}``.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}

    def __init__(self, *, synthesize: Synthesizer | None = None, **kwargs: Any) -> None:
        self._synthesize = synthesize or speech_synthesis.synthesize
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Numbers spoken by a synthesiser, with their words and digits.",
            features=tfds.features.FeaturesDict(
                {
                    FEATURES_FIELD: tfds.features.Tensor(
                        shape=(None, self.builder_config.num_mels), dtype=np.float16
                    ),
                    "words": tfds.features.Text(),
                    "digits": tfds.features.Text(),
                    "source": tfds.features.Text(),
                }
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[str, dict]]]:
        del dl_manager
        c = self.builder_config
        numbers = split_numbers(
            c.max_number, c.num_numbers, c.always_train_below, c.seed,
            c.valid_fraction, c.test_fraction,
        )  # fmt: skip
        return {
            split: self._generate_examples(numbers[split], split == "train")
            for split in SPLITS
            if numbers[split]
        }

    def _generate_examples(self, numbers: list[int], train: bool) -> Iterator[tuple[str, dict]]:
        c = self.builder_config
        copies = c.utterances_per_number if train else 1
        for language in c.languages:
            for number in numbers:
                for copy in range(copies):
                    record = utterance(self._synthesize, language, number, copy, c.seed, c.num_mels)
                    yield f"{language}_{number}_{copy}", record


class SpeechSource(Sequence):
    """A split of the prepared records as ``{"features": float32[K, M], "target": bytes,
    "source": bytes}``, the target being the ``words`` or the ``digits`` transcript."""

    def __init__(self, records: Sequence[dict[str, Any]], target: str) -> None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        self._records, self._target = records, target

    def __len__(self) -> int:
        return len(self._records)

    def _convert(self, record: dict[str, Any]) -> dict[str, Any]:
        def text(value):
            return value if isinstance(value, bytes) else str(value).encode()

        return {
            FEATURES_FIELD: np.asarray(record[FEATURES_FIELD], dtype=np.float32),
            "target": text(record[self._target]),
            "source": text(record["source"]),
        }

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} examples")
        return self._convert(self._records[index % len(self)])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        read = getattr(type(self._records), "__getitems__", None)
        records = (
            read(self._records, list(indices)) if read else [self._records[i] for i in indices]
        )
        return [self._convert(r) for r in records]


def load_spoken_numbers(
    data_dir: str | os.PathLike,
    *,
    languages: Sequence[str],
    max_number: int,
    num_numbers: int,
    always_train_below: int,
    utterances_per_number: int,
    num_mels: int,
    seed: int,
    valid_fraction: float,
    test_fraction: float,
    target: str = "words",
    synthesize: Synthesizer | None = None,
    voice: str = "espeak",
    log: Log | None = None,
) -> dict[str, Sequence[dict[str, Any]]]:
    """Prepares (once: needs espeak-ng, or ``synthesize``) and opens the spoken numbers.

    ``synthesize`` and its ``voice`` tag replace espeak-ng (tests use tones). Raises
    :class:`~.speech_synthesis.SynthesisUnavailable` (one line naming the installs) when the
    data is not yet prepared and no synthesizer is present.

    Returns:
        ``{split: SpeechSource}`` for "train", "validation" and, when it has examples, "test"
        (an empty train or validation split is an empty tuple).
    """
    config = SpokenNumbersConfig(
        languages=languages, max_number=max_number, num_numbers=num_numbers,
        always_train_below=always_train_below, utterances_per_number=utterances_per_number,
        num_mels=num_mels, seed=seed, valid_fraction=valid_fraction,
        test_fraction=test_fraction, voice=voice,
    )  # fmt: skip
    builder = SpokenNumbers(
        data_dir=os.fspath(data_dir),
        config=config,
        file_format="array_record",
        synthesize=synthesize,
    )
    if not builder.is_prepared() and synthesize is None and not speech_synthesis.available():
        raise speech_synthesis.SynthesisUnavailable(speech_synthesis.MISSING)
    records = prepare(builder, SPLITS, log)
    # A test split without numbers is left out: evaluation has nothing to report on it.
    return {
        s: SpeechSource(r, target) if len(r) else ()
        for s, r in records.items()
        if len(r) or s != "test"
    }
