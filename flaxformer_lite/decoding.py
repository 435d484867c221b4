"""Search algorithms that know nothing about the model.

Every search takes a `TokensToLogits` callable and the cache it starts from.
The cache is an arbitrary pytree owned by the caller's adapter (see
`inference.py`); search code only threads it through.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from flaxformer_lite.attention import PAD_ID


class TokensToLogits(Protocol):
    """One decoding step.

    Args:
      token_ids: int32[batch, 1], the token chosen at the previous step (BOS first).
      cache: the adapter's state (a pytree).
    Returns:
      (logits float32[batch, vocab] for the next token, new cache).
    """

    def __call__(self, token_ids: jax.Array, cache: Any) -> tuple[jax.Array, Any]: ...


def greedy_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    *,
    batch_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
) -> jax.Array:
    """Greedy decoding as one `lax.scan` of `max_len` steps.

    Once a row has emitted EOS it emits PAD_ID; the step still runs (fixed
    shapes) but its choice is discarded.

    Returns:
      int32[batch, max_len] tokens, EOS included, PAD_ID after it.
    """

    def step(carry, _):
        prev, done, cache = carry  # int32[B, 1], bool[B], cache
        logits, cache = tokens_to_logits(prev, cache)  # [B, V]
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        nxt = jnp.where(done, PAD_ID, nxt)
        done = done | (nxt == eos_id)
        return (nxt[:, None], done, cache), nxt

    init = (
        jnp.full((batch_size, 1), bos_id, jnp.int32),
        jnp.zeros((batch_size,), jnp.bool_),
        cache,
    )
    _, tokens = jax.lax.scan(step, init, None, length=max_len)  # [L, B]
    return tokens.T
