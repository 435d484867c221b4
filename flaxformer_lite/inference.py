"""Adapters from a `Transformer` and its parameters to the search functions."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite import decoding
from flaxformer_lite.model import Transformer


def full_recompute_step(
    model: Transformer, params, encoded: jax.Array, inputs: jax.Array, max_len: int
):
    """A `tokens_to_logits` that reruns the whole decoder prefix at every step (no KV cache).

    The cache is {"tokens": int32[B, max_len] decoder inputs so far (PAD
    beyond), "index": int32 scalar}: step i writes the given token at
    position i and returns the logits of position i.

    Args:
      encoded: [B, S, D] encoder output; inputs: int[B, S] source tokens.
    Returns:
      (tokens_to_logits, initial cache).
    """
    batch = inputs.shape[0]

    def tokens_to_logits(token_ids, cache):
        i = cache["index"]
        tokens = jax.lax.dynamic_update_slice(cache["tokens"], token_ids, (0, i))  # [B, L]
        logits = model.apply({"params": params}, encoded, inputs, tokens, method=Transformer.decode)
        step_logits = jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False)  # [B, V]
        return step_logits, {"tokens": tokens, "index": i + 1}

    cache = {"tokens": jnp.zeros((batch, max_len), jnp.int32), "index": jnp.int32(0)}
    return tokens_to_logits, cache


@functools.partial(jax.jit, static_argnames=("model", "max_len", "bos_id", "eos_id"))
def greedy_decode(
    model: Transformer, params, inputs: jax.Array, *, max_len: int, bos_id: int, eos_id: int
) -> jax.Array:
    """Encodes `inputs` int32[B, S] once and greedily decodes int32[B, max_len]."""
    encoded = model.apply({"params": params}, inputs, method=Transformer.encode)
    step, cache = full_recompute_step(model, params, encoded, inputs, max_len)
    return decoding.greedy_search(
        step, cache, batch_size=inputs.shape[0], max_len=max_len, bos_id=bos_id, eos_id=eos_id
    )
