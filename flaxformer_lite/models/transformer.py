"""The encoder-decoder Transformer of Vaswani et al. (2017), as flax modules.

`Transformer.encode` and `Transformer.decode` are usable separately so that
search code can encode a source once and decode step by step; `__call__` is
the teacher-forced forward pass used in training, `decode(encode(...))`, so
one route builds every mask of a pass (`encoder_masks`, `decoder_masks`).
The stacks themselves are `models/stacks.py`'s `Encoder` and `Decoder`. Only `models/` uses these
modules; everything else goes through the model protocol (`models/base.py`).

The encoder reads token ids (int[B, S], through the embedding) or, with
`config.input_features` > 0, continuous features (float[B, S, F], through a
linear projection); either way with a validity array bool[B, S]. The decoder
never sees source tokens: only the encoder output and the source validity.

Letter legend as in `nn/attention.py` (B batch, S source length, T target
length, D d_model, V vocabulary, L decoder cache length, N heads, H head dim).
Logits are [..., Vp], the vocabulary padded to `config.padded(V)` columns whose
logits are PADDED_LOGIT, probability 0 (`nn/vocab.py`).

Decoding state (the only cache layout in the project):

  cache = {
    "layers": [{"k": [B, N, H, L], "v": [B, N, L, H]}] * num_decoder_layers,
    "index": int32 scalar,  # positions already written; the next token's position
  }                         # (or int32[B]: each row at its own position, `serving/`)
  cross_kv = [(k [B, N, H, S], v [B, N, S, H])] * num_decoder_layers
                            # (or B / K rows, each shared by K consecutive beams)

Heads come first and keys are stored transposed (the teacher-forced path keeps
[B, S, N, H]): a step's attention then reads every cache tensor once, as it lies
(`nn/attention.cached_attention`).

`cache` holds the decoder self-attention keys/values of the positions decoded
so far (zeros beyond `index`); `cross_kv` holds the cross-attention
keys/values, computed once per source by `Transformer.precompute_cross_kv`
and reused at every step. `Transformer.decode_step` takes one or several new
tokens (a forced prefix is written in one call), writes their keys/values at
[index, index + T) and attends over the whole cache with a mask that hides
positions >= index + t, so its cost per step does not depend on the prefix
length.

Parameters: each stack's layers are `layer_0`, `layer_1`, ... or, with
`config.scan_layers`, one `layers` subtree of [L, ...] leaves that a `lax.scan`
reads as stored (`models/layer_layout.py` converts between the two).

Attention probabilities: `Transformer(config, capture=("decoder/cross/-1", ...))`
sows the chosen layers' probabilities into the "intermediates" collection on
every path (unrolled, `scan_layers`, the fast kernel); apply with
`mutable=["intermediates"]` and read them with `capture.captured_attention`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.models.capture import parse_capture
from flaxformer_lite.models.packed_rows import Packing
from flaxformer_lite.models.stacks import Decoder, Encoder
from flaxformer_lite.nn import masks
from flaxformer_lite.nn.embeddings import Embed
from flaxformer_lite.nn.subsampling import subsampled_validity


def encoder_and_decoder(
    cfg: TransformerConfig, capture: tuple[str, ...] = ()
) -> tuple[Embed | None, Encoder, Decoder]:
    """The embeddings (one module when shared, none for feature inputs), encoder and decoder
    of a model, for the `setup` of the module that owns them (the names are its parameters').

    Returns:
      (the source embedding or None, the encoder, the decoder).
    """
    if cfg.share_embeddings and not cfg.input_features:
        shared = Embed(cfg.vocab_size, cfg, name="shared_embedding")
        source_embed, target_embed = shared, shared
    else:
        source_embed = (
            None if cfg.input_features else Embed(cfg.vocab_size, cfg, name="source_embedding")
        )
        target_embed = Embed(cfg.output_vocab_size, cfg, name="target_embedding")
    chosen = parse_capture(capture, cfg)
    encoder = Encoder(cfg, source_embed, capture=chosen["encoder/self"], name="encoder")
    decoder = Decoder(
        cfg,
        target_embed,
        capture_self=chosen["decoder/self"],
        capture_cross=chosen["decoder/cross"],
        name="decoder",
    )
    return source_embed, encoder, decoder


def token_validity(tokens: jax.Array) -> jax.Array:
    """bool[B, S]: True where a token id is not PAD_ID."""
    return tokens != PAD_ID


def encoder_masks(
    source_valid: jax.Array, packing: Packing | None, window: int = 0
) -> tuple[masks.AttentionMask, jax.Array | None]:
    """An encoder pass's (self `masks.AttentionMask` [B, S, S], positions int[B, S] or None)
    from the validity bool[B, S] of its positions; packed rows mask by segment."""
    segments = None if packing is None else packing.inputs_segments
    positions = None if packing is None else packing.inputs_positions
    return masks.self_attention(source_valid, segments, causal=False, window=window), positions


def decoder_masks(
    source_valid: jax.Array,
    decoder_inputs: jax.Array,
    packing: Packing | None,
    window: int = 0,
) -> tuple[masks.AttentionMask, masks.AttentionMask, jax.Array | None]:
    """A teacher-forced decoder pass's (self `masks.AttentionMask` [B, T, T], cross
    `AttentionMask` [B, T, S], positions int[B, T] or None), from the
    source validity bool[B, S] and the gold decoder inputs int[B, T]; packed rows mask by
    segment."""
    tseg = sseg = positions = None
    if packing is not None:
        tseg, sseg = packing.targets_segments, packing.inputs_segments
        positions = packing.targets_positions
    self_mask = masks.self_attention(
        token_validity(decoder_inputs), tseg, causal=True, window=window
    )
    cross = masks.cross_attention(source_valid, decoder_inputs.shape[1], tseg, sseg)
    return self_mask, cross, positions


class Transformer(nn.Module):
    """Encoder-decoder Transformer with optional shared embeddings (§3.4).

    `packing` (several examples per row): a `models/packing.Packing`, or None for one
    example per row. Attention never crosses
    examples: encoder, decoder self- and cross-attention are all masked by
    segment. `source_valid` bool[B, S] defaults to `inputs != PAD_ID` for
    token inputs; feature inputs must give it. `source_valid` is always the
    INPUT frames' validity; with `config.subsampling_layers` the encoder output
    has S' frames and every method converts the validity
    (`nn/subsampling.subsampled_validity`) where it masks encoder positions.
    """

    config: TransformerConfig
    capture: tuple[str, ...] = ()  # attention probabilities to sow, e.g. "decoder/cross/-1"

    def setup(self):
        _, self.encoder, self.decoder = encoder_and_decoder(self.config, self.capture)

    def _source_valid(self, inputs: jax.Array, source_valid: jax.Array | None) -> jax.Array:
        if source_valid is not None:
            return source_valid
        if self.config.input_features:
            raise ValueError("feature inputs need source_valid bool[B, S]")
        return token_validity(inputs)

    def _encoder_valid(self, source_valid: jax.Array, packing: Packing | None) -> jax.Array:
        """bool[B, S] input validity -> bool[B, S'] validity of the encoder output."""
        if not self.config.subsampling_layers:
            return source_valid
        if packing is not None:
            raise ConfigError(
                "packed rows cannot be subsampled (segments would mix in the convs): use "
                "data.batching=bucket or fixed, or model.subsampling_layers=0"
            )
        return subsampled_validity(source_valid, self.config)

    def encode(
        self,
        inputs: jax.Array,
        source_valid: jax.Array | None = None,
        *,
        deterministic: bool = True,
        packing: Packing | None = None,
    ) -> jax.Array:
        """int[B, S] (or float[B, S, F]) -> [B, S', D] (S' = S without subsampling)."""
        valid = self._source_valid(inputs, source_valid)
        encoder_valid = self._encoder_valid(valid, packing)
        mask, positions = encoder_masks(encoder_valid, packing, self.config.encoder_window)
        return self.encoder(
            inputs, mask, deterministic=deterministic, positions=positions, frames_valid=valid
        )

    def decode(
        self,
        encoded: jax.Array,
        source_valid: jax.Array,
        decoder_inputs: jax.Array,
        *,
        deterministic: bool = True,
        packing: Packing | None = None,
        replacements: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """Logits float32[B, T, V] for decoder inputs int[B, T] given encoded [B, S, D].

        `replacements`: scheduled sampling's, as in `Decoder.__call__`; the masks
        come from the gold `decoder_inputs`.
        """
        valid = self._encoder_valid(source_valid, packing)
        self_mask, cross, positions = decoder_masks(
            valid, decoder_inputs, packing, self.config.decoder_window
        )
        return self.decoder(
            encoded,
            decoder_inputs,
            self_mask,
            cross,
            deterministic=deterministic,
            positions=positions,
            replacements=replacements,
        )

    def precompute_cross_kv(self, encoded: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Cross-attention keys/values of every decoder layer, once per source."""
        return self.decoder.cross_kv(encoded)

    def decode_step(
        self,
        tokens: jax.Array,
        cache: dict,
        cross_kv: list[tuple[jax.Array, jax.Array]],
        source_valid: jax.Array,
    ) -> tuple[jax.Array, dict]:
        """Cached decoding of int[B, T] new tokens -> (float32[B, T, V], new cache)."""
        valid = self._encoder_valid(source_valid, None)
        return self.decoder.step(tokens, cache, cross_kv, valid)

    def __call__(
        self,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        source_valid: jax.Array | None = None,
        deterministic: bool = True,
        packing: Packing | None = None,
        replacements: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """Teacher-forced pass: int[B, S] (or float[B, S, F]), int[B, T] -> float32[B, T, V].

        `decode(encode(...))`: the masks come from those methods alone, from the gold
        `decoder_inputs` also when scheduled sampling's `replacements` (see
        `Decoder.__call__`) change what the decoder reads.
        """
        valid = self._source_valid(inputs, source_valid)
        encoded = self.encode(inputs, valid, deterministic=deterministic, packing=packing)
        return self.decode(
            encoded,
            valid,
            decoder_inputs,
            deterministic=deterministic,
            packing=packing,
            replacements=replacements,
        )


def init_cache(config: TransformerConfig, batch: int, max_len: int) -> dict:
    """An empty decoder cache for `batch` rows and `max_len` positions (zeros, index 0)."""
    n, h = config.num_heads, config.head_dim
    layer = lambda: {
        "k": jnp.zeros((batch, n, h, max_len), config.dtype),
        "v": jnp.zeros((batch, n, max_len, h), config.dtype),
    }
    return {
        "layers": [layer() for _ in range(config.num_decoder_layers)],
        "index": jnp.zeros((), jnp.int32),
    }
