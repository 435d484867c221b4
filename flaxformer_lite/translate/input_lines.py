"""Input lines made into model sources: token ids as training makes them, or a speech
workdir's feature frames.

Both give a `bucketing.Sources`, one entry per line (blank lines are [] and are not
decoded); `runner.py`, `scoring.py` and `distillation.py` decode or score from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.constants import UNK_ID
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies, with_eos
from flaxformer_lite.translate.bucketing import Sources, too_long_error
from flaxformer_lite.translate.line_io import InputError


def tokenize_lines(
    tokenizer: Tokenizer | Vocabularies,
    lines: Sequence[str],
    max_source_len: int,
    *,
    strict: bool = False,
    extended: bool = False,
    first_number: int = 1,
) -> Sources:
    """Source ids as training makes them: `encode(line) + [EOS]`, at most `max_source_len`.

    `tokenizer`: the shared tokenizer, or the pair whose source side is used.
    `extended`: unknown pieces get the copy head's extended ids (`Sources.oov`).

    Blank lines get [] and are not decoded. Longer sources are cut to
    `max_source_len` ids with EOS kept last, or with `strict` refused.

    Raises:
      InputError: `strict` and some line is too long (names the first line numbers,
        counted from `first_number`).
    """
    encoder = Vocabularies.of(tokenizer).source
    extension = ExtendedVocabulary(encoder) if extended else None
    out = Sources(ids=[], oov=[] if extended else None)
    too_long = []
    for number, line in enumerate(lines, start=first_number):
        ids = encoder.encode(line) if line.strip() else []
        if extension is not None:
            out.oov.append(())
        if not ids:
            out.ids.append([])
            out.num_empty += 1
            continue
        out.num_unknown += UNK_ID in ids
        if extension is None:
            ids, truncated = with_eos(ids, max_source_len)
        else:
            ids, out.oov[-1], truncated = extension.encode_source(line, max_source_len)
        if truncated:
            too_long.append(number)
        out.ids.append(ids)
    out.num_truncated = len(too_long)
    if strict and too_long:
        raise too_long_error(too_long, "input", max_source_len, "source")
    return out


def features_of_lines(
    lines: Sequence[str], run_config: RunConfig, max_source_len: int, first_number: int = 1
) -> Sources:
    """A speech workdir's input: each line is a WAV path, read into the features training
    used (`audio_features.speech_features` with the run's `data.spoken_numbers.num_mels`), at most
    `max_source_len` frames (longer ones are cut, and counted). Blank lines are not decoded.

    Sources.ids then holds float32[K, F] per line ([] for a blank one).

    Raises:
      InputError: a file is missing, unreadable, or not 16-bit PCM mono WAV (names the line,
        counted from `first_number`).
    """
    from flaxformer_lite.data import audio_features

    num_mels = run_config.data.spoken_numbers.num_mels
    out = Sources(ids=[])
    for number, line in enumerate(lines, start=first_number):
        path = line.strip()
        if not path:
            out.ids.append([])
            out.num_empty += 1
            continue
        try:
            samples, rate = audio_features.read_wav(path)
        except audio_features.AudioError as e:
            raise InputError(f"input line {number}: {e}") from None
        frames = audio_features.speech_features(samples, rate, num_mels)
        out.num_truncated += len(frames) > max_source_len
        out.ids.append(frames[:max_source_len])
    return out


def is_speech(run_config: RunConfig) -> bool:
    """Whether a workdir's encoder reads speech features (its input lines are WAV paths)."""
    return bool(run_config.model.input_features)


def sources_of_lines(
    tokenizer: Tokenizer | Vocabularies,
    lines: Sequence[str],
    run_config: RunConfig,
    *,
    strict: bool = False,
    first_number: int = 1,
) -> Sources:
    """The input lines as the model's sources: a speech workdir's WAV features, else ids
    (with the copy head's extended ids, as in training), at most data.max_source_len.

    Raises:
      InputError: as `tokenize_lines` and `features_of_lines`, naming line numbers
        counted from `first_number`.
    """
    max_source_len = run_config.data.max_source_len
    if is_speech(run_config):
        return features_of_lines(lines, run_config, max_source_len, first_number)
    copy_head = run_config.copy is not None  # extended ids, as in training
    return tokenize_lines(
        tokenizer,
        lines,
        max_source_len,
        strict=strict,
        extended=copy_head,
        first_number=first_number,
    )
