"""The encoder-decoder Transformer of Vaswani et al. (2017), as flax modules.

`Transformer.encode` and `Transformer.decode` are usable separately so that
search code can encode a source once and decode step by step; `__call__` is
the teacher-forced forward pass used in training. Only `models/` uses these
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
  }
  cross_kv = [(k [B, N, H, S], v [B, N, S, H])] * num_decoder_layers

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
from flaxformer_lite.models.blocks import (
    DecoderLayer,
    EncoderLayer,
    check_layout,
    init_stacked,
    rematerialized,
    scan_layers,
)
from flaxformer_lite.models.capture import parse_capture
from flaxformer_lite.models.layer_layout import STACKED
from flaxformer_lite.nn import masks
from flaxformer_lite.nn.dropout import Dropout
from flaxformer_lite.nn.embeddings import AddPositions, Embed, FeatureProjection
from flaxformer_lite.nn.layers import layer_norm
from flaxformer_lite.nn.subsampling import Conv1dSubsampler, subsampled_validity
from flaxformer_lite.nn.vocab import mask_logits, zero_padding_init


class Encoder(nn.Module):
    """Front end (embedding or feature projection) + positions + dropout, N layers (+ final LN)."""

    config: TransformerConfig
    embed: nn.Module | None  # the token embedding; None for feature inputs
    capture: tuple[int, ...] = ()  # layers whose self-attention probabilities are sown

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        mask: jax.Array,
        *,
        deterministic: bool,
        positions: jax.Array | None = None,
        frames_valid: jax.Array | None = None,
    ) -> jax.Array:
        """Encodes int[B, S] token ids or float[B, S, F] features -> [B, S', D].

        S' = S except with `config.subsampling_layers` (`nn/subsampling.py`).

        Args:
          mask: a `masks.AttentionMask` of the encoder-side validity (a dense bool[B, S',
            S'] or a `masks.LocalMask` also work).
          positions: int[B, S], restarting at 0 for each packed example (None: 0..S-1).
          frames_valid: bool[B, S] the input frames' validity; needed with subsampling.
        """
        cfg = self.config
        if cfg.subsampling_layers:
            x = Conv1dSubsampler(cfg, name="subsampler")(inputs, frames_valid)
        elif cfg.input_features:
            x = FeatureProjection(cfg, name="input_projection")(inputs)
        else:
            x = self.embed(inputs)
        x = AddPositions(cfg, name="positions")(x, positions)
        x = Dropout(cfg.dropout_rate, cfg.dropout_rng)(x, deterministic=deterministic)  # §5.4
        check_layout(self)
        if cfg.scan_layers:
            layer = EncoderLayer(cfg, capture_self=bool(self.capture), parent=None)
            example = (jnp.zeros((1, 1, cfg.d_model), cfg.dtype), None)
            stacked = self.param(STACKED, init_stacked(layer, cfg.num_encoder_layers, example))
            x = scan_layers(self, layer, stacked, x, (mask,), deterministic, self.capture)
        else:
            run = rematerialized(
                lambda layer, x: layer(x, mask, deterministic=deterministic), cfg, module=True
            )
            for i in range(cfg.num_encoder_layers):
                x = run(EncoderLayer(cfg, capture_self=i in self.capture, name=f"layer_{i}"), x)
        if cfg.norm == "pre":
            x = layer_norm(cfg, "final_norm")(x)
        return x


class Decoder(nn.Module):
    """Embedding + positions + dropout, N decoder layers, pre-softmax projection."""

    config: TransformerConfig
    embed: nn.Module
    capture_self: tuple[int, ...] = ()  # layers whose probabilities are sown
    capture_cross: tuple[int, ...] = ()

    def setup(self):
        cfg = self.config
        check_layout(self)
        self.positions = AddPositions(cfg)
        self.dropout = Dropout(cfg.dropout_rate, cfg.dropout_rng)
        if cfg.scan_layers:
            d = jnp.zeros((1, 1, cfg.d_model), cfg.dtype)
            init = init_stacked(self._unbound_layer(), cfg.num_decoder_layers, (d, d, None, None))
            self.stacked = self.param(STACKED, init)  # [L, ...] per leaf
        else:
            self.layers = [
                DecoderLayer(
                    cfg,
                    capture_self=i in self.capture_self,
                    capture_cross=i in self.capture_cross,
                    name=f"layer_{i}",
                )
                for i in range(cfg.num_decoder_layers)
            ]
        if cfg.norm == "pre":
            self.final_norm = layer_norm(cfg, "final_norm")
        if not cfg.tie_output_embedding:
            vocab = cfg.output_vocab_size
            kernel_init = zero_padding_init(nn.initializers.xavier_uniform(), vocab, axis=1)
            self.logits_dense = nn.DenseGeneral(
                cfg.padded(vocab),  # padded as the embeddings (`nn/vocab.py`)
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                kernel_init=nn.with_logical_partitioning(kernel_init, ("embed", "vocab")),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                name="logits",
            )

    def _logits(self, y: jax.Array) -> jax.Array:
        """[B, T, D] -> float32[B, T, V]."""
        return self._project(self._final(y))

    def _final(self, y: jax.Array) -> jax.Array:
        """The last layer's output as the softmax reads it: [B, T, D]."""
        return self.final_norm(y) if self.config.norm == "pre" else y

    def _project(self, hidden: jax.Array) -> jax.Array:
        """Pre-softmax projection: [B, T, D] -> float32[B, T, Vp], the padded vocabulary's
        columns PADDED_LOGIT (`nn/vocab.py`)."""
        if self.config.tie_output_embedding:
            return self.embed.attend(hidden)
        logits = self.logits_dense(hidden).astype(jnp.float32)
        return mask_logits(logits, self.config.output_vocab_size)

    def _outputs(self, y: jax.Array, embedded: jax.Array, features: bool):
        """Logits, or with `features` (logits, {"hidden": [B, T, D] the softmax's input,
        "embedded": [B, T, D] the input token embeddings}) for a copy head."""
        if not features:
            return self._logits(y)
        hidden = self._final(y)
        return self._project(hidden), {"hidden": hidden, "embedded": embedded}

    def __call__(
        self,
        encoded: jax.Array,
        decoder_inputs: jax.Array,
        self_mask: jax.Array,
        cross_mask: jax.Array,
        *,
        deterministic: bool,
        positions: jax.Array | None = None,
        replacements: tuple[jax.Array, jax.Array] | None = None,
        input_vectors: tuple[jax.Array, jax.Array] | None = None,
        features: bool = False,
    ) -> jax.Array | tuple[jax.Array, dict]:
        """Teacher-forced decoder pass.

        Args:
          encoded: [B, S, D] encoder output.
          decoder_inputs: int[B, T] BOS + target prefix.
          self_mask: a causal `masks.AttentionMask` (`decoder_masks`; a dense bool[B, T, T]
            or `masks.LocalMask` also work); cross_mask: an `AttentionMask` or bool[B, T, S].
          positions: int[B, T] restarting at 0 per packed example (None: 0..T-1).
          replacements: scheduled sampling's (use bool[B, T], new): where `use`, the
            input embedding is that of `new`, tokens int[B, T] or embedding weights
            float[B, T, V] (`objectives/scheduled_sampling.py`); None: teacher forcing.
          input_vectors: (use bool[B, T], vectors [B, T, D]): where `use`, the input
            embedding is that vector (a non-autoregressive decoder's copied source
            embeddings, `models/nat_transformer.py`).
          features: also return the copy head's inputs (`_outputs`).
        Returns:
          float32[B, T, V] logits (with `features`: and the features dict).
        """
        y = self.embed(decoder_inputs)
        if replacements is not None:
            use, new = replacements
            other = self.embed.mixture(new) if new.ndim == 3 else self.embed(new)
            y = jnp.where(use[..., None], other, y)
        if input_vectors is not None:
            use, vectors = input_vectors
            y = jnp.where(use[..., None], vectors.astype(y.dtype), y)
        embedded = y
        y = self.positions(y, positions)
        y = self.dropout(y, deterministic=deterministic)
        if self.config.scan_layers:
            y = scan_layers(
                self,
                self._unbound_layer(),
                self.stacked,
                y,
                (encoded, self_mask, cross_mask),
                deterministic,
                self._captured(),
                first=lambda out: out[0],
            )
            return self._outputs(y, embedded, features)
        run = rematerialized(
            lambda layer, y: layer(y, encoded, self_mask, cross_mask, deterministic=deterministic)[
                0
            ],
            self.config,
            module=True,
        )
        for layer in self.layers:
            y = run(layer, y)
        return self._outputs(y, embedded, features)

    def _unbound_layer(self) -> DecoderLayer:
        """The layer the scanned stack applies with each layer's parameters."""
        return DecoderLayer(
            self.config,
            capture_self=bool(self.capture_self),
            capture_cross=bool(self.capture_cross),
            parent=None,
        )

    def _captured(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.capture_self) | set(self.capture_cross)))

    def cross_kv(self, encoded: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Every layer's cross-attention keys [B, N, H, S] and values [B, N, S, H]."""
        if self.config.scan_layers:
            project = lambda p: self._unbound_layer().apply(
                {"params": p}, encoded, method=lambda m, e: m.cross_attention.project_kv(e)
            )
            ks, vs = jax.vmap(project)(self.stacked)  # each [L, B, S, N, H]
            pairs = [(ks[i], vs[i]) for i in range(ks.shape[0])]
        else:
            pairs = [layer.cross_attention.project_kv(encoded) for layer in self.layers]
        return [(k.transpose(0, 2, 3, 1), v.swapaxes(1, 2)) for k, v in pairs]

    def step(
        self,
        tokens: jax.Array,
        cache: dict,
        cross_kv: list[tuple[jax.Array, jax.Array]],
        source_valid: jax.Array,
        features: bool = False,
    ) -> tuple:
        """Decodes `tokens` int[B, T] at positions [index, index + T) with a KV cache.

        Args:
          source_valid: bool[B, S], the encoder positions that hold input.
          features: also return the copy head's inputs (`_outputs`).
        Returns:
          (logits float32[B, T, V], updated cache), with `features` (logits, cache,
          features). Cache layout in the module docstring.
        """
        index = cache["index"]
        batch, length = tokens.shape
        positions = index + jnp.arange(length)  # [T]
        cache_len = cache["layers"][0]["v"].shape[2]  # values [B, N, L, H]
        self_mask = masks.cache_mask(positions, cache_len, batch, self.config.decoder_window)
        cross_mask = masks.cross_mask(source_valid, length)  # [B, T, S]
        embedded = self.embed(tokens)
        y = self.positions(embedded, positions[None, :])
        new_layers = []
        for i, (layer_cache, kv) in enumerate(zip(cache["layers"], cross_kv, strict=True)):
            args = (y, None, self_mask, cross_mask)
            kw = dict(deterministic=True, cache={**layer_cache, "index": index}, cross_kv=kv)
            if self.config.scan_layers:
                y, updated = self._stacked_step(i, args, kw)
            else:
                y, updated = self.layers[i](*args, **kw)
            new_layers.append({"k": updated["k"], "v": updated["v"]})
        cache = {"layers": new_layers, "index": index + length}
        if features:
            logits, feats = self._outputs(y, embedded, True)
            return logits, cache, feats
        return self._logits(y), cache

    def _stacked_step(self, i: int, args: tuple, kw: dict):
        """Layer `i` of a scanned stack on a decoding step, with its slice of the parameters.

        (`models/predict.cached_step` unstacks them once per call instead, outside the
        search loop.)"""
        capture = self._captured()
        params = jax.tree.map(lambda p: p[i], self.stacked)
        mutable = ["intermediates"] if i in capture else False
        out = self._unbound_layer().apply({"params": params}, *args, **kw, mutable=mutable)
        if mutable:
            out, sown = out
            self.sow("intermediates", f"scanned_layer_{i}", sown["intermediates"])
        return out


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


def decoder_masks(
    source_valid: jax.Array,
    decoder_inputs: jax.Array,
    packing: dict[str, jax.Array] | None,
    window: int = 0,
) -> tuple[masks.AttentionMask, masks.AttentionMask, jax.Array | None]:
    """A teacher-forced decoder pass's (self `masks.AttentionMask` [B, T, T], cross
    `AttentionMask` [B, T, S], positions int[B, T] or None), from the
    source validity bool[B, S] and the gold decoder inputs int[B, T]; packed rows mask by
    segment."""
    tseg = sseg = positions = None
    if packing is not None:
        tseg, sseg = packing["targets_segments"], packing["inputs_segments"]
        positions = packing["targets_positions"]
    self_mask = masks.self_attention(
        token_validity(decoder_inputs), tseg, causal=True, window=window
    )
    cross = masks.cross_attention(source_valid, decoder_inputs.shape[1], tseg, sseg)
    return self_mask, cross, positions


class Transformer(nn.Module):
    """Encoder-decoder Transformer with optional shared embeddings (§3.4).

    `packing` (several examples per row): {"inputs_segments",
    "inputs_positions" int[B, S]; "targets_segments", "targets_positions"
    int[B, T]}, segments numbered 1, 2, ... per row (0 = padding) and
    positions restarting at 0 for each example. Attention never crosses
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

    def _encoder_valid(self, source_valid: jax.Array, packing) -> jax.Array:
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
        packing: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """int[B, S] (or float[B, S, F]) -> [B, S', D] (S' = S without subsampling)."""
        valid = self._source_valid(inputs, source_valid)
        segments = None if packing is None else packing["inputs_segments"]
        positions = None if packing is None else packing["inputs_positions"]
        mask = masks.self_attention(
            self._encoder_valid(valid, packing),
            segments,
            causal=False,
            window=self.config.encoder_window,
        )
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
        packing: dict[str, jax.Array] | None = None,
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
        packing: dict[str, jax.Array] | None = None,
        replacements: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """Teacher-forced pass: int[B, S] (or float[B, S, F]), int[B, T] -> float32[B, T, V].

        The three masks are built once here (`masks.AttentionMask`s), from the gold
        `decoder_inputs` also when scheduled sampling's `replacements` (see
        `Decoder.__call__`) change what the decoder reads.
        """
        valid = self._source_valid(inputs, source_valid)
        p = packing or {}
        encoder_valid = self._encoder_valid(valid, packing)
        encoder_mask = masks.self_attention(
            encoder_valid,
            p.get("inputs_segments"),
            causal=False,
            window=self.config.encoder_window,
        )
        decoder_mask, cross_mask, _ = decoder_masks(
            encoder_valid, decoder_inputs, packing, self.config.decoder_window
        )
        encoded = self.encoder(
            inputs,
            encoder_mask,
            deterministic=deterministic,
            positions=p.get("inputs_positions"),
            frames_valid=valid,
        )
        return self.decoder(
            encoded,
            decoder_inputs,
            decoder_mask,
            cross_mask,
            deterministic=deterministic,
            positions=p.get("targets_positions"),
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
