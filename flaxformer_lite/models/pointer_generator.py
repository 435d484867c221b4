"""The pointer-generator output head (See et al. 2017): the gate and the mixture (its settings
are the `copy` section, `config/variants.CopyHead`).

    P(w) = p_gen * P_vocab(w) + (1 - p_gen) * sum_{s : copy_ids[s] = w} a[s]

`a` is the cross-attention of one decoder layer averaged over chosen heads, and
p_gen = sigmoid(w_h . h + w_e . e + w_c . c + b) with h the decoder output the
softmax reads, e the embedding of the previous token (the decoder input) and
c = sum_s a[s] encoded[s] the attention context. Extended ids V + k (source
pieces the vocabulary cannot spell, `data/extended_ids.py`) have no vocabulary
probability, only copy mass. Everything is computed as log-probabilities in
float32, without the log of an exact zero: an id no source position holds gets
`IMPOSSIBLE`, a finite floor far below any real log-probability.

Letter legend as in `nn/attention.py`; W = V + S is the extended vocabulary
(ids V + k, k < S).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.constants import IMPOSSIBLE
from flaxformer_lite.nn import precision


def copy_attention(weights: jax.Array, heads: tuple[int, ...]) -> jax.Array:
    """The copy distribution over source positions: float32[B, N, T, S] -> float32[B, T, S],
    the mean of the chosen heads (all when empty); rows sum to 1 where the layer's do."""
    if heads:
        weights = weights[:, jnp.asarray(heads)]
    return weights.astype(jnp.float32).mean(axis=1)


def copy_mass(attention: jax.Array, copy_ids: jax.Array, size: int) -> jax.Array:
    """Attention summed per id: float32[B, T, S], int[B, S] -> float32[B, T, W].

    out[b, t, w] = sum over the positions s with copy_ids[b, s] = w of attention[b, t, s].
    """
    t = attention.shape[1]

    def one(a, ids):  # [T, S], [S]
        return jnp.zeros((t, size), jnp.float32).at[:, ids].add(a)

    return jax.vmap(one)(attention.astype(jnp.float32), copy_ids)


def log_mixture(
    logits: jax.Array, gate: jax.Array, attention: jax.Array, copy_ids: jax.Array, size: int
) -> jax.Array:
    """log P(w) of the pointer-generator, float32[B, T, W].

    Args:
      logits: float[B, T, V] of the vocabulary softmax.
      gate: float[B, T], the logit of p_gen (sigmoid(gate) = p_gen).
      attention: float32[B, T, S] copy distribution (`copy_attention`).
      copy_ids: int[B, S] the (extended) id each source position holds.
      size: W >= V, the extended vocabulary.
    """
    vocab = logits.shape[-1]
    log_vocab = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    log_vocab = jnp.pad(log_vocab, ((0, 0), (0, 0), (0, size - vocab)), constant_values=IMPOSSIBLE)
    mass = copy_mass(attention, copy_ids, size)
    has_mass = mass > 0.0
    log_copy = jnp.where(has_mass, jnp.log(jnp.where(has_mass, mass, 1.0)), IMPOSSIBLE)
    gate = gate.astype(jnp.float32)[..., None]
    return jnp.logaddexp(jax.nn.log_sigmoid(gate) + log_vocab, jax.nn.log_sigmoid(-gate) + log_copy)


class CopyGate(nn.Module):
    """gate = w_h . hidden + w_e . embedded + w_c . context + b, the logit of p_gen.

    One linear map of [hidden; embedded; context] (a [3D] kernel), stored as three
    [D] vectors so that each keeps the model dimension's logical axis.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, hidden: jax.Array, embedded: jax.Array, context: jax.Array) -> jax.Array:
        """[B, T, D] x 3 -> float32[B, T]."""
        cfg = self.config
        init = nn.initializers.normal(stddev=(3 * cfg.d_model) ** -0.5)
        total = jnp.zeros(hidden.shape[:-1], jnp.float32)
        for name, x in (("hidden", hidden), ("embedded", embedded), ("context", context)):
            w = self.param(
                f"{name}_kernel",
                nn.with_logical_partitioning(init, ("embed",)),
                (cfg.d_model,),
                cfg.param_dtype,
            )
            x, w = x.astype(cfg.dtype), w.astype(cfg.dtype)
            total = total + precision.dot_f32("btd,d->bt", x, w)
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ()), (), jnp.float32
        )
        return total + bias
