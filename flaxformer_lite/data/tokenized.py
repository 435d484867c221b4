"""A split tokenized once: ids + EOS per example, truncated keeping EOS last; or, for a speech
split, the source side as feature frames (no EOS), truncated to the first frames.

The batch plans of :mod:`flaxformer_lite.data.batching` gather their rows from it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from flaxformer_lite.data.examples import (
    FEATURES_FIELD,
    SOURCE_FIELD,
    TARGET_FIELD,
    as_str,
    read_all,
)
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.data.tokenizer import Vocabularies, with_eos


class Encoder(Protocol):
    """Anything with ``encode(text) -> ids`` (no EOS), e.g. :class:`~.tokenizer.Tokenizer`."""

    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenized:
    """A split tokenized once: ids + EOS per example, truncated keeping EOS last.

    ``sources[i]`` is ``int32[source_lengths[i]]``, a view into ``source_ids`` (``int32``, all
    sources concatenated, example ``i`` at ``source_offsets[i]``, ``int64[n]``): batches gather
    from the flat array in a few vectorized operations instead of one copy per example.
    ``source_lengths`` is ``int32[n]``, EOS included, at most ``max_source_len``;
    ``num_sources_truncated`` counts the examples cut to that length. Likewise for targets.

    With ``source_features`` the sources are feature frames instead (examples with a
    ``"features"`` field, ``float32[K, F]``): ``source_ids`` is ``float32[total_frames, F]``,
    ``sources[i]`` is ``float32[source_lengths[i], F]`` (no EOS; the first ``max_source_len``
    frames of a longer utterance, counted in ``num_sources_truncated``).
    """

    sources: list[np.ndarray]
    targets: list[np.ndarray]
    source_ids: np.ndarray
    target_ids: np.ndarray
    source_offsets: np.ndarray
    target_offsets: np.ndarray
    source_lengths: np.ndarray
    target_lengths: np.ndarray
    max_source_len: int
    max_target_len: int
    num_sources_truncated: int
    num_targets_truncated: int
    oov: list[tuple[str, ...]] | None = None  # with extended ids: each example's unknown pieces
    source_features: bool = False  # sources are float32 feature frames, not ids

    def __len__(self) -> int:
        return len(self.sources)


def tokenize_split(
    source: Sequence[Mapping[str, Any]],
    tokenizer: Encoder | Vocabularies,
    *,
    max_source_len: int,
    max_target_len: int,
    extended: bool = False,
) -> Tokenized:
    """Tokenizes every example of ``source`` once (ids + EOS, truncated keeping EOS last).

    ``tokenizer`` encodes both sides, or a :class:`Vocabularies` pair each its own side.

    Each side's strings are encoded as one list, in SentencePiece's C++ threads on every core
    of the host (`Tokenizer.encode_many`); every process of a multi-host job tokenizes the
    whole split, at once, since its batch plan needs every example's length.

    ``extended``: unknown source pieces get per-example extended ids, and target pieces that
    repeat them the same ids (`data/extended_ids.py`, for the copy head); needs one shared
    vocabulary. ``Tokenized.oov`` then holds each example's unknown pieces.
    """
    if min(max_source_len, max_target_len) < 1:
        raise ValueError(
            f"tokenize_split needs max lengths >= 1, got {max_source_len}, {max_target_len}"
        )
    limits = (max_source_len, max_target_len)
    if isinstance(tokenizer, Vocabularies):
        encoders = (tokenizer.source, tokenizer.target)
    else:
        encoders = (tokenizer, tokenizer)
    pieces: tuple[list[list[int]], list[list[int]]] = ([], [])
    truncated = [0, 0]
    if len(source) and FEATURES_FIELD in source[0]:
        if extended:
            raise ValueError("extended ids need text sources, not speech features")
        return _with_features(source, encoders[1], limits)
    if extended:
        oov = _encode_extended(source, encoders, limits, pieces, truncated)
    else:
        oov = None
        _encode_plain(source, encoders, limits, pieces, truncated)
    (sources, source_ids, source_offsets, source_lengths) = _flattened(pieces[0])
    (targets, target_ids, target_offsets, target_lengths) = _flattened(pieces[1])
    return Tokenized(
        sources, targets, source_ids, target_ids, source_offsets, target_offsets,
        source_lengths, target_lengths, max_source_len, max_target_len, *truncated, oov,
    )  # fmt: skip


def _encode_plain(source, encoders, limits, pieces, truncated) -> None:
    """`tokenize_split`'s encoding without extended ids: each side's strings encoded as one
    list; fills `pieces` (ids + EOS per example) and `truncated` (counts per side)."""
    strings: tuple[list[str], list[str]] = ([], [])
    for example in read_all(source):  # each record read once, in chunks
        strings[0].append(as_str(example[SOURCE_FIELD]))
        strings[1].append(as_str(example[TARGET_FIELD]))
    for side in (0, 1):
        for ids in _encode_all(encoders[side], strings[side]):
            ids, cut = with_eos(ids, limits[side])
            truncated[side] += cut
            pieces[side].append(ids)


def _flattened(side_pieces: list[list[int]]):
    """One side's ids as (views int32[length_i] into flat, flat int32[total], offsets
    int64[n], lengths int32[n])."""
    lengths = np.fromiter(map(len, side_pieces), np.int32, len(side_pieces))
    flat = np.fromiter(itertools.chain.from_iterable(side_pieces), np.int32, int(lengths.sum()))
    offsets = np.cumsum(lengths, dtype=np.int64) - lengths
    views = np.split(flat, offsets[1:]) if len(side_pieces) else []
    return views, flat, offsets, lengths


def _encode_all(encoder: Encoder, strings: list[str]) -> list[list[int]]:
    """The ids of every string, on all the host's cores where the encoder can."""
    many = getattr(encoder, "encode_many", None)
    return many(strings) if many is not None else [encoder.encode(s) for s in strings]


