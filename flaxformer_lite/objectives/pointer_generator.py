"""The label-smoothed NLL of the pointer-generator mixture (`models/pointer_generator.py`).

The model gives log P(w) over the extended vocabulary W = V + S directly (the
mixture is not a softmax of logits), so the loss reads those log-probabilities:

  nll      = -log P(label)
  smoothed = -(1 - eps) log P(label) - eps / (V - 1) * sum_{w < V, w != label} log P(w)

The smoothing mass goes to the vocabulary only (eps / V each when the label is
an extended id): an extended id no source position holds is impossible, and
its log-probability, a finite floor, must not enter the loss. Every log P(w)
with w < V is finite: the vocabulary softmax never gives an exact 0 in log space.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.objectives import cross_entropy


def token_losses(
    log_probs: jax.Array, labels: jax.Array, label_smoothing: float, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """(smoothed, nll), each float32[B, T] and 0 at padding, of log P float32[B, T, W]."""
    weights = (labels != PAD_ID).astype(jnp.float32)
    gold = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]  # [B, T]
    nll = -gold
    smoothed = nll
    if label_smoothing > 0.0:
        in_vocab = labels < vocab_size
        others = log_probs[..., :vocab_size].sum(axis=-1) - jnp.where(in_vocab, gold, 0.0)
        low = jnp.where(in_vocab, label_smoothing / (vocab_size - 1), label_smoothing / vocab_size)
        smoothed = (1.0 - label_smoothing) * nll - low * others
    return smoothed * weights, nll * weights


def metrics_sums(
    log_probs: jax.Array,
    labels: jax.Array,
    label_smoothing: float,
    vocab_size: int,
    segments: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """`cross_entropy.metrics_sums` for the mixture's log P float32[B, T, W]."""
    smoothed, nll = token_losses(log_probs, labels, label_smoothing, vocab_size)
    predicted = jnp.argmax(log_probs, axis=-1)
    return cross_entropy.sums_of(smoothed, nll, predicted, labels, segments)


def gold_log_probs(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
    """log P(label) float32[B, T], 0 at padding."""
    gold = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return jnp.where(labels != PAD_ID, gold, 0.0)
