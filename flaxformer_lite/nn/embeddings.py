"""Token embeddings (also the tied softmax), feature projection and positional encodings.

The encoder's front end is either `Embed` (token ids) or `FeatureProjection`
(continuous features such as filterbank frames); both give [B, S, D].
Letter legend as in `attention.py` (B batch, T length, D d_model, F feature size, V vocab).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn.layers import ACTIVATIONS, Dense
from flaxformer_lite.nn.precision import dot_f32
from flaxformer_lite.nn.vocab import mask_logits, zero_padding_init
from flaxformer_lite.parallel.partitioning import constrain


def sinusoidal_positions(positions: jax.Array, d_model: int) -> jax.Array:
    """The paper's encoding (§3.5), for any positions.

    PE(pos, 2i) = sin(pos / 10000^(2i / d_model)),
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model)).

    Args:
      positions: int[...] absolute positions (0-based).
      d_model: model dimension (even or odd).
    Returns:
      float32[..., d_model].
    """
    i = np.arange(d_model) // 2  # the pair index i of each dimension
    inv_freq = jnp.asarray(np.power(10000.0, -2.0 * i / d_model), jnp.float32)  # [D]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D]
    even = np.arange(d_model) % 2 == 0
    return jnp.where(even, jnp.sin(angles), jnp.cos(angles))


class Embed(nn.Module):
    """Token embedding that can also act as the pre-softmax projection (§3.4).

    Looked-up vectors are multiplied by sqrt(d_model), as in the paper; the
    matrix is initialised with std d_model^-0.5 so the scaled embedding has
    unit variance and the tied output logits start small. The table stores
    `config.padded(num_embeddings)` rows, the padding zero (`nn/vocab.py`).
    """

    num_embeddings: int  # the real vocabulary V
    config: TransformerConfig

    def setup(self):
        cfg = self.config
        init = nn.initializers.normal(stddev=cfg.d_model**-0.5)
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(
                zero_padding_init(init, self.num_embeddings, axis=0), ("vocab", "embed")
            ),
            (cfg.padded(self.num_embeddings), cfg.d_model),
            cfg.param_dtype,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int[B, T] -> [B, T, D], scaled by sqrt(d_model)."""
        cfg = self.config
        # The table whole along `embed` (gathered over fsdp, as a layer's weights are):
        # a lookup in its fsdp slices would give [B, T, D / fsdp] pieces that have to
        # be exchanged as activations (all-to-all) to reach the batch layout.
        table = constrain(self.embedding, ("vocab", "activation_embed"))
        x = jnp.take(table, tokens, axis=0).astype(cfg.dtype)
        return constrain(x * jnp.asarray(math.sqrt(cfg.d_model), cfg.dtype), ACTIVATIONS)

    def mixture(self, weights: jax.Array) -> jax.Array:
        """The weighted average of embeddings, scaled as `__call__`: float[B, T, Vp] -> [B, T, D]
        (Vp: the padded vocabulary, as the logits; padded entries weigh nothing).

        One-hot weights give exactly the looked-up vectors of those tokens.
        """
        cfg = self.config
        x = dot_f32(
            "btv,vd->btd", weights.astype(cfg.dtype), self.embedding.astype(cfg.dtype)
        ).astype(cfg.dtype)
        return x * jnp.asarray(math.sqrt(cfg.d_model), cfg.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding matrix: [B, T, D] -> float32[B, T, Vp], the padded
        columns PADDED_LOGIT (`nn/vocab.py`)."""
        cfg = self.config
        *lead, d = x.shape
        # Over merged positions, as in `project`; float32 logits from compute-dtype
        # operands, and compute-dtype matmuls in the backward pass too (`precision.py`).
        logits = dot_f32(
            "md,vd->mv", x.astype(cfg.dtype).reshape(-1, d), self.embedding.astype(cfg.dtype)
        )  # [M, Vp]
        logits = mask_logits(logits.reshape(*lead, -1), self.num_embeddings)
        if len(lead) != 2:
            return logits
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))


class AddPositions(nn.Module):
    """Adds positional encodings: sinusoidal, learned (Table 3 row E) or none."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """x: [B, T, D]; positions: int[B, T] or None for 0..T-1. Returns [B, T, D]."""
        cfg = self.config
        if positions is None:
            positions = jnp.arange(x.shape[1])[None, :]  # [1, T]
        if cfg.positions == "none":
            return x
        if cfg.positions == "sinusoidal":
            pe = sinusoidal_positions(positions, cfg.d_model)
        else:
            table = self.param(
                "pos_embedding",
                nn.with_logical_partitioning(
                    nn.initializers.normal(stddev=0.02), ("length", "embed")
                ),
                (cfg.max_len, cfg.d_model),
                cfg.param_dtype,
            )
            pe = jnp.take(table, positions, axis=0)
        return x + pe.astype(x.dtype)


class FeatureProjection(nn.Module):
    """Continuous inputs float[B, S, F] -> [B, S, D] through one linear map (the "kernel"/"bias"
    of a `Dense`), the front end of encoders that read features instead of token ids."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, features: jax.Array) -> jax.Array:
        """float[B, S, F] -> [B, S, D]."""
        cfg = self.config
        return Dense(cfg.d_model, cfg, ("features", "embed"), name="projection")(features)
