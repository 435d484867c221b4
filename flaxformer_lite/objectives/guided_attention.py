"""Guided attention loss (Tachibana et al., 2018, §4.1): cross-attention near the diagonal.

W[n, t] = 1 - exp(-(n/N - t/T)^2 / (2 g^2)), with n the decoder position, N the
example's target length (tokens incl. EOS), t the encoder position and T the
example's encoder valid length (after subsampling). The penalty is the mean of
A[n, t] * W[n, t] over the valid cells of the chosen layers and heads.

Normalisation: the project's losses are sums that the train step divides by the
batch's target token count (`training/step.py`). `weighted_sum` returns
weight * mean(A*W) * tokens, so after that division the training objective is
cross-entropy per token + weight * mean(A*W), whatever the batch's lengths.

Letter legend as in `nn/attention.py` (B batch, N heads, T target length, S
encoder length).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def guide_weights(target_valid: jax.Array, source_valid: jax.Array, sigma: float) -> jax.Array:
    """W float32[B, T, S] (0 at invalid cells) from bool[B, T], bool[B, S] prefix validities."""
    n_len = jnp.maximum(target_valid.sum(-1), 1).astype(jnp.float32)  # [B]
    t_len = jnp.maximum(source_valid.sum(-1), 1).astype(jnp.float32)  # [B]
    n = jnp.arange(target_valid.shape[1], dtype=jnp.float32)[None, :] / n_len[:, None]  # [B, T]
    t = jnp.arange(source_valid.shape[1], dtype=jnp.float32)[None, :] / t_len[:, None]  # [B, S]
    w = 1.0 - jnp.exp(-((n[:, :, None] - t[:, None, :]) ** 2) / (2.0 * sigma**2))  # [B, T, S]
    return jnp.where(target_valid[:, :, None] & source_valid[:, None, :], w, 0.0)


def guided_attention_loss(
    weights: jax.Array, target_valid: jax.Array, source_valid: jax.Array, sigma: float
) -> tuple[jax.Array, jax.Array]:
    """(sum of A * W over valid cells, number of valid cells), both float32 scalars.

    Args:
      weights: attention probabilities float32[B, N, T, S] (the chosen heads).
      target_valid: bool[B, T] target tokens (targets != PAD, EOS included).
      source_valid: bool[B, S] encoder positions holding input (after subsampling).
      sigma: the width g of the guide.
    """
    w = guide_weights(target_valid, source_valid, sigma)  # [B, T, S]
    total = jnp.sum(weights.astype(jnp.float32) * w[:, None])
    cells = target_valid.sum(-1).astype(jnp.float32) * source_valid.sum(-1)  # [B]
    return total, cells.sum() * weights.shape[1]


def weighted_sum(total: jax.Array, cells: jax.Array, tokens: jax.Array, weight: float):
    """The term added to the summed loss: weight * mean(A*W) * tokens (see module docstring)."""
    return weight * total / jnp.maximum(cells, 1.0) * tokens
