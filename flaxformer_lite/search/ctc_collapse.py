"""CTC decoding: the best symbol at every position, then the collapse, model-free.

A CTC decoder (`models/ctc_nat.py`) emits a token or the blank at each of its
positions. Greedy (best-path) decoding takes the argmax of every position in
the one decoder call, merges each run of equal symbols into one and drops the
blanks: "a a _ a b b _" reads "a a b" (the blank separates the two a's).
Everything has fixed shapes, so the whole search is one jitted program: the
tokens are written left-aligned into a padded row and their count returned.

Letters: B rows, T decoder positions, W output width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def collapse(
    symbols: jax.Array, valid: jax.Array, *, blank_id: int, pad_id: int, width: int
) -> tuple[jax.Array, jax.Array]:
    """Merges repeats and drops blanks, row by row.

    Args:
      symbols: int[B, T]; valid: bool[B, T], a prefix of each row (padding is ignored).
      width: W, the output columns; tokens beyond W are dropped.
    Returns:
      (tokens int32[B, W], left-aligned, pad_id after them; lengths int32[B] <= W).
    """
    previous = jnp.pad(symbols[:, :-1], ((0, 0), (1, 0)), constant_values=blank_id)
    keep = valid & (symbols != blank_id) & (symbols != previous)  # [B, T]
    column = jnp.cumsum(keep, axis=-1) - 1  # where each kept token goes
    column = jnp.where(keep & (column < width), column, width)  # the rest: out of range
    rows = jnp.broadcast_to(jnp.arange(symbols.shape[0])[:, None], symbols.shape)
    tokens = jnp.full((symbols.shape[0], width), pad_id, jnp.int32)
    tokens = tokens.at[rows, column].set(symbols.astype(jnp.int32), mode="drop")
    return tokens, jnp.minimum(keep.sum(-1), width).astype(jnp.int32)


def best_path(
    logits: jax.Array, valid: jax.Array, *, blank_id: int, pad_id: int, width: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy CTC decoding: argmax per position, then `collapse`.

    Args:
      logits: float[B, T, V]; valid: bool[B, T].
    Returns:
      (tokens int32[B, W], lengths int32[B], the best path's log-probability
      float32[B]: the sum of each valid position's largest log-probability, a lower
      bound of the output's CTC log-likelihood).
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    symbols = jnp.argmax(log_probs, axis=-1)  # [B, T]
    score = jnp.where(valid, jnp.max(log_probs, axis=-1), 0.0).sum(-1)
    tokens, lengths = collapse(symbols, valid, blank_id=blank_id, pad_id=pad_id, width=width)
    return tokens, lengths, score
