"""The padded vocabulary: rows stored beyond the real entries, and never an output.

Embedding and softmax tables hold `config.padded(V)` rows, V rounded up to
`model.vocab_multiple` (128 by default). A [M, D] x [D, V] matmul with V = 8000
or 37000 leaves a ragged last tile on every accelerator: TPU vector units are
128 lanes wide and GPU MMA tiles 64-256 columns, and a vocabulary split over the
`model` mesh axis must divide evenly. The padded rows:

- start at zero and get no gradient (no token id reaches them, and their logits
  are constants), so Adam leaves them at zero;
- have the logit `PADDED_LOGIT` (`mask_logits`), whose probability is exactly 0
  in float32: softmax, log-softmax, argmax, top-k, sampling and beam search
  never pick them, and the loss sums its label smoothing over the real V only
  (`objectives/cross_entropy.py`);
- are cut off where parameters leave the library (`real_rows`: the exports).

A run config saved before this field existed reads as `vocab_multiple=1`
(`training/workdir.py`), so its checkpoints load as they were written.

The logits keep their padded width: slicing them to V would give the `model`
axis uneven shards and make XLA move [B*T, V] activations between devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# A padded column's logit: exp(PADDED_LOGIT - log Z) == 0 in float32, yet finite, so that
# 0 * logit stays 0 and beam sums stay ordered (search.primitives.NEG_INF is -1e7).
PADDED_LOGIT = -1.0e9


def mask_logits(logits: jax.Array, vocab_size: int) -> jax.Array:
    """float[..., Vp] with the columns >= vocab_size set to PADDED_LOGIT (as is if Vp == V)."""
    if logits.shape[-1] == vocab_size:
        return logits
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(column < vocab_size, logits, jnp.asarray(PADDED_LOGIT, logits.dtype))


def real_columns(width: int, vocab_size: int) -> jax.Array | None:
    """bool[width]: which columns are real entries; None when none is padding."""
    if width == vocab_size:
        return None
    return jnp.arange(width) < vocab_size


def zero_padding_init(init: Callable, vocab_size: int, axis: int) -> Callable:
    """`init` of the real entries (vocab_size along `axis`, drawn as without padding: the
    same key gives the same values, and fan-based scales see the real size), zeros after."""

    def padded_init(key, shape, dtype=jnp.float32):
        if shape[axis] == vocab_size:
            return init(key, shape, dtype)
        real = list(shape)
        real[axis] = vocab_size
        widths = [(0, 0)] * len(shape)
        widths[axis] = (0, shape[axis] - vocab_size)
        return jnp.pad(init(key, tuple(real), dtype), widths)

    return padded_init


def real_rows(table, vocab_size: int, axis: int = 0):
    """The real entries of a padded table along `axis` (numpy or jax arrays)."""
    if table.shape[axis] < vocab_size:
        raise ValueError(f"a table of {table.shape[axis]} rows cannot hold {vocab_size} entries")
    index = [slice(None)] * table.ndim
    index[axis] = slice(0, vocab_size)
    return table[tuple(index)]
