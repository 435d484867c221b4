"""Greedy decoding and sampling (temperature, top-k, nucleus), model-free.

Both take a `TokensToLogits` step (`search/primitives.py`) and run on the device
as one `lax.while_loop` of at most `max_len` steps that stops once every row has
ended: a search compiles once per shape and runs without Python work per token.
Sequences returned hold the generated tokens only (no BOS), EOS included, and
PAD_ID after EOS.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.search.primitives import TokensToLogits, rows_top_k


def _filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Keeps the top-k tokens and the smallest nucleus with mass >= top_p; the rest -inf.

    Args:
      logits: float32[batch, vocab] (already divided by the temperature).
    Returns:
      float32[batch, vocab].
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = rows_top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if 0.0 < top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)  # [B, V] best first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # A token is kept while the mass *before* it is below top_p, so the
        # token that crosses top_p is in the nucleus and the best is always kept.
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    *,
    batch_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    rng: jax.Array | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_len: int = 0,
    first_tokens: jax.Array | None = None,
) -> jax.Array:
    """Greedy decoding (temperature 0) or sampling: a loop of up to `max_len` steps.

    Each row draws from its own key stream (the step key folded with the row
    index), so a row's sample does not depend on the batch it sits in. Once a
    row has emitted EOS it emits PAD_ID; once every row has, the loop stops.

    Args:
      rng: PRNG key; required when temperature > 0.
      temperature: 0 = argmax; otherwise logits / temperature.
      top_k: keep the k most likely tokens (0 = all).
      top_p: nucleus sampling mass (1.0 = all).
      min_len: EOS is forbidden until this many tokens were generated.
      first_tokens: int32[batch] fed at the first step (default: BOS), e.g. the
        last token of a forced prefix whose other tokens are already cached.
    Returns:
      int32[batch, max_len].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs an explicit rng key")
    choose = functools.partial(
        _choose_tokens,
        rng=rng,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_len=min_len,
        eos_id=eos_id,
    )

    def step(carry, i):
        prev, done, cache = carry  # int32[B, 1], bool[B], cache
        logits, cache = tokens_to_logits(prev, cache)  # [B, V]
        nxt = jnp.where(done, PAD_ID, choose(logits, i))
        done = done | (nxt == eos_id)
        return (nxt[:, None], done, cache), nxt

    if first_tokens is None:
        first_tokens = jnp.full((batch_size,), bos_id, jnp.int32)
    init = (
        first_tokens.astype(jnp.int32)[:, None],
        jnp.zeros((batch_size,), jnp.bool_),
        cache,
    )
    return _loop_until_done(step, init, max_len, batch_size).T


def _loop_until_done(step, init, max_len: int, batch_size: int) -> jax.Array:
    """`lax.scan(step, init, arange(max_len))`'s outputs int32[max_len, B], as a
    `lax.while_loop` that stops once every row emitted EOS (init[1], the done flags,
    all set); the steps it skips would have written PAD_ID, as the buffer holds."""

    def cond(loop):
        i, carry, _ = loop
        return (i < max_len) & ~jnp.all(carry[1])

    def body(loop):
        i, carry, tokens = loop
        carry, nxt = step(carry, i)
        return i + 1, carry, jax.lax.dynamic_update_index_in_dim(tokens, nxt, i, 0)

    tokens = jnp.full((max_len, batch_size), PAD_ID, jnp.int32)
    return jax.lax.while_loop(cond, body, (jnp.int32(0), init, tokens))[2]


def _choose_tokens(
    logits: jax.Array,
    i: jax.Array,
    *,
    rng: jax.Array | None,
    temperature: float,
    top_k: int,
    top_p: float,
    min_len: int,
    eos_id: int,
) -> jax.Array:
    """int32[B]: the argmax (temperature 0) or a sample of each row of logits [B, V] at step i.

    Row r samples with the step key folded with r, so its draw does not depend on the batch.
    """
    logits = logits.astype(jnp.float32)
    logits = jnp.where((i < min_len) & (jnp.arange(logits.shape[-1]) == eos_id), -jnp.inf, logits)
    if temperature == 0.0:
        nxt = jnp.argmax(logits, axis=-1)
    else:
        filtered = _filter_logits(logits / temperature, top_k, top_p)
        rows = jnp.arange(logits.shape[0])
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(rng, i), r))(rows)
        nxt = jax.vmap(jax.random.categorical)(keys, filtered)
    return nxt.astype(jnp.int32)


def greedy_search(tokens_to_logits: TokensToLogits, cache: Any, **kwargs) -> jax.Array:
    """Greedy decoding: `sample_search` at temperature 0. Returns int32[batch, max_len]."""
    return sample_search(tokens_to_logits, cache, temperature=0.0, **kwargs)
