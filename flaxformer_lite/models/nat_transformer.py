"""The non-autoregressive Transformer (Gu et al. 2018; CMLM, Ghazvininejad et al. 2019).

The encoder is the autoregressive model's (`models/transformer.py`); the
decoder is the same stack of layers with two differences:

- its self-attention is not causal: every position attends to every valid
  position (`masks.padding_mask` of the target validity), so all positions
  are predicted in one call;
- its inputs are not the shifted targets but a row of mask tokens (`mask_id`,
  the BOS id, which no target contains), with the known tokens in place
  during Mask-Predict; with `copy_source`, masked positions read a uniform
  copy of the source embeddings instead: position t of a row of T takes
  source position round((S - 1) / (T - 1) * t) (fairseq's
  `--src-embedding-copy`; S the row's source length, EOS included).

A length classifier reads the mean of the valid encoder outputs and scores
`length_classes` offsets target - source around `length_classes // 2`
(fairseq's 256-way `--pred-length-offset` head: a dot product with a class
embedding table). With `length_classes = 0` there is no classifier (the
fixed-length mode of `models/non_autoregressive.py`).

Parameter names are the autoregressive model's plus `length_embedding`, so
the two share the encoder and decoder layouts. Letters as in `transformer.py`
(C length classes).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models.transformer import encoder_and_decoder, encoder_masks
from flaxformer_lite.nn import masks


def uniform_copy_index(source_len: jax.Array, target_len: jax.Array, width: int) -> jax.Array:
    """Source position copied to each target position: round((S - 1) / (T - 1) * t).

    Args:
      source_len, target_len: int[B] (a row of target length 1 copies position 0).
      width: target positions per row.
    Returns:
      int32[B, width], clipped to [0, S - 1] (also beyond the row's length).
    """
    s = jnp.maximum(source_len, 1).astype(jnp.float32)[:, None]
    t = target_len.astype(jnp.float32)[:, None]
    ratio = jnp.where(t > 1, (s - 1) / jnp.maximum(t - 1, 1), 0.0)
    index = jnp.round(ratio * jnp.arange(width, dtype=jnp.float32)[None, :]).astype(jnp.int32)
    return jnp.clip(index, 0, s.astype(jnp.int32) - 1)


class NATransformer(nn.Module):
    """Encoder, length classifier, and a decoder without a causal mask."""

    config: TransformerConfig
    length_classes: int = 256  # 0: no length classifier
    copy_source: bool = False  # masked positions read copied source embeddings
    length_stop_gradient: bool = False  # the length loss does not train the encoder
    capture: tuple[str, ...] = ()  # attention probabilities to sow, as `Transformer`

    def setup(self):
        cfg = self.config
        self.source_embed, self.encoder, self.decoder = encoder_and_decoder(cfg, self.capture)
        if self.length_classes:
            self.length_embedding = self.param(
                "length_embedding",
                nn.with_logical_partitioning(
                    nn.initializers.normal(stddev=cfg.d_model**-0.5), ("length_classes", "embed")
                ),
                (self.length_classes, cfg.d_model),
                cfg.param_dtype,
            )

    def encode(
        self, inputs: jax.Array, source_valid: jax.Array, *, deterministic: bool = True
    ) -> jax.Array:
        """int[B, S] (or float[B, S, F]) -> [B, S, D]."""
        mask, _ = encoder_masks(source_valid, None, self.config.encoder_window)
        return self.encoder(inputs, mask, deterministic=deterministic)

    def length_logits(self, encoded: jax.Array, source_valid: jax.Array) -> jax.Array:
        """Length-offset logits float32[B, C] from the mean of the valid encoder outputs."""
        weights = source_valid.astype(jnp.float32)[..., None]  # [B, S, 1]
        pooled = (encoded.astype(jnp.float32) * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)
        if self.length_stop_gradient:
            pooled = jax.lax.stop_gradient(pooled)
        return pooled @ self.length_embedding.astype(jnp.float32).T

    def copied_inputs(
        self, inputs: jax.Array, source_valid: jax.Array, target_len: jax.Array, width: int
    ) -> jax.Array:
        """The uniform copy of the source embeddings: [B, width, D]."""
        index = uniform_copy_index(source_valid.sum(-1), target_len, width)  # [B, W]
        embedded = self.source_embed(inputs)  # [B, S, D], scaled as the decoder's inputs
        return jnp.take_along_axis(embedded, index[..., None], axis=1)

    def decode(
        self,
        encoded: jax.Array,
        source_valid: jax.Array,
        decoder_inputs: jax.Array,
        target_valid: jax.Array,
        *,
        copied: jax.Array | None = None,
        mask_id: int,
        deterministic: bool = True,
    ) -> jax.Array:
        """All positions at once: logits float32[B, T, V].

        Args:
          decoder_inputs: int[B, T], `mask_id` where the token is to be predicted.
          target_valid: bool[B, T], the positions of each row's output.
          copied: [B, T, D] (`copied_inputs`) read at the masked positions, or None.
        """
        width = decoder_inputs.shape[1]
        self_mask = masks.self_attention(target_valid, causal=False)  # [B, T, T]
        cross = masks.cross_attention(source_valid, width)  # [B, T, S]
        vectors = None if copied is None else (decoder_inputs == mask_id, copied)
        return self.decoder(
            encoded,
            decoder_inputs,
            self_mask,
            cross,
            deterministic=deterministic,
            input_vectors=vectors,
        )

    def __call__(
        self,
        inputs: jax.Array,
        source_valid: jax.Array,
        decoder_inputs: jax.Array,
        target_valid: jax.Array,
        *,
        mask_id: int,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Training/scoring pass: (token logits float32[B, T, V], length logits float32[B, C]
        or None without a classifier). Every decoder input that is `mask_id` is predicted
        from the others; copied inputs use the row's real target length."""
        encoded = self.encode(inputs, source_valid, deterministic=deterministic)
        copied = None
        if self.copy_source:
            copied = self.copied_inputs(
                inputs, source_valid, target_valid.sum(-1), decoder_inputs.shape[1]
            )
        logits = self.decode(
            encoded,
            source_valid,
            decoder_inputs,
            target_valid,
            copied=copied,
            mask_id=mask_id,
            deterministic=deterministic,
        )
        lengths = self.length_logits(encoded, source_valid) if self.length_classes else None
        return logits, lengths
