"""Embeddings, positional encodings, the feed-forward block and residual wrappers.

Letter legend as in `attention.py` (B batch, T length, D d_model, F d_ff, V vocab).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn.dropout import Dropout


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
    unit variance and the tied output logits start small.
    """

    num_embeddings: int
    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(
                nn.initializers.normal(stddev=cfg.d_model**-0.5), ("vocab", "embed")
            ),
            (self.num_embeddings, cfg.d_model),
            cfg.param_dtype,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int[B, T] -> [B, T, D], scaled by sqrt(d_model)."""
        cfg = self.config
        x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.dtype)
        return x * jnp.asarray(math.sqrt(cfg.d_model), cfg.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding matrix: [B, T, D] -> float32[B, T, V]."""
        cfg = self.config
        *lead, d = x.shape
        logits = jnp.einsum(  # over merged positions, as in `project`
            "md,vd->mv",
            x.astype(cfg.dtype).reshape(-1, d),
            self.embedding.astype(cfg.dtype),
            preferred_element_type=jnp.float32,
        )  # [M, V]
        return logits.reshape(*lead, -1)


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


def project(x: jax.Array, kernel: jax.Array, in_dims: int = 1) -> jax.Array:
    """Contracts the last `in_dims` axes of x with the first `in_dims` of kernel.

    x [..., *in], kernel [*in, *out] -> [..., *out], computed as ONE 2-D
    matmul [M, K] x [K, N] with M = all leading positions, K = prod(in),
    N = prod(out); the reshapes are free. The multi-axis einsum gives the
    same numbers, but its weight gradient contracts over two axes (batch and
    length) and XLA:CPU then re-lays out activations and weights around the
    matmuls; the 2-D form made a base-model train step ~10% faster on 2 CPU
    cores. Merging kernel axes keeps their sharding as long as only the most
    major of the merged axes is sharded (heads before head_dim: yes).
    """
    lead = x.shape[: x.ndim - in_dims]
    k = math.prod(kernel.shape[:in_dims])
    y = x.reshape(-1, k) @ kernel.reshape(k, -1)  # [M, K] x [K, N] -> [M, N]
    return y.reshape(*lead, *kernel.shape[in_dims:])


class Dense(nn.Module):
    """y = x W + b over the last axis, W [in, features] (flax's "kernel"/"bias" names)."""

    features: int
    config: TransformerConfig
    axes: tuple[str, str]  # logical names of the kernel's (in, out) axes
    kernel_init: Callable = nn.initializers.xavier_uniform()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., in] -> [..., features]."""
        cfg = self.config
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, self.axes),
            (x.shape[-1], self.features),
            cfg.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), self.axes[1:]),
            (self.features,),
            cfg.param_dtype,
        )
        return project(x.astype(cfg.dtype), kernel.astype(cfg.dtype)) + bias.astype(cfg.dtype)


def _activation(name: str) -> Callable[[jax.Array], jax.Array]:
    return {"relu": nn.relu, "gelu": nn.gelu}[name]


class FeedForward(nn.Module):
    """Position-wise FFN(x) = act(x W1 + b1) W2 + b2 (§3.3)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, D]."""
        cfg = self.config
        h = Dense(cfg.d_ff, cfg, ("embed", "mlp"), name="wi")(x)  # [B, T, F]
        h = _activation(cfg.activation)(h)
        return Dense(cfg.d_model, cfg, ("mlp", "embed"), name="wo")(h)  # [B, T, D]


def layer_norm(config: TransformerConfig, name: str) -> nn.LayerNorm:
    """LayerNorm with scale and bias on `embed`, statistics in float32."""
    return nn.LayerNorm(
        epsilon=config.layer_norm_epsilon,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        name=name,
    )


class Residual(nn.Module):
    """Residual connection + LayerNorm around one sub-layer.

    post-LN (§3.1, §5.4): LayerNorm(x + Dropout(Sublayer(x))).
    pre-LN (option):      x + Dropout(Sublayer(LayerNorm(x))); the stack then
                          ends with one more LayerNorm.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self, sublayer: Callable[[jax.Array], jax.Array], x: jax.Array, *, deterministic: bool
    ) -> jax.Array:
        """x: [B, T, D] -> [B, T, D]."""
        cfg = self.config
        norm = layer_norm(cfg, "norm")
        drop = Dropout(cfg.dropout_rate, cfg.dropout_rng)
        if cfg.norm == "pre":
            return x + drop(sublayer(norm(x)), deterministic=deterministic)
        return norm(x + drop(sublayer(x), deterministic=deterministic))
