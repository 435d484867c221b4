"""Glancing sampling (GLAT, Qian et al. 2021) for a CTC decoder (Gu & Kong 2021, §3).

Training runs the decoder twice. The first pass, without gradient, predicts
every position from the copied source alone; its distance to the target is
the number of decoder positions whose argmax differs from the best CTC
alignment of the target (`ctc_loss.best_alignment`, a token or the blank per
position: the Hamming distance of the two paths). The second pass sees
floor(ratio * distance) positions, drawn uniformly, fed the embeddings of
their aligned symbols instead of the copied source, and is trained with the
CTC loss. A model that is far from the target is shown much of it (an easier
task); one that is close, little: the curriculum follows the model.

The ratio anneals linearly from `start` to `end` over the first `steps`
training steps (GLAT: 0.5 -> 0.3) and stays at `end` after them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.objectives.nat_loss import random_positions


def ratio(step: jax.Array | int, start: float, end: float, steps: int) -> jax.Array:
    """The glancing ratio at `step`: start + (end - start) * min(step / steps, 1); float32."""
    done = jnp.minimum(jnp.asarray(step, jnp.float32) / steps, 1.0)
    return jnp.float32(start) + jnp.float32(end - start) * done


def count(glance_ratio: jax.Array | float, distance: jax.Array) -> jax.Array:
    """Positions to reveal per row: floor(ratio * distance) (GLAT truncates).

    Args:
      distance: int[B], the first pass's wrong positions.
    Returns:
      int32[B]; 0 everywhere at ratio 0.
    """
    product = jnp.float32(glance_ratio) * distance.astype(jnp.float32)
    return jnp.floor(product).astype(jnp.int32)


def positions(rng: jax.Array, valid: jax.Array, how_many: jax.Array) -> jax.Array:
    """Which decoder positions are revealed: `how_many` of each row's valid ones, uniformly.

    Args:
      valid: bool[B, T], the positions that may be revealed; how_many: int[B].
    Returns:
      bool[B, T].
    """
    return random_positions(rng, valid, how_many)
