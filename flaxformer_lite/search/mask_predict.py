"""Non-autoregressive search: length candidates and Mask-Predict refinement, model-free.

A non-autoregressive decoder emits every output position in one call. It
must know the output length first, and it can then refine its own output:

  length_candidates  the l most likely lengths of a length classifier's logits
                     (offsets target - source around `classes // 2`, as
                     fairseq's `--pred-length-offset`), scaled by a factor
                     (x0.5 shorter, x2 longer) and clipped to what fits.
  mask_predict       Mask-Predict (Ghazvininejad et al. 2019): call 0 sees
                     every position masked and fills all of them; before call
                     t (t = 1 .. T-1) the floor(n (T - t) / T) lowest-scoring
                     of a row's n tokens are masked again and only those are
                     re-predicted. T = 1 is plain single-pass NAT. One jitted
                     `lax.scan`: exactly T decoder calls.
  best_candidate     picks, per example, the candidate with the highest mean
                     token log-probability and orders all of them best first.

Like `search/sampling.py` and `search/beam.py`, nothing here knows the model: the decoder is
`logits_fn(tokens int32[R, W], valid bool[R, W]) -> float32[R, W, V]`, where
masked positions hold `mask_id` (letters: B examples, l candidates per
example, R = B * l rows, W decoder positions, V vocabulary, C length classes).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from flaxformer_lite.search.primitives import rows_top_k

LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]


def offset_class(target_len: jax.Array, source_len: jax.Array, classes: int) -> jax.Array:
    """The length classifier's target: target - source + classes // 2, clipped to [0, C).

    Args:
      target_len, source_len: int[B] (tokens counted the same way on both sides).
    Returns:
      int32[B].
    """
    offset = target_len.astype(jnp.int32) - source_len.astype(jnp.int32) + classes // 2
    return jnp.clip(offset, 0, classes - 1)


def length_candidates(
    length_logits: jax.Array,
    source_len: jax.Array,
    *,
    beam: int,
    scale: float | jax.Array,
    max_len: int,
) -> jax.Array:
    """The `beam` most likely lengths of each example, most likely first.

    A class c means length source_len + c - C // 2; the length is multiplied by
    `scale`, rounded, and clipped to [1, max_len].

    Args:
      length_logits: float[B, C].
      source_len: int[B].
    Returns:
      int32[B, beam].
    """
    classes = length_logits.shape[-1]
    _, best = rows_top_k(length_logits, beam)  # [B, beam], most likely first
    length = source_len[:, None].astype(jnp.int32) + best - classes // 2
    scaled = jnp.round(length.astype(jnp.float32) * scale).astype(jnp.int32)
    return jnp.clip(scaled, 1, max_len)


def remask(scores: jax.Array, valid: jax.Array, count: jax.Array) -> jax.Array:
    """The `count` lowest-scoring valid positions of each row (ties: the earlier position).

    Args:
      scores: float[R, W]; valid: bool[R, W]; count: int[R].
    Returns:
      bool[R, W], exactly min(count, valid.sum(-1)) True per row.
    """
    keyed = jnp.where(valid, scores, jnp.inf)
    order = jnp.argsort(keyed, axis=-1, stable=True)  # lowest first
    rank = jnp.argsort(order, axis=-1, stable=True)  # rank of each position
    return (rank < count[:, None]) & valid


def mask_predict(
    logits_fn: LogitsFn,
    lengths: jax.Array,
    *,
    width: int,
    iterations: int,
    mask_id: int,
    pad_id: int,
) -> tuple[jax.Array, jax.Array]:
    """Mask-Predict over rows of the given lengths.

    Args:
      lengths: int[R], the decoder positions of each row (1 <= n <= width).
      width: W, the decoder positions of every row (the rest is padding).
      iterations: T >= 1 decoder calls.
    Returns:
      (tokens int32[R, W], pad_id beyond a row's length; their log-probabilities
      float32[R, W], each from the call that last predicted it, 0 beyond the
      length).
    """
    if iterations < 1:
        raise ValueError(f"Mask-Predict needs iterations >= 1, got {iterations}")
    valid = jnp.arange(width)[None, :] < lengths[:, None]  # [R, W]
    tokens = jnp.where(valid, mask_id, pad_id).astype(jnp.int32)
    scores = jnp.zeros(valid.shape, jnp.float32)

    def call(carry, t):
        tokens, scores, masked = carry
        log_probs = jax.nn.log_softmax(logits_fn(tokens, valid).astype(jnp.float32), axis=-1)
        best = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)  # [R, W]
        best_score = jnp.max(log_probs, axis=-1)
        tokens = jnp.where(masked, best, tokens)
        scores = jnp.where(masked, best_score, scores)
        # Before call t + 1: floor(n (T - t - 1) / T) lowest-scoring tokens again.
        count = (lengths * (iterations - t - 1)) // iterations
        masked = remask(scores, valid, count)
        return (jnp.where(masked, mask_id, tokens), scores, masked), None

    (tokens, scores, _), _ = jax.lax.scan(
        call, (tokens, scores, valid), jnp.arange(iterations, dtype=jnp.int32)
    )
    return tokens, jnp.where(valid, scores, 0.0)


def best_candidate(
    tokens: jax.Array, token_scores: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Orders each example's candidates by mean token log-probability, best first.

    Args:
      tokens: int[B, l, L]; token_scores: float[B, l, L], 0 beyond a candidate's
        length; lengths: int[B, l] >= 1, the tokens each mean is over.
    Returns:
      (tokens int[B, l, L], mean log-probabilities float32[B, l]), best first.
    """
    mean = token_scores.sum(-1) / jnp.maximum(lengths, 1).astype(jnp.float32)  # [B, l]
    order = jnp.argsort(-mean, axis=-1, stable=True)
    return (
        jnp.take_along_axis(tokens, order[..., None], axis=1),
        jnp.take_along_axis(mean, order, axis=1),
    )


def truncate_at_eos(tokens: jax.Array, eos_id: int, pad_id: int) -> jax.Array:
    """Everything after a row's first EOS becomes padding; a row without one ends in EOS.

    Args:
      tokens: int[R, L].
    Returns:
      int32[R, L], exactly one EOS per row.
    """
    is_eos = tokens == eos_id
    after = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0  # past the first EOS
    out = jnp.where(after, pad_id, tokens)
    missing = ~is_eos.any(-1)
    return out.at[:, -1].set(jnp.where(missing, eos_id, out[:, -1])).astype(jnp.int32)
