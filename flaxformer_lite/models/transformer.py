"""The encoder-decoder Transformer of Vaswani et al. (2017).

`Transformer.encode` and `Transformer.decode` are usable separately so that
search code can encode a source once and decode step by step; `__call__` is
the teacher-forced forward pass used in training.

Letter legend as in `attention.py` (B batch, S source length, T target
length, D d_model, V vocabulary, L decoder cache length, N heads, H head dim).

Decoding state (the only cache layout in the project):

  cache = {
    "layers": [{"k": [B, L, N, H], "v": [B, L, N, H]}] * num_decoder_layers,
    "index": int32 scalar,  # positions already written; the next token's position
  }
  cross_kv = [(k [B, S, N, H], v [B, S, N, H])] * num_decoder_layers

`cache` holds the decoder self-attention keys/values of the positions decoded
so far (zeros beyond `index`); `cross_kv` holds the cross-attention
keys/values, computed once per source by `Transformer.precompute_cross_kv`
and reused at every step. `Transformer.decode_step` takes one or several new
tokens (a forced prefix is written in one call), writes their keys/values at
[index, index + T) and attends over the whole cache with a mask that hides
positions >= index + t, so its cost per step does not depend on the prefix
length.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn import attention
from flaxformer_lite.nn.dropout import Dropout
from flaxformer_lite.nn.layers import AddPositions, Embed, FeedForward, Residual, layer_norm


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward sub-layers, each in a residual + LayerNorm."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: [B, S, D]; mask: bool[B, S, S]. Returns [B, S, D]."""
        cfg = self.config
        attn = attention.MultiHeadAttention(cfg, self_attention=True, name="self_attention")
        x = Residual(cfg, name="self_attention_residual")(
            lambda h: attn(h, None, mask, deterministic=deterministic)[0],
            x,
            deterministic=deterministic,
        )
        ffn = FeedForward(cfg, name="ffn")
        return Residual(cfg, name="ffn_residual")(ffn, x, deterministic=deterministic)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, feed-forward."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.self_attention = attention.MultiHeadAttention(cfg, self_attention=True)
        self.self_attention_residual = Residual(cfg)
        self.cross_attention = attention.MultiHeadAttention(cfg, self_attention=False)
        self.cross_attention_residual = Residual(cfg)
        self.ffn = FeedForward(cfg)
        self.ffn_residual = Residual(cfg)

    def __call__(
        self,
        y: jax.Array,
        encoded: jax.Array | None,
        self_mask: jax.Array,
        cross_mask: jax.Array,
        *,
        deterministic: bool,
        return_weights: bool = False,
        cache: dict | None = None,
        cross_kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array | None, dict | None]:
        """Runs one decoder layer.

        Args:
          y: [B, T, D] decoder activations.
          encoded: [B, S, D] encoder output (unused when `cross_kv` is given).
          self_mask: bool[B, T, T], or bool[B, T, L] with a cache.
          cross_mask: bool[B, T, S] source padding.
          return_weights: also return the cross-attention weights [B, N, T, S].
          cache: this layer's {"k", "v", "index"} (see the module docstring).
          cross_kv: this layer's precomputed cross-attention (k, v).
        Returns:
          (y [B, T, D], cross-attention weights or None, updated cache or None).
        """
        out = {}

        def self_attend(h):
            h, _, out["cache"] = self.self_attention(
                h, None, self_mask, deterministic=deterministic, cache=cache
            )
            return h

        def cross_attend(h):
            h, out["weights"], _ = self.cross_attention(
                h,
                encoded,
                cross_mask,
                deterministic=deterministic,
                return_weights=return_weights,
                cross_kv=cross_kv,
            )
            return h

        y = self.self_attention_residual(self_attend, y, deterministic=deterministic)
        y = self.cross_attention_residual(cross_attend, y, deterministic=deterministic)
        y = self.ffn_residual(self.ffn, y, deterministic=deterministic)
        return y, out["weights"], out["cache"]


def scan_layers(
    parent: nn.Module,
    layer_cls,
    num_layers: int,
    x: jax.Array,
    args: tuple,
    deterministic: bool,
    first=lambda out: out,
) -> jax.Array:
    """Runs `num_layers` identical layers as one `lax.scan` over their stacked parameters.

    The parameters keep their per-layer layout (`layer_0`, `layer_1`, ...), so
    checkpoints are the same with or without scanning; they are stacked here,
    [L, ...] per leaf, and the layer body is compiled once instead of L times.
    With `config.remat` each layer's activations are recomputed in the
    backward pass instead of stored.

    Args:
      x: [B, T, D] input of the first layer; args: the layer's other inputs.
      first: picks the activations from a layer's output.
    Returns:
      [B, T, D] output of the last layer.
    """
    cfg = parent.config
    params = parent.variables["params"]
    stacked = jax.tree.map(
        lambda *p: jnp.stack(p), *[params[f"layer_{i}"] for i in range(num_layers)]
    )
    if deterministic:
        keys = jnp.zeros((num_layers, 2), jnp.uint32)
    else:
        base = parent.make_rng("dropout")
        keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(num_layers))
    layer = layer_cls(cfg, parent=None)  # unbound: applied to explicit parameters

    def body(h, xs):
        layer_params, key = xs
        out = layer.apply(
            {"params": layer_params},
            h,
            *args,
            deterministic=deterministic,
            rngs=None if deterministic else {"dropout": key},
        )
        return first(out), None

    if cfg.remat:
        body = jax.checkpoint(body)
    return jax.lax.scan(body, x, (stacked, keys))[0]


