"""Grain pipeline: text examples -> fixed-shape batches of token ids.

A split is any random-access sequence of ``{"source": str | bytes, "target": str | bytes}``
dicts (e.g. what :func:`flaxformer_lite.data.numbers.load_number_words` returns). Every batch
produced by :func:`make_dataset` is a dict of numpy arrays with static shapes, so a jitted step
function compiles once:

* ``"inputs"``: ``int32[batch_size, max_source_len]``, source ids + EOS, right-padded with PAD;
* ``"targets"``: ``int32[batch_size, max_target_len]``, target ids + EOS, right-padded with PAD;
* ``"valid"``: ``bool[batch_size]``, False only for the all-PAD filler rows of a final partial
  batch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from flaxformer_lite.data.common import SOURCE_FIELD, TARGET_FIELD, as_str, texts
from flaxformer_lite.data.tokenizer import PAD_ID, Tokenizer, Vocabularies

__all__ = ["SOURCE_FIELD", "TARGET_FIELD", "count_truncated", "make_dataset", "texts"]


def count_truncated(
    source: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer | Vocabularies,
    max_source_len: int,
    max_target_len: int,
) -> tuple[int, int]:
    """Counts examples whose source / target (+ EOS) do not fit the given lengths.

    :func:`make_dataset` truncates such examples; this reports how many there are.

    Returns:
        ``(num_sources_truncated, num_targets_truncated)``.
    """
    vocab = Vocabularies.of(tokenizer)
    _, num_sources = vocab.source.encode_batch(texts(source, SOURCE_FIELD), max_source_len)
    _, num_targets = vocab.target.encode_batch(texts(source, TARGET_FIELD), max_target_len)
    return num_sources, num_targets


def _tokenize_example(
    example: Mapping[str, Any],
    *,
    tokenizer: Vocabularies,
    max_source_len: int,
    max_target_len: int,
) -> dict[str, np.ndarray]:
    """Tokenizes one example into ``inputs: int32[max_source_len]``, ``targets:
    int32[max_target_len]`` (ids + EOS, PAD-padded, truncated keeping EOS last)."""
    inputs, _ = tokenizer.source.encode_batch([as_str(example[SOURCE_FIELD])], max_source_len)
    targets, _ = tokenizer.target.encode_batch([as_str(example[TARGET_FIELD])], max_target_len)
    return {"inputs": inputs[0], "targets": targets[0]}


def _stack_batch(
    examples: Sequence[Mapping[str, np.ndarray]], *, batch_size: int
) -> dict[str, np.ndarray]:
    """Stacks tokenized examples and pads a short batch with all-PAD rows up to ``batch_size``.

    Returns:
        ``inputs: int32[batch_size, max_source_len]``, ``targets: int32[batch_size,
        max_target_len]`` and ``valid: bool[batch_size]`` (True for the real examples).
    """
    num_real = len(examples)
    batch: dict[str, np.ndarray] = {}
    for key in ("inputs", "targets"):
        rows = np.stack([example[key] for example in examples]).astype(np.int32)
        if num_real < batch_size:
            # Filler rows keep the batch shape static (no recompilation for the last batch);
            # `valid` tells metrics to ignore them.
            filler = np.full((batch_size - num_real, rows.shape[1]), PAD_ID, dtype=np.int32)
            rows = np.concatenate([rows, filler], axis=0)
        batch[key] = rows
    valid = np.zeros((batch_size,), dtype=bool)
    valid[:num_real] = True
    batch["valid"] = valid
    return batch


def make_dataset(
    source: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer | Vocabularies,
    *,
    batch_size: int,
    max_source_len: int,
    max_target_len: int,
    seed: int,
    shuffle: bool,
    repeat: bool,
    drop_remainder: bool,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """Builds a random-access dataset of fixed-shape batches from a split.

    Element ``i`` of the returned dataset is batch ``i``: a dict with ``"inputs"``
    ``int32[batch_size, max_source_len]``, ``"targets"`` ``int32[batch_size, max_target_len]``
    and ``"valid"`` ``bool[batch_size]``. Over-long examples are truncated so that EOS stays
    their last id (see :func:`count_truncated`).

    Batch ``i`` is a pure function of ``(source, tokenizer, arguments, i)``: ``ds[step]`` gives
    exactly what iterating ``ds`` would give at that step, so a training run resumes at step
    ``s`` by reading ``ds[s], ds[s + 1], ...`` (or iterating ``ds[s:]``) with no iterator state
    to checkpoint.

    Args:
        source: random-access sequence of ``{"source": str | bytes, "target": str | bytes}``.
        tokenizer: tokenizer with the reserved ids of :mod:`flaxformer_lite.data.tokenizer`
            (shared), or a :class:`Vocabularies` pair (sources and targets each their own).
        batch_size: rows per batch.
        max_source_len: columns of ``"inputs"``.
        max_target_len: columns of ``"targets"``.
        seed: shuffle seed; unused when ``shuffle`` is False.
        shuffle: visit the examples in a seeded random order (a new order each epoch when
            ``repeat``).
        repeat: repeat forever; the dataset length is then effectively infinite and batches run
            across epoch boundaries, so every batch is full.
        drop_remainder: drop a final partial batch instead of padding it with rows whose
            ``valid`` is False. Irrelevant when ``repeat``.
        process_index, process_count: this process ``p`` in ``[0, P)``, and ``P``. Batch ``i``
            is then only rows ``[p * B / P, (p + 1) * B / P)`` of global batch ``i`` (arrays
            ``[B / P, ...]``; only those examples are read and tokenized). ``batch_size`` must be
            a multiple of ``P``, and with ``P > 1`` a final partial batch is dropped (``repeat``
            or ``drop_remainder`` is required).

    Returns:
        A ``grain.MapDataset`` of batch dicts.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_source_len < 1 or max_target_len < 1:
        raise ValueError(
            f"max_source_len and max_target_len must be >= 1, got {max_source_len}, "
            f"{max_target_len}"
        )
    if not 0 <= process_index < process_count or batch_size % process_count:
        raise ValueError(
            f"need 0 <= process_index < process_count dividing batch_size, got process_index="
            f"{process_index}, process_count={process_count}, batch_size={batch_size}"
        )
    if process_count > 1 and not (repeat or drop_remainder):
        raise ValueError(
            "a final partial batch cannot be split between processes: pass repeat or "
            "drop_remainder, or read global batches and slice them"
        )
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        # Shuffling happens before repeating, so each epoch gets its own permutation.
        ds = ds.repeat(None, reseed_each_epoch=True)
    # Module-level functions (not closures) keep the transforms picklable.
    ds = ds.map(
        functools.partial(
            _tokenize_example,
            tokenizer=Vocabularies.of(tokenizer),
            max_source_len=max_source_len,
            max_target_len=max_target_len,
        )
    )
    rows = batch_size // process_count
    ds = ds.batch(
        rows,
        drop_remainder=drop_remainder,
        batch_fn=functools.partial(_stack_batch, batch_size=rows),
    )
    if process_count > 1:
        # Global batch i is local batches [i * P, (i + 1) * P) in this order; grain slices
        # lazily, so the other processes' examples are never tokenized here.
        ds = ds[: len(ds) // process_count * process_count][process_index::process_count]
    return ds
