"""Label-smoothed cross entropy and the per-batch metrics of training and eval."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.nn.vocab import mask_logits, real_columns


def smoothed_targets(labels: jax.Array, vocab_size: int, label_smoothing: float) -> jax.Array:
    """The smoothed target distribution q (Szegedy et al. 2016; paper §5.4).

    q = 1 - eps on the gold token and eps / (V - 1) on every other token.

    Args:
      labels: int[B, T].
    Returns:
      float32[B, T, V], each row summing to 1.
    """
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    one_hot = jax.nn.one_hot(labels, vocab_size, dtype=jnp.float32)
    return one_hot * (confidence - low) + low


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token losses.

    Args:
      logits: float[B, T, Vp].
      labels: int[B, T], PAD_ID where there is no target.
      label_smoothing: eps_ls.
      vocab_size: the real vocabulary V <= Vp (None: Vp). The columns from V on are
        padding (`nn/vocab.py`): probability 0, and no smoothing mass.
    Returns:
      (smoothed float32[B, T] = -sum_v q_v log p_v,
       nll float32[B, T] = -log p_label), both 0 at padding.
    """
    weights = (labels != PAD_ID).astype(jnp.float32)
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    logits = mask_logits(logits.astype(jnp.float32), vocab_size)
    smoothed, nll = _token_losses(logits, labels, label_smoothing, vocab_size)
    return smoothed * weights, nll * weights


# The losses and their gradient are written by hand (a custom VJP) so that the
# [B, T, V] tensors are only read: the forward pass keeps the logits and the
# log-normaliser, and the backward pass writes d(logits) = p - q in one
# elementwise pass. Autodiff of log_softmax instead materialises log p and
# runs several [B, T, V] passes (docs/results.md: the measured gain).


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _token_losses(logits, labels, label_smoothing, vocab_size):
    """(smoothed, nll), each float32[B, T], unmasked; logits float32[B, T, Vp] whose columns
    from `vocab_size` on are PADDED_LOGIT."""
    return _token_losses_fwd(logits, labels, label_smoothing, vocab_size)[0]


def _token_losses_fwd(logits, labels, label_smoothing, vocab_size):
    # Padded columns add exp(PADDED_LOGIT - peak) == 0 to the normaliser.
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1))  # [B, T]
    log_z = peak + jnp.log(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))  # [B, T]
    gold = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]  # [B, T]
    nll = log_z - gold
    if label_smoothing > 0.0:
        # -sum_v q_v log p_v with q from `smoothed_targets`, without building q:
        # (confidence - low) * nll - low * sum_v log p_v, and
        # sum_v log p_v = sum_v logits_v - V * log_z.
        low = label_smoothing / (vocab_size - 1)
        confidence = 1.0 - label_smoothing
        real = real_columns(logits.shape[-1], vocab_size)
        total = jnp.sum(logits if real is None else jnp.where(real, logits, 0.0), axis=-1)
        sum_log_p = total - vocab_size * log_z
        smoothed = (confidence - low) * nll - low * sum_log_p
    else:
        smoothed = nll
    return (smoothed, nll), (logits, labels, log_z)


def _token_losses_bwd(label_smoothing, vocab_size, residuals, cotangents):
    logits, labels, log_z = residuals
    d_smoothed, d_nll = cotangents  # [B, T] each
    columns = jnp.arange(logits.shape[-1])
    p = jnp.exp(logits - log_z[..., None])  # softmax, [B, T, Vp] (0 at padded columns)
    gold = labels[..., None] == columns  # one-hot, bool[B, T, Vp]
    low = label_smoothing / (vocab_size - 1) if label_smoothing > 0.0 else 0.0
    if low and logits.shape[-1] != vocab_size:
        low = jnp.where(columns < vocab_size, low, 0.0)  # no smoothing mass on padding
    q = jnp.where(gold, 1.0 - label_smoothing, low)  # `smoothed_targets`
    # d smoothed / d logits = p - q; d nll / d logits = p - one_hot.
    d_logits = d_smoothed[..., None] * (p - q) + d_nll[..., None] * (p - gold)
    return d_logits, None


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def metrics_sums(
    logits: jax.Array,
    labels: jax.Array,
    label_smoothing: float,
    segments: jax.Array | None = None,
    vocab_size: int | None = None,
) -> dict[str, jax.Array]:
    """Sums over a batch, to be divided by `tokens` (or `sequences`) after aggregation.

    Args:
      logits: float[B, T, Vp]; labels: int[B, T].
      segments: int[B, T] target segment ids of packed rows (1, 2, ... per
        example, 0 at padding), or None when every row holds one example.
        Sequence accuracy counts examples (segments), not rows.
      vocab_size: the real vocabulary (see `cross_entropy`).
    Returns:
      dict of float32 scalars: loss (smoothed), nll, correct tokens,
      correct whole sequences, tokens, sequences.
    """
    smoothed, nll = cross_entropy(logits, labels, label_smoothing, vocab_size)
    return sums_of(smoothed, nll, jnp.argmax(logits, axis=-1), labels, segments)


