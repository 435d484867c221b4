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

from flaxformer_lite.constants import IMPOSSIBLE, PAD_ID
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


def _safe_log(mass: jax.Array) -> jax.Array:
    """log of copy masses >= 0, IMPOSSIBLE where a mass is exactly 0 (no log 0, no NaN grad)."""
    positive = mass > 0.0
    return jnp.where(positive, jnp.log(jnp.where(positive, mass, 1.0)), IMPOSSIBLE)


def parts_token_losses(
    parts: dict[str, jax.Array], labels: jax.Array, label_smoothing: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`token_losses` and the argmax, from the mixture's inputs, without a [B, T, W] tensor.

    Only the vocabulary softmax is V wide; the copy side is read at the S source positions:
    log P(w) = log p_gen + log P_vocab(w) for every w no source position holds, so

      sum_{w < V} log P(w) = V log p_gen + sum_w log P_vocab(w)
                             + sum over the distinct source ids w < V of
                               [log P(w) - log p_gen - log P_vocab(w)],

    and the argmax is the vocabulary's argmax or one of the source ids.

    Args:
      parts: {"logits" float[B, T, V], "gate" float[B, T], "attention" float32[B, T, S],
        "copy_ids" int[B, S]} (`CopyTransformer.decode(parts=True)`).
      labels: int[B, T] (extended ids allowed).
    Returns:
      (smoothed float32[B, T], nll float32[B, T], both 0 at padding; predicted int32[B, T]).
    """
    logits = parts["logits"].astype(jnp.float32)
    vocab_size = logits.shape[-1]
    gate = parts["gate"].astype(jnp.float32)
    attention, copy_ids = parts["attention"].astype(jnp.float32), parts["copy_ids"]
    log_vocab = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V]
    log_gen, log_copy = jax.nn.log_sigmoid(gate), jax.nn.log_sigmoid(-gate)  # [B, T]

    def log_p(ids, mass):  # log P of ids int[B, T, K] with copy masses float32[B, T, K]
        in_vocab = ids < vocab_size
        vocab = jnp.take_along_axis(log_vocab, jnp.where(in_vocab, ids, 0), axis=-1)
        vocab = jnp.where(in_vocab, vocab, IMPOSSIBLE)
        return jnp.logaddexp(log_gen[..., None] + vocab, log_copy[..., None] + _safe_log(mass))

    t = labels.shape[1]
    source_ids = jnp.broadcast_to(copy_ids[:, None, :], attention.shape)  # [B, T, S]
    same = (copy_ids[:, :, None] == copy_ids[:, None, :]).astype(jnp.float32)  # [B, S, S]
    at_source = log_p(source_ids, jnp.einsum("bts,bsr->btr", attention, same))  # [B, T, S]
    label_mass = jnp.sum(attention * (source_ids == labels[..., None]), axis=-1)  # [B, T]
    gold = log_p(labels[..., None], label_mass[..., None])[..., 0]  # [B, T]
    weights = (labels != PAD_ID).astype(jnp.float32)
    nll = -gold
    smoothed = nll
    if label_smoothing > 0.0:
        s = copy_ids.shape[1]
        earlier = jnp.tril(jnp.ones((s, s), jnp.bool_), k=-1)  # [s, r]: r before s
        first = ~jnp.any((same > 0) & earlier[None], axis=-1)  # [B, S] first holder of its id
        counted = (first & (copy_ids < vocab_size))[:, None, :]  # [B, 1, S]
        plain = log_gen[..., None] + jnp.take_along_axis(
            log_vocab, jnp.broadcast_to(jnp.minimum(copy_ids, vocab_size - 1)[:, None], (
                copy_ids.shape[0], t, s)), axis=-1
        )  # fmt: skip
        correction = jnp.sum(jnp.where(counted, at_source - plain, 0.0), axis=-1)  # [B, T]
        all_vocab = vocab_size * log_gen + log_vocab.sum(axis=-1) + correction
        in_vocab = labels < vocab_size
        others = all_vocab - jnp.where(in_vocab, gold, 0.0)
        low = jnp.where(in_vocab, label_smoothing / (vocab_size - 1), label_smoothing / vocab_size)
        smoothed = (1.0 - label_smoothing) * nll - low * others
    best_vocab = jnp.argmax(log_vocab, axis=-1).astype(jnp.int32)  # [B, T]
    best_vocab_score = log_gen + jnp.max(log_vocab, axis=-1)
    best_source = jnp.argmax(at_source, axis=-1)  # [B, T]
    best_source_score = jnp.max(at_source, axis=-1)
    best_source_id = jnp.take_along_axis(source_ids, best_source[..., None], axis=-1)[..., 0]
    predicted = jnp.where(best_source_score >= best_vocab_score, best_source_id, best_vocab)
    return smoothed * weights, nll * weights, predicted.astype(jnp.int32)


def parts_metrics_sums(
    parts: dict[str, jax.Array],
    labels: jax.Array,
    label_smoothing: float,
    segments: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """`metrics_sums` from the mixture's inputs (`parts_token_losses`): training's path."""
    smoothed, nll, predicted = parts_token_losses(parts, labels, label_smoothing)
    return cross_entropy.sums_of(smoothed, nll, predicted, labels, segments)


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