class Encoder(nn.Module):
    """Embedding + positions + dropout, N encoder layers (+ final LN when pre-LN)."""

    config: TransformerConfig
    embed: nn.Module

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool,
        segments: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Encodes int[B, S] (PAD_ID = padding) -> [B, S, D].

        For packed rows, `segments` int[B, S] numbers the examples (1, 2, ...;
        0 = padding) and `positions` int[B, S] restarts at 0 for each.
        """
        cfg = self.config
        mask = attention.padding_mask(inputs, inputs)  # [B, S, S]
        if segments is not None:
            mask = mask & attention.segment_mask(segments, segments)
        x = AddPositions(cfg, name="positions")(self.embed(inputs), positions)
        x = Dropout(cfg.dropout_rate, cfg.dropout_rng)(x, deterministic=deterministic)  # §5.4
        if cfg.scan_layers and not self.is_initializing():
            x = scan_layers(self, EncoderLayer, cfg.num_encoder_layers, x, (mask,), deterministic)
        else:
            for i in range(cfg.num_encoder_layers):
                x = EncoderLayer(cfg, name=f"layer_{i}")(x, mask, deterministic=deterministic)
        if cfg.norm == "pre":
            x = layer_norm(cfg, "final_norm")(x)
        return x


class Decoder(nn.Module):
    """Embedding + positions + dropout, N decoder layers, pre-softmax projection."""

    config: TransformerConfig
    embed: nn.Module

    def setup(self):
        cfg = self.config
        self.positions = AddPositions(cfg)
        self.dropout = Dropout(cfg.dropout_rate, cfg.dropout_rng)
        self.layers = [DecoderLayer(cfg, name=f"layer_{i}") for i in range(cfg.num_decoder_layers)]
        if cfg.norm == "pre":
            self.final_norm = layer_norm(cfg, "final_norm")
        if not cfg.tie_output_embedding:
            self.logits_dense = nn.DenseGeneral(
                cfg.output_vocab_size,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.xavier_uniform(), ("embed", "vocab")
                ),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                name="logits",
            )

    def _logits(self, y: jax.Array) -> jax.Array:
        """[B, T, D] -> float32[B, T, V]."""
        if self.config.norm == "pre":
            y = self.final_norm(y)
        if self.config.tie_output_embedding:
            return self.embed.attend(y)
        return self.logits_dense(y).astype(jnp.float32)

    def __call__(
        self,
        encoded: jax.Array,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        deterministic: bool,
        return_weights: bool = False,
        packing: dict[str, jax.Array] | None = None,
    ):
        """Teacher-forced decoder pass.

        Args:
          encoded: [B, S, D] encoder output.
          inputs: int[B, S] source tokens (for the cross-attention padding mask).
          decoder_inputs: int[B, T] BOS + target prefix.
          return_weights: also return per-layer cross-attention weights
            (a list of float32[B, N, T, S]).
          packing: for packed rows, {"inputs_segments" int[B, S],
            "targets_segments" int[B, T], "targets_positions" int[B, T]}: a
            target token attends only to its own example's prefix and source.
        Returns:
          float32[B, T, V] logits (and the weights when asked).
        """
        self_mask = attention.decoder_self_mask(decoder_inputs)  # [B, T, T]
        cross_mask = attention.cross_mask(decoder_inputs, inputs)  # [B, T, S]
        positions = None
        if packing is not None:
            tseg, sseg = packing["targets_segments"], packing["inputs_segments"]
            self_mask = self_mask & attention.segment_mask(tseg, tseg)
            cross_mask = cross_mask & attention.segment_mask(tseg, sseg)
            positions = packing["targets_positions"]
        y = self.positions(self.embed(decoder_inputs), positions)
        y = self.dropout(y, deterministic=deterministic)
        all_weights = []
        if self.config.scan_layers and not return_weights and not self.is_initializing():
            y = scan_layers(
                self,
                DecoderLayer,
                len(self.layers),
                y,
                (encoded, self_mask, cross_mask),
                deterministic,
                first=lambda out: out[0],
            )
            return self._logits(y)
        for layer in self.layers:
            y, w, _ = layer(
                y,
                encoded,
                self_mask,
                cross_mask,
                deterministic=deterministic,
                return_weights=return_weights,
            )
            all_weights.append(w)
        logits = self._logits(y)
        return (logits, all_weights) if return_weights else logits

    def cross_kv(self, encoded: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Every layer's cross-attention keys/values: [(k, v) [B, S, N, H]] * layers."""
        return [layer.cross_attention.project_kv(encoded) for layer in self.layers]

    def step(
        self,
        tokens: jax.Array,
        cache: dict,
        cross_kv: list[tuple[jax.Array, jax.Array]],
        inputs: jax.Array,
    ) -> tuple[jax.Array, dict]:
        """Decodes `tokens` int[B, T] at positions [index, index + T) with a KV cache.

        Returns:
          (logits float32[B, T, V], updated cache). Layout in the module docstring.
        """
        index = cache["index"]
        length = cache["layers"][0]["k"].shape[1]  # L
        positions = index + jnp.arange(tokens.shape[1])  # [T]
        # Query t sees cache positions <= index + t: causal over the prefix and
        # within the new block; never the zeros beyond it.
        self_mask = jnp.arange(length)[None, :] <= positions[:, None]  # [T, L]
        self_mask = jnp.broadcast_to(self_mask, (tokens.shape[0], *self_mask.shape))
        cross_mask = attention.cross_mask(tokens, inputs)  # [B, T, S]
        y = self.positions(self.embed(tokens), positions[None, :])
        new_layers = []
        for layer, layer_cache, kv in zip(self.layers, cache["layers"], cross_kv, strict=True):
            y, _, updated = layer(
                y,
                None,
                self_mask,
                cross_mask,
                deterministic=True,
                cache={**layer_cache, "index": index},
                cross_kv=kv,
            )
            new_layers.append({"k": updated["k"], "v": updated["v"]})
        return self._logits(y), {"layers": new_layers, "index": index + tokens.shape[1]}


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

    def encode(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool = True,
        packing: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """int[B, S] -> [B, S, D]. `packing` as in `__call__`."""
        if packing is None:
            return self.encoder(inputs, deterministic=deterministic)
        return self.encoder(
            inputs,
            deterministic=deterministic,
            segments=packing["inputs_segments"],
            positions=packing["inputs_positions"],
        )

    def decode(
        self,
        encoded: jax.Array,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        deterministic: bool = True,
        return_weights: bool = False,
        packing: dict[str, jax.Array] | None = None,
    ):
        """Logits float32[B, T, V] for decoder inputs int[B, T] given encoded [B, S, D]."""
        return self.decoder(
            encoded,
            inputs,
            decoder_inputs,
            deterministic=deterministic,
            return_weights=return_weights,
            packing=packing,
        )

    def precompute_cross_kv(self, encoded: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Cross-attention keys/values of every decoder layer, once per source."""
        return self.decoder.cross_kv(encoded)

    def decode_step(
        self,
        tokens: jax.Array,
        cache: dict,
        cross_kv: list[tuple[jax.Array, jax.Array]],
        inputs: jax.Array,
    ) -> tuple[jax.Array, dict]:
        """Cached decoding of int[B, T] new tokens -> (float32[B, T, V], new cache)."""
        return self.decoder.step(tokens, cache, cross_kv, inputs)

    def __call__(
        self,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        deterministic: bool = True,
        packing: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """Teacher-forced pass: int[B, S], int[B, T] -> float32[B, T, V].

        `packing` (several examples per row): {"inputs_segments",
        "inputs_positions" int[B, S]; "targets_segments", "targets_positions"
        int[B, T]}, segments numbered 1, 2, ... per row (0 = padding) and
        positions restarting at 0 for each example. Attention never crosses
        examples: encoder, decoder self- and cross-attention are all masked by
        segment.
        """
        encoded = self.encode(inputs, deterministic=deterministic, packing=packing)
        return self.decode(
            encoded, inputs, decoder_inputs, deterministic=deterministic, packing=packing
        )


def init_cache(config: TransformerConfig, batch: int, max_len: int) -> dict:
    """An empty decoder cache for `batch` rows and `max_len` positions (zeros, index 0)."""
    shape = (batch, max_len, config.num_heads, config.head_dim)
    layer = lambda: {"k": jnp.zeros(shape, config.dtype), "v": jnp.zeros(shape, config.dtype)}
    return {
        "layers": [layer() for _ in range(config.num_decoder_layers)],
        "index": jnp.zeros((), jnp.int32),
    }


def shift_right(targets: jax.Array, bos_id: int, segments: jax.Array | None = None) -> jax.Array:
    """Teacher forcing: decoder inputs = BOS + targets[:, :-1].

    Padding after the end stays padding because targets are right-padded. With
    packed rows (`segments` int[B, T]), every example starts with its own BOS.

    Args:
      targets: int[B, T] target ids ending in EOS, right-padded with PAD_ID.
    Returns:
      int[B, T].
    """
    bos = jnp.full((targets.shape[0], 1), bos_id, targets.dtype)
    shifted = jnp.concatenate([bos, targets[:, :-1]], axis=1)
    if segments is None:
        return shifted
    previous = jnp.concatenate([jnp.zeros_like(segments[:, :1]), segments[:, :-1]], axis=1)
    starts = (segments != previous) & (segments != 0)  # first token of each example
    return jnp.where(starts, bos_id, jnp.where(segments == 0, 0, shifted))
