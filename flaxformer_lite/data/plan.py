"""The step -> epoch layout -> batch machinery that every batch plan shares.

The contract (deterministic, resumable, random access; each process its own rows) is in
:mod:`flaxformer_lite.data.batching`.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.data.tokenized import Tokenized

Batch = dict[str, np.ndarray]


def _gather(flat: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """``int32[len(offsets), width]``: row ``i`` = ``flat[offsets[i]:][:lengths[i]]`` + PADs.

    For feature frames, ``flat`` is ``float32[total_frames, F]`` and the result
    ``float32[len(offsets), width, F]``, padded with 0.
    """
    cols = np.arange(width)
    index = np.minimum(offsets[:, None] + cols, len(flat) - 1)  # clipped cells are masked
    if flat.ndim == 2:
        inside = cols < lengths[:, None]  # [n, width]
        return np.where(inside[..., None], flat[index], 0.0).astype(np.float32)
    return np.where(cols < lengths[:, None], flat[index], PAD_ID).astype(np.int32)


class _Plan:
    """Step -> (epoch, index in epoch) -> cached epoch layout -> batch; shared by both plans.

    Subclasses set ``batches_per_epoch`` and define ``_layout(epoch)`` (pure in ``(seed,
    epoch)``), ``_build(layout, index) -> Batch`` and ``_members(layout, index) -> (example ids,
    cells of both sides)`` of the global batch ``index`` of an epoch.
    """

    batches_per_epoch: int
    _allows_empty = False  # bucketing and packing need at least one example

    def __init__(
        self, tokenized: Tokenized, seed: int, shuffle: bool, process_index: int, count: int
    ) -> None:
        if len(tokenized) == 0 and not self._allows_empty:
            raise ValueError(f"{type(self).__name__} needs a split with at least one example")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds numpy's SeedSequence), got {seed}")
        if not 0 <= process_index < count:
            raise ValueError(f"process_index must be in [0, {count}), got {process_index}")
        self.tokenized = tokenized
        self.seed, self.shuffle = seed, shuffle
        self.process_index, self.process_count = process_index, count
        t = tokenized
        self._sides = (
            (t.source_ids, t.source_offsets, t.source_lengths),
            (t.target_ids, t.target_offsets, t.target_lengths),
        )
        self._tokens = t.source_lengths.astype(np.int64) + t.target_lengths  # per example
        # The last two epochs' layouts, as one tuple replaced whole so that concurrent readers
        # never see it half-updated; two because prefetching readers straddle epoch boundaries.
        self._cache: tuple[tuple[int, Any], ...] = ()

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])

    def _epoch_layout(self, epoch: int) -> Any:
        for cached_epoch, layout in self._cache:
            if cached_epoch == epoch:
                return layout
        layout = self._layout(epoch)
        self._cache = ((epoch, layout),) + self._cache[:1]
        return layout

    def _shard(self, rows: int, base: int = 0) -> slice:
        """This process's rows of a global batch of ``rows`` rows that starts at ``base``."""
        per = rows // self.process_count
        return slice(base + self.process_index * per, base + (self.process_index + 1) * per)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _rows(self, ids: np.ndarray, shape: tuple[int, int]) -> Batch:
        """``{"inputs": int32[n, S], "targets": int32[n, T], "valid": bool[n]}`` of the examples
        ``ids`` (``int64[n]``; -1 is an all-PAD filler row whose ``valid`` is False). With
        feature sources, ``"inputs"`` is ``float32[n, S, F]`` (0 past a row's frames) and
        ``"inputs_valid"`` ``bool[n, S]`` marks the real frames."""
        valid = ids >= 0
        safe = np.where(valid, ids, 0)
        batch = {"valid": valid}
        for key, width, (flat, offsets, lengths) in zip(("inputs", "targets"), shape, self._sides):
            batch[key] = _gather(flat, offsets[safe], np.where(valid, lengths[safe], 0), width)
        if self.tokenized.source_features:
            lengths = np.where(valid, self.tokenized.source_lengths[safe], 0)
            batch["inputs_valid"] = np.arange(shape[0]) < lengths[:, None]
        return batch

    def __getitem__(self, step: int) -> Batch:
        """This process's rows of global batch ``step`` (any ``step >= 0``, across epochs)."""
        step = operator.index(step)
        if step < 0:
            raise IndexError(f"step must be >= 0 (steps run across epochs forever), got {step}")
        return self._batch(step)

    def _batch(self, step: int) -> Batch:
        epoch, index = divmod(step, self.batches_per_epoch)
        return self._build(self._epoch_layout(epoch), index)

    def step_members(self, step: int) -> tuple[np.ndarray, int]:
        """(``int64[n]`` ids of the examples in global batch ``step``, filler rows left out; the
        cells of both sides of its shape), on every process the same."""
        return self._members(self._epoch_layout(step // len(self)), step % len(self))

    def __iter__(self) -> Iterator[Batch]:
        """The batches of epoch 0; :meth:`iter_from` runs across epochs."""
        return (self[step] for step in range(self.batches_per_epoch))

    def iter_from(self, step: int = 0) -> Iterator[Batch]:
        """``plan[step], plan[step + 1], ...`` forever: a run resumes at its saved step."""
        return (self[s] for s in itertools.count(step))

    def padding_fraction(self, num_batches: int | None = None) -> float:
        """Fraction of PAD cells (source and target together, filler rows included) in the
        global batches of steps ``[0, num_batches)``; one epoch by default."""
        cells = tokens = 0
        for step in range(self.batches_per_epoch if num_batches is None else num_batches):
            members, batch_cells = self.step_members(step)
            cells, tokens = cells + batch_cells, tokens + int(self._tokens[members].sum())
        return 1.0 - tokens / max(cells, 1)


def input_throughput(plan: _Plan, num_batches: int, start_step: int = 0) -> float:
    """Examples per second of building ``plan[start_step : start_step + num_batches]`` (this
    process's rows, no model), including the layout of any epoch not yet cached."""
    examples = 0
    start = time.perf_counter()
    for step in range(start_step, start_step + num_batches):
        batch = plan[step]
        if "inputs_segments" in batch:  # packed: a row's last segment number = its examples
            examples += int(batch["inputs_segments"].max(axis=1).sum())
        else:
            examples += int(batch["valid"].sum())
    return examples / (time.perf_counter() - start)
