"""Deterministic, resumable, random-access batch plans: length buckets or packed rows.

A split (as in :mod:`flaxformer_lite.data.pipeline`) is tokenized once by
:func:`tokenize_split`; a plan then maps every global step to a dict of numpy arrays:
:class:`FixedBatches` uses one shape, the maxima, with the examples as one stream across epochs
(training) or one ordered pass with a padded last batch (evaluation, :func:`eval_batches`);
:class:`BucketedBatches` puts each example in the smallest of a few ``(source_len,
target_len)`` shapes that fits it (one compile per shape), :class:`PackedBatches` puts several
examples in each row of one shape, told apart by the ``*_segments`` / ``*_positions`` arrays
of ``Transformer.__call__(..., packing=...)``.

``plan[step]``, for any ``step >= 0``, is a pure function of the constructor arguments and
``step`` (epoch ``step // len(plan)``, laid out by a generator seeded with ``(seed, epoch)``):
a resumed run reads ``plan[step]`` and sees what an uninterrupted run would, with no iterator
state to save. Every epoch holds each example exactly once, in the same number of batches
(:class:`FixedBatches`: ``step`` alone decides the batch; its epochs follow grain's shuffle).
For background prefetching with grain, map over steps (``grain.MapDataset.range(start,
stop).map(plan.__getitem__)``): ``grain.MapDataset.source(plan)`` wraps indices modulo
``len(plan)`` and would replay epoch 0 forever.

Process ``p`` of ``P`` builds only rows ``[p * rows / P, (p + 1) * rows / P)`` of each global
batch of ``rows`` rows; the global batch is the processes' rows concatenated in process order.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from flaxformer_lite.data.packing import PackedBatches
from flaxformer_lite.data.plan import Batch, _Plan, input_throughput
from flaxformer_lite.data.tokenized import Encoder, Tokenized, tokenize_split
from flaxformer_lite.data.tokenizer import Vocabularies

__all__ = [
    "Batch",
    "BucketedBatches",
    "Encoder",
    "FixedBatches",
    "PackedBatches",
    "Tokenized",
    "default_buckets",
    "eval_batches",
    "input_throughput",
    "tokenize_split",
]


def default_buckets(
    max_source_len: int, max_target_len: int, smallest: int = 8
) -> list[tuple[int, int]]:
    """Both sides grown together in powers of two from ``smallest``, each capped at its
    maximum: (8, 8), (16, 16), (32, 32), (50, 50) for maxima of 50. The last is the maxima."""
    buckets: list[tuple[int, int]] = []
    length = smallest
    while not buckets or buckets[-1] != (max_source_len, max_target_len):
        bucket = (min(length, max_source_len), min(length, max_target_len))
        if bucket not in buckets:
            buckets.append(bucket)
        length *= 2
    return buckets


class BucketedBatches(_Plan):
    """Length-bucketed batches of a few fixed shapes (contract in the module docstring).

    ``plan[step]`` is ``{"inputs": int32[rows_b / P, S_b], "targets": int32[rows_b / P, T_b],
    "valid": bool[rows_b / P]}`` for the step's bucket ``b`` (``P`` = ``process_count``).
    An epoch shuffles each bucket's examples with ``(seed, epoch)``, cuts them into batches (a
    bucket's last partial batch is filled with all-PAD rows whose ``valid`` is False), then
    shuffles the order of all the epoch's batches with the same generator.

    Args:
        tokenized: output of :func:`tokenize_split`.
        buckets: ``(source_len, target_len)`` shapes; each example goes to the fitting bucket
            with the fewest cells per row (``S + T``). None: :func:`default_buckets` of the
            tokenization maxima, so splits tokenized alike share their shapes (and compiles).
        batch_size: rows of every batch, a multiple of ``process_count * pad_to_multiple``.
        max_tokens: instead of ``batch_size``, a budget per global batch (as fairseq's
            ``--max-tokens``): rows = ``max_tokens // max(S, T)``, rounded down to a multiple of
            ``m = process_count * pad_to_multiple`` and at least ``m``, so a bucket with ``m *
            max(S, T) > max_tokens`` exceeds the budget rather than being unusable.
        seed, shuffle: non-negative shuffle seed; False keeps batches in bucket order and
            examples in split order (evaluation).
        process_index, process_count: this process in ``[0, P)``, and ``P``.
        pad_to_multiple: rows per process are a multiple of it (e.g. the local device count).
    """

    def __init__(
        self,
        tokenized: Tokenized,
        *,
        buckets: Sequence[tuple[int, int]] | None = None,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        seed: int,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        pad_to_multiple: int = 1,
    ) -> None:
        super().__init__(tokenized, seed, shuffle, process_index, process_count)
        if (batch_size is None) == (max_tokens is None):
            raise ValueError("pass exactly one of batch_size (fixed rows) or max_tokens (budget)")
        if pad_to_multiple < 1 or (max_tokens is not None and max_tokens < 1):
            raise ValueError(
                f"pad_to_multiple and max_tokens must be >= 1, got {pad_to_multiple}, {max_tokens}"
            )
        multiple = process_count * pad_to_multiple
        if batch_size is not None and (batch_size < 1 or batch_size % multiple):
            raise ValueError(
                f"batch_size {batch_size} must be a positive multiple of process_count * "
                f"pad_to_multiple = {multiple}; round it to a multiple of {multiple}"
            )
        if buckets is None:
            buckets = default_buckets(tokenized.max_source_len, tokenized.max_target_len)
        self.buckets = sorted((int(s), int(t)) for s, t in buckets)
        if not self.buckets or min(min(b) for b in self.buckets) < 1:
            raise ValueError(f"buckets must be non-empty with positive lengths, got {buckets}")
        src, tgt = tokenized.source_lengths[:, None], tokenized.target_lengths[:, None]
        shape = np.array(self.buckets)  # [num_buckets, 2]
        fits = (src <= shape[:, 0]) & (tgt <= shape[:, 1])  # [n, num_buckets]
        if not fits.any(axis=1).all():
            raise ValueError(
                f"{(~fits.any(axis=1)).sum()} examples fit no bucket of {self.buckets}; add a "
                f"bucket of at least ({src.max()}, {tgt.max()}) or tokenize with smaller max "
                f"lengths"
            )
        bucket_of = np.argmin(np.where(fits, shape.sum(axis=1), np.inf), axis=1)
        self._bucket_members = [np.flatnonzero(bucket_of == b) for b in range(len(shape))]
        if batch_size is not None:
            self.rows = [batch_size] * len(shape)
        else:
            assert max_tokens is not None
            self.rows = [max(max_tokens // max(b) // multiple, 1) * multiple for b in self.buckets]
        self._num_batches = [-(-m.size // r) for m, r in zip(self._bucket_members, self.rows)]
        self.batches_per_epoch = sum(self._num_batches)

    def shapes(self) -> set[tuple[int, int, int]]:
        """``(rows, S, T)`` of this process's batches, for each bucket that has examples."""
        return {
            (rows // self.process_count, s, t)
            for (s, t), rows, n in zip(self.buckets, self.rows, self._num_batches)
            if n
        }

    def _layout(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """The epoch's batches in order: (bucket, ``int64[rows]`` example ids, -1 = filler)."""
        rng = self._rng(epoch)
        batches: list[tuple[int, np.ndarray]] = []
        for bucket, (members, rows) in enumerate(zip(self._bucket_members, self.rows)):
            if self.shuffle:
                members = rng.permutation(members)
            ids = np.full(self._num_batches[bucket] * rows, -1, dtype=np.int64)
            ids[: members.size] = members
            batches.extend((bucket, batch_ids) for batch_ids in ids.reshape(-1, rows))
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _build(self, layout: list[tuple[int, np.ndarray]], index: int) -> Batch:
        bucket, ids = layout[index]
        return self._rows(ids[self._shard(ids.size)], self.buckets[bucket])

    def _members(self, layout: list[tuple[int, np.ndarray]], index: int) -> tuple[np.ndarray, int]:
        bucket, ids = layout[index]
        return ids[ids >= 0], self.rows[bucket] * sum(self.buckets[bucket])


class FixedBatches(_Plan):
    """Batches of one shape, the tokenization maxima ``(S, T)``: the one-bucket case, with the
    examples read as one stream that runs across epochs (training) or in split order (eval).

    ``plan[step]`` is ``{"inputs": int32[B / P, S], "targets": int32[B / P, T], "valid":
    bool[B / P]}``: rows ``[p * B / P, (p + 1) * B / P)`` of stream examples ``[step * B,
    (step + 1) * B)``. Example ``k`` of the stream is the one grain's
    ``MapDataset.range(n).shuffle(seed).repeat(None, reseed_each_epoch=True)`` yields at ``k``
    (a new permutation each epoch), so training batches are those of the earlier grain
    pipeline (``shuffle`` + ``repeat`` + ``drop_remainder``), batch for batch. Unlike
    :class:`BucketedBatches`, a batch may hold the end of one epoch and the start of the next,
    so every training batch is full.

    Args:
        tokenized: output of :func:`tokenize_split`; its maxima are the batch shape.
        batch_size: rows ``B`` of a global batch, a multiple of ``process_count``.
        seed, shuffle: non-negative shuffle seed; False keeps split order.
        repeat: run over the split forever (``len`` is then ``sys.maxsize``); else one pass of
            ``n // B`` batches with ``drop_remainder``, or ``ceil(n / B)`` with the last padded
            by all-PAD rows whose ``valid`` is False.
        process_index, process_count: this process in ``[0, P)``, and ``P``.
    """

    _allows_empty = True  # an empty evaluation split has no batches

    def __init__(
        self,
        tokenized: Tokenized,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        repeat: bool = True,
        drop_remainder: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        super().__init__(tokenized, seed, shuffle, process_index, process_count)
        if batch_size < 1 or batch_size % process_count:
            raise ValueError(
                f"batch_size ({batch_size}) must be a positive multiple of process_count "
                f"({process_count})"
            )
        n = len(tokenized)
        if repeat and n == 0:
            raise ValueError("FixedBatches cannot repeat a split without examples")
        self.batch_size, self.repeat = batch_size, repeat
        self.shape = (tokenized.max_source_len, tokenized.max_target_len)
        self._stream_len = sys.maxsize if repeat else n
        if repeat:
            self.batches_per_epoch = sys.maxsize
        else:
            self.batches_per_epoch = n // batch_size if drop_remainder else -(-n // batch_size)
        order = grain.MapDataset.range(n)
        if shuffle:
            order = order.shuffle(seed=seed)
        if repeat:
            # Shuffling before repeating gives each epoch its own permutation.
            order = order.repeat(None, reseed_each_epoch=True)
        self._order = order

    def shapes(self) -> set[tuple[int, int, int]]:
        """The one ``(rows, S, T)`` shape of this process's batches."""
        return {(self.batch_size // self.process_count, *self.shape)}

    def _ids(self, lo: int, hi: int) -> np.ndarray:
        """``int64[hi - lo]``: the examples at stream positions ``[lo, hi)``, -1 past its end."""
        ids = np.full(hi - lo, -1, dtype=np.int64)
        real = range(lo, min(hi, self._stream_len))
        ids[: len(real)] = [self._order[k] for k in real]
        return ids

    def _batch(self, step: int) -> Batch:
        if step >= self.batches_per_epoch:
            raise IndexError(f"step {step} is past the last batch ({self.batches_per_epoch - 1})")
        rows = self._shard(self.batch_size, base=step * self.batch_size)
        return self._rows(self._ids(rows.start, rows.stop), self.shape)

    def step_members(self, step: int) -> tuple[np.ndarray, int]:
        ids = self._ids(step * self.batch_size, (step + 1) * self.batch_size)
        return ids[ids >= 0], self.batch_size * sum(self.shape)


def eval_batches(
    source: Sequence[Mapping[str, Any]],
    tokenizer: Encoder | Vocabularies,
    *,
    batch_size: int,
    max_source_len: int,
    max_target_len: int,
    process_index: int = 0,
    process_count: int = 1,
    extended: bool = False,
) -> FixedBatches:
    """Evaluation batches of a split: in split order, one pass, the last batch padded to
    ``batch_size`` rows with all-PAD rows whose ``valid`` is False.

    ``batches[i]``, ``i < len(batches) = ceil(n / batch_size)``, is ``{"inputs":
    int32[B / P, max_source_len], "targets": int32[B / P, max_target_len], "valid":
    bool[B / P]}`` (this process's rows of global batch ``i``, as in :class:`FixedBatches`).
    ``extended``: with the copy head's extended ids (:func:`tokenize_split`).
    """
    tokenized = tokenize_split(
        source,
        tokenizer,
        max_source_len=max_source_len,
        max_target_len=max_target_len,
        extended=extended,
    )
    return FixedBatches(
        tokenized,
        batch_size=batch_size,
        seed=0,
        shuffle=False,
        repeat=False,
        drop_remainder=False,
        process_index=process_index,
        process_count=process_count,
    )
