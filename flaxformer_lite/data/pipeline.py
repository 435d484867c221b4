"""Fixed-shape batches of token ids under their first signature, :func:`make_dataset`.

The batches themselves are :class:`flaxformer_lite.data.batching.FixedBatches` (one shape, the
one-bucket case of the batching plans); new code builds those directly, or
:func:`~flaxformer_lite.data.batching.eval_batches` for evaluation. Every batch is a dict of
numpy arrays with static shapes, so a jitted step function compiles once:

* ``"inputs"``: ``int32[batch_size, max_source_len]``, source ids + EOS, right-padded with PAD;
* ``"targets"``: ``int32[batch_size, max_target_len]``, target ids + EOS, right-padded with PAD;
* ``"valid"``: ``bool[batch_size]``, False only for the all-PAD filler rows of a final partial
  batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flaxformer_lite.data.batching import FixedBatches, tokenize_split
from flaxformer_lite.data.examples import SOURCE_FIELD, TARGET_FIELD, texts
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies

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
) -> FixedBatches:
    """Random-access fixed-shape batches of a split: ``ds[i]`` is batch ``i``, a dict of
    ``"inputs"`` ``int32[batch_size, max_source_len]``, ``"targets"``
    ``int32[batch_size, max_target_len]`` and ``"valid"`` ``bool[batch_size]``.

    Batch ``i`` is a pure function of the arguments and ``i``, so a run resumes at step ``s``
    by reading ``ds[s], ds[s + 1], ...`` with no iterator state to checkpoint. Over-long
    examples are truncated with EOS kept last (:func:`count_truncated`). ``tokenizer`` is
    one shared tokenizer or a :class:`Vocabularies` pair. ``shuffle``: a seeded order, new
    each epoch when ``repeat`` (then batches run across epochs and every one is full);
    otherwise a final partial batch is dropped (``drop_remainder``) or padded with rows
    whose ``valid`` is False. With ``process_count`` P > 1, process p gets (and tokenizes)
    only rows ``[p * B / P, (p + 1) * B / P)`` of each global batch; ``batch_size`` must be
    a multiple of P, and ``repeat`` or ``drop_remainder`` is required.
    """
    _check_batch_arguments(
        batch_size,
        max_source_len,
        max_target_len,
        process_index,
        process_count,
        repeat=repeat,
        drop_remainder=drop_remainder,
    )
    tokenized = tokenize_split(
        source, tokenizer, max_source_len=max_source_len, max_target_len=max_target_len
    )
    return FixedBatches(
        tokenized,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        repeat=repeat,
        drop_remainder=drop_remainder,
        process_index=process_index,
        process_count=process_count,
    )


def _check_batch_arguments(
    batch_size: int,
    max_source_len: int,
    max_target_len: int,
    process_index: int,
    process_count: int,
    *,
    repeat: bool,
    drop_remainder: bool,
) -> None:
    """Raises ValueError for arguments :func:`make_dataset` cannot batch with."""
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