def _with_features(source, encoder, limits) -> Tokenized:
    """`tokenize_split` of a split whose sources are ``"features"`` frames."""
    frames: list[np.ndarray] = []
    targets: list[list[int]] = []
    truncated = [0, 0]
    for example in read_all(source):
        x = np.asarray(example[FEATURES_FIELD], dtype=np.float32)  # [K, F]
        truncated[0] += int(x.shape[0] > limits[0])
        frames.append(x[: limits[0]])
        ids, cut = with_eos(encoder.encode(as_str(example[TARGET_FIELD])), limits[1])
        truncated[1] += cut
        targets.append(ids)
    if len({x.shape[1] for x in frames}) > 1:
        raise ValueError(
            f"examples have different feature sizes {sorted({x.shape[1] for x in frames})}"
        )
    source_lengths = np.fromiter((x.shape[0] for x in frames), np.int32, len(frames))
    source_flat = np.concatenate(frames, axis=0)
    target_lengths = np.fromiter(map(len, targets), np.int32, len(targets))
    target_flat = np.fromiter(
        itertools.chain.from_iterable(targets), np.int32, int(target_lengths.sum())
    )
    source_offsets = np.cumsum(source_lengths, dtype=np.int64) - source_lengths
    target_offsets = np.cumsum(target_lengths, dtype=np.int64) - target_lengths
    return Tokenized(
        np.split(source_flat, source_offsets[1:]), np.split(target_flat, target_offsets[1:]),
        source_flat, target_flat, source_offsets, target_offsets, source_lengths,
        target_lengths, limits[0], limits[1], *truncated, None, True,
    )  # fmt: skip


def _encode_extended(source, encoders, limits, pieces, truncated) -> list[tuple[str, ...]]:
    """`tokenize_split`'s loop with extended ids; fills `pieces` and `truncated`, returns the
    unknown pieces of every example."""
    if encoders[0] is not encoders[1] and encoders[0] != encoders[1]:
        raise ValueError("extended ids need one shared vocabulary for source and target")
    vocab = ExtendedVocabulary(encoders[0])
    oov = []
    for example in read_all(source):
        ids, unknown, cut = vocab.encode_source(as_str(example[SOURCE_FIELD]), limits[0])
        truncated[0] += cut
        pieces[0].append(ids)
        oov.append(unknown)
        ids, cut = vocab.encode_target(as_str(example[TARGET_FIELD]), unknown, limits[1])
        truncated[1] += cut
        pieces[1].append(ids)
    return oov
