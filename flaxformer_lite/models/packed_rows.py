"""Packed rows (several examples per row) as the model modules read them.

The batch keeps its format, a dict of arrays (`models/base.py`, `data/packing.py`);
`Packing.of` gathers its four packing arrays once, where a model takes the batch apart,
so the modules read named fields instead of string keys.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax

from flaxformer_lite.models.base import Batch


@flax.struct.dataclass
class Packing:
    """Where each packed example lies in its row (B batch, S source, T target length).

    Segments number a row's examples 1, 2, ... (0 = padding); positions restart at 0 for
    each example. A pytree, so it passes through `jax.jit` and `module.apply` as arrays.

    Fields:
      inputs_segments, inputs_positions: int32[B, S].
      targets_segments, targets_positions: int32[B, T].
    """

    inputs_segments: jax.Array
    inputs_positions: jax.Array
    targets_segments: jax.Array
    targets_positions: jax.Array

    @classmethod
    def of(cls, batch: Batch) -> Packing | None:
        """The packing arrays of a batch of packed rows; None for one example per row."""
        if "inputs_segments" not in batch:
            return None
        return cls(**{field.name: batch[field.name] for field in dataclasses.fields(cls)})
