"""Tokenized input lines (`Sources`) and how decoding groups them into padded batches.

Over-long lines are truncated, or refused with `too_long_error` under --strict.

Bucketing: sources are sorted by length, grouped into batches of a fixed
number of rows, and each batch is padded to the smallest length of a fixed
set (`bucket_lengths`), so a file of any size and mix of lengths compiles the
search at most `len(bucket_lengths(max_source_len))` times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.translate.line_io import InputError


@dataclasses.dataclass
class Sources:
    """Tokenized input lines (counts are of lines)."""

    ids: list[list[int]]  # per line: source ids ending in EOS; [] for an empty line
    num_empty: int = 0
    num_truncated: int = 0
    num_unknown: int = 0  # lines with characters the vocabulary does not know (UNK_ID)
    oov: list[tuple[str, ...]] | None = None  # extended ids: each line's unknown pieces

    def detokenizer(self, target_vocab: Tokenizer):
        """(ids of line i's output, i) -> text; a copy head's extended ids take the text of
        line i's own unknown pieces (`data/extended_ids.py`)."""
        if self.oov is None:
            return lambda ids, i: target_vocab.decode(ids)
        extended = ExtendedVocabulary(target_vocab)
        return lambda ids, i: extended.decode(ids, self.oov[i])


def too_long_error(numbers: list[int], what: str, max_len: int, side: str) -> InputError:
    """The --strict refusal of over-long lines, naming the first few (1-based)."""
    shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
    return InputError(
        f"{len(numbers)} {what} line(s) exceed the model's {max_len} {side} tokens "
        f"(line {shown}); shorten them, or drop --strict to truncate"
    )


def bucket_lengths(max_source_len: int) -> tuple[int, ...]:
    """Source lengths batches are padded to: powers of two from 8 below the max, and the max."""
    lengths, n = [], 8  # shorter buckets would save little and compile more often
    while n < max_source_len:
        lengths.append(n)
        n *= 2
    return (*lengths, max_source_len)


def plan_batches(
    lengths: Sequence[int], batch_size: int, buckets: Sequence[int]
) -> list[tuple[list[int], int]]:
    """Groups the non-empty lines into batches of similar length.

    Args:
      lengths: source length per line (0 = empty, not decoded).
    Returns:
      [(line indices, at most batch_size of them, padded length)], longest first,
      so that running out of memory shows on the first batch.
    """
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i])
    batches = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        longest = lengths[rows[0]]
        batches.append((rows, next(b for b in buckets if b >= longest)))
    return batches


def pad_rows(ids: Sequence[Sequence[int]], indices: Sequence[int], rows: int, length: int):
    """int32[rows, length] of the chosen lines' ids, PAD_ID-padded; all-PAD rows fill the rest.

    Feature lines (float32[K, F] each) give (float32[rows, length, F] padded with 0,
    bool[rows, length] marking the real frames) instead."""
    if indices and isinstance(ids[indices[0]], np.ndarray) and ids[indices[0]].ndim == 2:
        width = ids[indices[0]].shape[1]
        frames = np.zeros((rows, length, width), np.float32)
        valid = np.zeros((rows, length), bool)
        for row, i in enumerate(indices):
            frames[row, : len(ids[i])] = ids[i]
            valid[row, : len(ids[i])] = True
        return frames, valid
    out = np.full((rows, length), PAD_ID, np.int32)
    for row, i in enumerate(indices):
        out[row, : len(ids[i])] = ids[i]
    return out


def batch_rows(lengths: Sequence[int], batch_size: int) -> int:
    """Rows of every batch: batch_size, or fewer if fewer lines are non-empty.

    Every batch has the same number of rows, so shapes vary only by bucket.
    """
    if batch_size < 1:
        raise InputError(f"--batch_size must be >= 1, got {batch_size}")
    return min(batch_size, sum(1 for n in lengths if n)) or 1
