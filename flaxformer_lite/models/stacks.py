"""The Transformer's encoder and decoder stacks: embeddings, positions, layers, softmax.

`models/transformer.py` assembles them into the model and builds their masks
(`nn/masks.py`); shapes, the decoding cache and the parameter layouts are described
in its module docstring. Letter legend as in `nn/attention.py`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models.blocks import (
    DecoderLayer,
    EncoderLayer,
    check_layout,
    init_stacked,
    rematerialized,
    scan_layers,
)
from flaxformer_lite.models.layer_layout import STACKED
from flaxformer_lite.nn import masks
from flaxformer_lite.nn.dropout import Dropout
from flaxformer_lite.nn.embeddings import AddPositions, FeatureProjection
from flaxformer_lite.nn.layers import layer_norm
from flaxformer_lite.nn.subsampling import Conv1dSubsampler
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
          self_mask: a causal `masks.AttentionMask` (`transformer.decoder_masks`; a dense
            bool[B, T, T] or `masks.LocalMask` also work); cross_mask: an `AttentionMask` or
            bool[B, T, S].
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
        embedded = self._embed_inputs(decoder_inputs, replacements, input_vectors)
        y = self.positions(embedded, positions)
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

    def _embed_inputs(self, decoder_inputs, replacements, input_vectors) -> jax.Array:
        """The input embeddings [B, T, D] of int[B, T] tokens, with the `replacements` and
        `input_vectors` of `__call__` in place."""
        y = self.embed(decoder_inputs)
        if replacements is not None:
            use, new = replacements
            other = self.embed.mixture(new) if new.ndim == 3 else self.embed(new)
            y = jnp.where(use[..., None], other, y)
        if input_vectors is not None:
            use, vectors = input_vectors
            y = jnp.where(use[..., None], vectors.astype(y.dtype), y)
        return y

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
          source_valid: bool[B, S], the encoder positions that hold input; or bool[B / K,
            S] with `cross_kv` of B / K rows, each shared by K consecutive rows (beams).
          features: also return the copy head's inputs (`_outputs`).
        Returns:
          (logits float32[B, T, V], updated cache), with `features` (logits, cache,
          features). Cache layout in `models/transformer.py`'s docstring.
        """
        index = cache["index"]  # int32 scalar, or int32[B]: each row at its own position
        batch, length = tokens.shape
        positions = index[..., None] + jnp.arange(length)  # [T] or [B, T]
        cache_len = cache["layers"][0]["v"].shape[2]  # values [B, N, L, H]
        self_mask = masks.cache_mask(positions, cache_len, batch, self.config.decoder_window)
        # Beams of a sentence (rows b*K..b*K+K-1) may share its cross K/V row b: the
        # cross-attention then sees K*T queries per sentence.
        beams = batch // source_valid.shape[0]
        cross_mask = masks.cross_mask(source_valid, beams * length)  # [B / K, K*T, S]
        embedded = self.embed(tokens)
        y = self.positions(embedded, positions if index.ndim else positions[None, :])
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
