"""The encoder-decoder Transformer of Vaswani et al. (2017).

`Transformer.encode` and `Transformer.decode` are usable separately so that
search code can encode a source once and decode step by step; `__call__` is
the teacher-forced forward pass used in training.

Letter legend as in `attention.py` (B batch, S source length, T target
length, D d_model, V vocabulary).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite import attention
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.layers import AddPositions, Embed, FeedForward, Residual, layer_norm


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward sub-layers, each in a residual + LayerNorm."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: [B, S, D]; mask: bool[B, S, S]. Returns [B, S, D]."""
        cfg = self.config
        attn = attention.MultiHeadAttention(cfg, self_attention=True, name="self_attention")
        x = Residual(cfg, name="self_attention_residual")(
            lambda h: attn(h, None, mask, deterministic=deterministic),
            x,
            deterministic=deterministic,
        )
        ffn = FeedForward(cfg, name="ffn")
        return Residual(cfg, name="ffn_residual")(ffn, x, deterministic=deterministic)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, feed-forward."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        y: jax.Array,
        encoded: jax.Array,
        self_mask: jax.Array,
        cross_mask: jax.Array,
        *,
        deterministic: bool,
        return_weights: bool = False,
    ):
        """Runs one decoder layer.

        Args:
          y: [B, T, D] decoder activations.
          encoded: [B, S, D] encoder output.
          self_mask: bool[B, T, T] causal AND target padding.
          cross_mask: bool[B, T, S] source padding.
          return_weights: also return the cross-attention weights [B, N, T, S].
        Returns:
          [B, T, D] (and the weights when asked).
        """
        cfg = self.config
        self_attn = attention.MultiHeadAttention(cfg, self_attention=True, name="self_attention")
        y = Residual(cfg, name="self_attention_residual")(
            lambda h: self_attn(h, None, self_mask, deterministic=deterministic),
            y,
            deterministic=deterministic,
        )
        cross_attn = attention.MultiHeadAttention(cfg, self_attention=False, name="cross_attention")
        weights = []

        def cross(h):
            out = cross_attn(
                h, encoded, cross_mask, deterministic=deterministic, return_weights=return_weights
            )
            if return_weights:
                out, w = out
                weights.append(w)
            return out

        y = Residual(cfg, name="cross_attention_residual")(cross, y, deterministic=deterministic)
        ffn = FeedForward(cfg, name="ffn")
        y = Residual(cfg, name="ffn_residual")(ffn, y, deterministic=deterministic)
        if return_weights:
            return y, weights[0]
        return y


class Encoder(nn.Module):
    """Embedding + positions + dropout, N encoder layers (+ final LN when pre-LN)."""

    config: TransformerConfig
    embed: nn.Module

    @nn.compact
    def __call__(self, inputs: jax.Array, *, deterministic: bool) -> jax.Array:
        """inputs: int[B, S] (PAD_ID = padding). Returns [B, S, D]."""
        cfg = self.config
        mask = attention.padding_mask(inputs, inputs)  # [B, S, S]
        x = AddPositions(cfg, name="positions")(self.embed(inputs))
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)  # §5.4
        for i in range(cfg.num_encoder_layers):
            x = EncoderLayer(cfg, name=f"layer_{i}")(x, mask, deterministic=deterministic)
        if cfg.norm == "pre":
            x = layer_norm(cfg, "final_norm")(x)
        return x


class Decoder(nn.Module):
    """Embedding + positions + dropout, N decoder layers, pre-softmax projection."""

    config: TransformerConfig
    embed: nn.Module

    @nn.compact
    def __call__(
        self,
        encoded: jax.Array,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        deterministic: bool,
        return_weights: bool = False,
    ):
        """Teacher-forced decoder pass.

        Args:
          encoded: [B, S, D] encoder output.
          inputs: int[B, S] source tokens (for the cross-attention padding mask).
          decoder_inputs: int[B, T] BOS + target prefix.
          return_weights: also return per-layer cross-attention weights
            (a list of float32[B, N, T, S]).
        Returns:
          float32[B, T, V] logits (and the weights when asked).
        """
        cfg = self.config
        self_mask = attention.decoder_self_mask(decoder_inputs)  # [B, T, T]
        cross_mask = attention.cross_mask(decoder_inputs, inputs)  # [B, T, S]
        y = AddPositions(cfg, name="positions")(self.embed(decoder_inputs))
        y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
        all_weights = []
        for i in range(cfg.num_decoder_layers):
            out = DecoderLayer(cfg, name=f"layer_{i}")(
                y,
                encoded,
                self_mask,
                cross_mask,
                deterministic=deterministic,
                return_weights=return_weights,
            )
            if return_weights:
                y, w = out
                all_weights.append(w)
            else:
                y = out
        if cfg.norm == "pre":
            y = layer_norm(cfg, "final_norm")(y)
        if cfg.tie_output_embedding:
            logits = self.embed.attend(y)
        else:
            logits = nn.DenseGeneral(
                cfg.output_vocab_size,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.xavier_uniform(), ("embed", "vocab")
                ),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                name="logits",
            )(y)
        logits = logits.astype(jnp.float32)
        if return_weights:
            return logits, all_weights
        return logits


class Transformer(nn.Module):
    """Encoder-decoder Transformer with optional shared embeddings (§3.4)."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        if cfg.share_embeddings:
            shared = Embed(cfg.vocab_size, cfg, name="shared_embedding")
            source_embed, target_embed = shared, shared
        else:
            source_embed = Embed(cfg.vocab_size, cfg, name="source_embedding")
            target_embed = Embed(cfg.output_vocab_size, cfg, name="target_embedding")
        self.encoder = Encoder(cfg, source_embed)
        self.decoder = Decoder(cfg, target_embed)

    def encode(self, inputs: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """int[B, S] -> [B, S, D]."""
        return self.encoder(inputs, deterministic=deterministic)

    def decode(
        self,
        encoded: jax.Array,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """Logits float32[B, T, V] for decoder inputs int[B, T] given encoded [B, S, D]."""
        return self.decoder(
            encoded,
            inputs,
            decoder_inputs,
            deterministic=deterministic,
            return_weights=return_weights,
        )

    def __call__(
        self, inputs: jax.Array, decoder_inputs: jax.Array, *, deterministic: bool = True
    ) -> jax.Array:
        """Teacher-forced pass: int[B, S], int[B, T] -> float32[B, T, V]."""
        encoded = self.encode(inputs, deterministic=deterministic)
        return self.decode(encoded, inputs, decoder_inputs, deterministic=deterministic)


def shift_right(targets: jax.Array, bos_id: int) -> jax.Array:
    """Teacher forcing: decoder inputs = BOS + targets[:, :-1].

    Padding after the end stays padding because targets are right-padded.

    Args:
      targets: int[B, T] target ids ending in EOS, right-padded with PAD_ID.
    Returns:
      int[B, T].
    """
    bos = jnp.full((targets.shape[0], 1), bos_id, targets.dtype)
    return jnp.concatenate([bos, targets[:, :-1]], axis=1)
