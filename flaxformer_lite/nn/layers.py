"""Projections, the feed-forward block, LayerNorm and the residual wrapper.

Letter legend as in `attention.py` (B batch, T length, D d_model, F d_ff).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn.dropout import Dropout
from flaxformer_lite.parallel.partitioning import constrain

ACTIVATIONS = ("activation_batch", "activation_length", "activation_embed")  # [B, T, D]


def project(x: jax.Array, kernel: jax.Array, in_dims: int = 1) -> jax.Array:
    """Contracts the last `in_dims` axes of x with the first `in_dims` of kernel.

    x [..., *in], kernel [*in, *out] -> [..., *out], computed as ONE 2-D
    matmul [M, K] x [K, N] with M = all leading positions, K = prod(in),
    N = prod(out); the reshapes are free. The multi-axis einsum gives the
    same numbers, but its weight gradient contracts over two axes (batch and
    length) and XLA:CPU then re-lays out activations and weights around the
    matmuls, which the 2-D form avoids (docs/results.md, design decisions).
    Merging kernel axes keeps their sharding as long as only the most major
    of the merged axes is sharded (heads before head_dim: yes).
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
        h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
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
    """Residual connection + LayerNorm around one sub-layer, as straight-line code.

    post-LN (§3.1, §5.4): LayerNorm(x + Dropout(Sublayer(x))).
    pre-LN (option):      x + Dropout(Sublayer(LayerNorm(x))); the stack then
                          ends with one more LayerNorm.

    Use: `y = sublayer(res.inputs(x)); x = res(x, y, deterministic=...)`. The
    submodules keep the names ("norm", "Dropout_0") that parameter paths and
    dropout keys of existing checkpoints and runs were made with.
    """

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.norm = layer_norm(cfg, None)
        self.Dropout_0 = Dropout(cfg.dropout_rate, cfg.dropout_rng)

    def inputs(self, x: jax.Array) -> jax.Array:
        """What the sub-layer reads: x, or LayerNorm(x) when pre-LN. [B, T, D]."""
        return self.norm(x) if self.config.norm == "pre" else x

    def __call__(self, x: jax.Array, y: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: [B, T, D] the residual stream; y: [B, T, D] the sub-layer's output."""
        y = self.Dropout_0(y, deterministic=deterministic)
        out = x + y if self.config.norm == "pre" else self.norm(x + y)
        return constrain(out, ACTIVATIONS)  # what every layer hands on