def sums_of(
    smoothed: jax.Array,
    nll: jax.Array,
    predicted: jax.Array,
    labels: jax.Array,
    segments: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """`metrics_sums` from per-token losses float32[B, T] (0 at padding) and the argmax
    int[B, T] of any output distribution (the copy head's: `objectives/copy_loss.py`)."""
    weights = (labels != PAD_ID).astype(jnp.float32)
    hit = (predicted == labels).astype(jnp.float32) * weights
    if segments is None:
        real = jnp.any(labels != PAD_ID, axis=-1)  # [B] rows that are not padding rows
        seq_ok = jnp.all((hit > 0) | (weights == 0), axis=-1) & real
        seq_correct, sequences = seq_ok.sum(), real.sum()
    else:
        # Per (row, segment) counts of real and of wrong tokens: segment ids of row b
        # map to slots b * (T + 1) + id, so one segment_sum covers the whole batch.
        b, t = labels.shape
        slot = (segments + jnp.arange(b)[:, None] * (t + 1)).reshape(-1)
        count = jax.ops.segment_sum(weights.reshape(-1), slot, num_segments=b * (t + 1))
        wrong = jax.ops.segment_sum((weights - hit).reshape(-1), slot, num_segments=b * (t + 1))
        present = (count > 0).reshape(b, t + 1).at[:, 0].set(False)  # id 0 is padding
        seq_correct = (present & (wrong.reshape(b, t + 1) == 0)).sum()
        sequences = present.sum()
    return {
        "loss": smoothed.sum(),
        "nll": nll.sum(),
        "correct": hit.sum(),
        "seq_correct": seq_correct.astype(jnp.float32),
        "tokens": weights.sum(),
        "sequences": sequences.astype(jnp.float32),
    }


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Turns aggregated sums into per-token means, perplexity and accuracies."""
    tokens = max(float(sums["tokens"]), 1.0)
    sequences = max(float(sums["sequences"]), 1.0)
    nll = float(sums["nll"]) / tokens
    out = {
        "loss": float(sums["loss"]) / tokens,
        "nll": nll,
        "perplexity": float(jnp.exp(jnp.minimum(nll, 50.0))),
    }
    # A CTC decoder (`models/ctc_nat.py`) has no prediction per target token, and its
    # training passes no sequence accuracy.
    if "correct" in sums:
        out["token_accuracy"] = float(sums["correct"]) / tokens
    if "seq_correct" in sums:
        out["teacher_forced_sequence_accuracy"] = float(sums["seq_correct"]) / sequences
    if "length_rows" in sums:  # a length classifier (`objectives/nat_loss.py`)
        rows = max(float(sums["length_rows"]), 1.0)
        out["length_loss"] = float(sums["length_loss"]) / rows
        out["length_accuracy"] = float(sums["length_correct"]) / rows
    if "unalignable" in sums:  # targets longer than a CTC decoder's positions
        out["unalignable"] = float(sums["unalignable"]) / sequences
    if "aligned_positions" in sums:  # a CTC decoder's argmax against its best alignment
        positions = max(float(sums["aligned_positions"]), 1.0)
        out["aligned_accuracy"] = 1.0 - float(sums["aligned_errors"]) / positions
        if "glanced" in sums:  # the share of decoder inputs glancing revealed
            out["glanced"] = float(sums["glanced"]) / positions
    return out
