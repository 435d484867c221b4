"""Convolutional subsampling of feature frames, the front end of speech encoders.

As fairseq's `Conv1dSubsampler` (speech_to_text): `config.subsampling_layers`
Conv1d layers over time, each with stride 2, padding k//2 and a GLU over the
channels (so 2 layers give 4x fewer frames), then one linear map to d_model.
Validity is a prefix per row; before every conv the invalid frames are set to
zero, so padded frames never reach a valid output: a padded row equals the
example alone (whose conv pads with zeros too).

Letter legend as in `attention.py` (B batch, S input frames, S' subsampled
frames, F feature size, C channels, D d_model).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn.layers import Dense


def conv_length(length, kernel: int):
    """Output frames of one stride-2 conv with padding k//2 (ints or int arrays)."""
    return (length + 2 * (kernel // 2) - kernel) // 2 + 1


def subsampled_lengths(lengths: jax.Array, config: TransformerConfig) -> jax.Array:
    """int[B] input frame counts -> int[B] encoder frame counts (identity without subsampling)."""
    for _ in range(config.subsampling_layers):
        lengths = conv_length(lengths, config.subsampling_kernel)
    return lengths


def subsampled_validity(valid: jax.Array, config: TransformerConfig) -> jax.Array:
    """bool[B, S] input frame validity (a prefix per row) -> bool[B, S'] encoder validity."""
    if not config.subsampling_layers:
        return valid
    out_len = subsampled_lengths(valid.shape[1], config)
    lengths = subsampled_lengths(valid.sum(-1), config)  # [B]; an empty row stays empty
    return jnp.arange(out_len)[None, :] < lengths[:, None]


class Conv1dSubsampler(nn.Module):
    """float[B, S, F] frames + bool[B, S] validity -> [B, S', D]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, features: jax.Array, valid: jax.Array) -> jax.Array:
        cfg = self.config
        k = cfg.subsampling_kernel
        x = features.astype(cfg.dtype)
        for i in range(cfg.subsampling_layers):
            x = jnp.where(valid[..., None], x, 0)  # padded frames never reach valid outputs
            x = nn.Conv(
                2 * cfg.subsampling_channels,
                (k,),
                strides=(2,),
                padding=[(k // 2, k // 2)],
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.lecun_normal(), (None, None, None)
                ),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
                name=f"conv_{i}",
            )(x)  # [B, S_i+1, 2C]
            x = nn.glu(x, axis=-1)  # [B, S_i+1, C]
            valid = jnp.arange(x.shape[1])[None, :] < conv_length(valid.sum(-1), k)[:, None]
        return Dense(cfg.d_model, cfg, ("features", "embed"), name="projection")(x)  # [B, S', D]
