"""Training targets of a non-autoregressive decoder: which tokens to mask, and the length loss.

Conditional masked language modelling (CMLM, Ghazvininejad et al. 2019): each
row masks k ~ U{1, ..., n} of its n target tokens, chosen uniformly, and the
loss covers the masked positions only. Masking all of them (`"all"`) trains
the single-pass NAT of Gu et al. (2018). The length classifier is trained
jointly with cross entropy on the target - source offset class.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKINGS = ("uniform", "all")


def random_masks(rng: jax.Array, valid: jax.Array, masking: str) -> jax.Array:
    """Which target positions the decoder must predict.

    Args:
      valid: bool[B, T], the positions of each row's target.
      masking: "uniform" (k ~ U{1..n} random positions of a row of n) or "all".
    Returns:
      bool[B, T], True only at valid positions; at least one per non-empty row.
    """
    if masking == "all":
        return valid
    if masking != "uniform":
        raise ValueError(f"unknown masking {masking!r}: one of {', '.join(MASKINGS)}")
    count_key, order_key = jax.random.split(rng)
    n = valid.sum(-1)  # [B]
    k = 1 + jnp.floor(jax.random.uniform(count_key, n.shape) * n).astype(jnp.int32)
    return random_positions(order_key, valid, jnp.minimum(k, n))


def random_positions(rng: jax.Array, valid: jax.Array, count: jax.Array) -> jax.Array:
    """`count` positions of each row, drawn uniformly without replacement from its valid ones.

    Args:
      valid: bool[B, T]; count: int[B].
    Returns:
      bool[B, T], min(count, valid.sum(-1)) True per row, all at valid positions.
    """
    keys = jnp.where(valid, jax.random.uniform(rng, valid.shape), 2.0)
    rank = jnp.argsort(jnp.argsort(keys, axis=-1), axis=-1)  # 0 = the smallest key
    return (rank < count[:, None]) & valid


def length_metrics(
    length_logits: jax.Array, target_class: jax.Array, rows: jax.Array
) -> dict[str, jax.Array]:
    """Sums of the length classifier's cross entropy and hits over the real rows.

    Args:
      length_logits: float[B, C]; target_class: int[B]; rows: bool[B], rows that
        hold an example (padding rows count for nothing).
    Returns:
      {"length_loss", "length_correct", "length_rows"}: float32 scalars.
    """
    log_probs = jax.nn.log_softmax(length_logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, target_class[:, None], axis=-1)[:, 0]
    weight = rows.astype(jnp.float32)
    hit = (jnp.argmax(length_logits, axis=-1) == target_class).astype(jnp.float32)
    return {
        "length_loss": (nll * weight).sum(),
        "length_correct": (hit * weight).sum(),
        "length_rows": weight.sum(),
    }
