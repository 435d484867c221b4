"""The Transformer with a pointer-generator output head (`models/pointer_generator.py`).

The encoder, decoder and their parameter names are the plain Transformer's
(`transformer.encoder_and_decoder`); the head adds `copy_gate`. Its methods
mirror `Transformer`'s, so the search adapters (`models/predict.py`) drive
both, but return log-probabilities float32[B, T, W] over the extended
vocabulary W = V + S instead of logits:

  encode(inputs)              -> source = {"encoded": [B, S, D], "copy_ids": int[B, S]}
  decode(source, valid, ids)  -> log P [B, T, W]     (teacher forced)
  precompute_cross_kv(source) -> {"kv": per-layer (k, v), "encoded", "copy_ids"}
  decode_step(ids, cache, cross_kv, valid) -> (log P [B, T, W], cache)

Extended ids (>= V, `data/extended_ids.py`) are read as UNK_ID wherever a token
is embedded: in the source, and in the decoder input when a previous output was
copied. The copied layer's attention probabilities are sown into the
"intermediates" collection by the decoder's capture seam and read back here,
so every method must be applied with `mutable=["intermediates"]`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.config.variants import CopyHead
from flaxformer_lite.constants import UNK_ID
from flaxformer_lite.models import pointer_generator as pg
from flaxformer_lite.models.capture import captured_attention
from flaxformer_lite.models.packed_rows import Packing
from flaxformer_lite.models.transformer import (
    decoder_masks,
    encoder_and_decoder,
    encoder_masks,
    token_validity,
)
from flaxformer_lite.nn import precision
from flaxformer_lite.nn.vocab import real_rows


class CopyTransformer(nn.Module):
    """Encoder-decoder Transformer whose output is the pointer-generator mixture."""

    config: TransformerConfig
    head: CopyHead = CopyHead()
    capture: tuple[str, ...] = ()  # more attention probabilities to sow (`attention_weights`)

    def setup(self):
        cfg = self.config
        if cfg.input_features:
            raise ValueError("the copy head copies source tokens; feature inputs have none")
        self.copy_name = self.head.attention_name(cfg)
        capture = tuple(dict.fromkeys((*self.capture, self.copy_name)))
        _, self.encoder, self.decoder = encoder_and_decoder(cfg, capture)
        self.copy_gate = pg.CopyGate(cfg)

    def _embeddable(self, ids: jax.Array) -> jax.Array:
        """Extended ids (>= V) as UNK_ID, for an embedding lookup."""
        return jnp.where(ids >= self.config.output_vocab_size, UNK_ID, ids)

    def encode(
        self,
        inputs: jax.Array,
        source_valid: jax.Array | None = None,
        *,
        deterministic: bool = True,
        packing: Packing | None = None,
    ) -> dict[str, jax.Array]:
        """int[B, S] source ids (extended ids included) -> the source dict (module docstring)."""
        valid = token_validity(inputs) if source_valid is None else source_valid
        mask, positions = encoder_masks(valid, packing, self.config.encoder_window)
        encoded = self.encoder(
            self._embeddable(inputs), mask, deterministic=deterministic, positions=positions
        )
        return {"encoded": encoded, "copy_ids": inputs.astype(jnp.int32)}

    def _parts(self, logits, feats, source) -> dict[str, jax.Array]:
        """The mixture's inputs from the decoder's outputs: {"logits" float32[B, T, V],
        "gate" float32[B, T] (the logit of p_gen), "attention" float32[B, T, S],
        "copy_ids" int[B, S]}."""
        weights = captured_attention(
            self.variables["intermediates"], (self.copy_name,), self.config
        )[self.copy_name]  # [B, N, T, S]
        attention = pg.copy_attention(weights, self.head.heads)  # [B, T, S]
        # The context is a [T, S] x [S, D] matmul per example: compute-dtype operands,
        # float32 result (bf16 on accelerators, as the cross-attention's own product).
        dtype = self.config.dtype
        context = precision.dot_f32(
            "bts,bsd->btd", attention.astype(dtype), source["encoded"].astype(dtype)
        )
        gate = self.copy_gate(feats["hidden"], feats["embedded"], context)
        return {
            # The real vocabulary only: extended ids start at V (`data/extended_ids.py`).
            "logits": real_rows(logits, self.config.output_vocab_size, axis=-1),
            "gate": gate,
            "attention": attention,
            "copy_ids": source["copy_ids"],
        }

    def _mixture(self, logits, feats, source) -> tuple[jax.Array, jax.Array]:
        """(log P float32[B, T, W], gate logit float32[B, T]) from the decoder's outputs."""
        parts = self._parts(logits, feats, source)
        size = self.config.output_vocab_size + parts["copy_ids"].shape[1]
        log_probs = pg.log_mixture(
            parts["logits"], parts["gate"], parts["attention"], parts["copy_ids"], size
        )
        return log_probs, parts["gate"]

    def decode(
        self,
        source: dict[str, jax.Array],
        source_valid: jax.Array,
        decoder_inputs: jax.Array,
        *,
        deterministic: bool = True,
        packing: Packing | None = None,
        return_gate: bool = False,
        parts: bool = False,
    ):
        """Teacher-forced log P float32[B, T, W] for decoder inputs int[B, T] (BOS + prefix,
        extended ids allowed); with `return_gate` also p_gen float32[B, T]; with `parts`
        instead the mixture's inputs (`_parts`), from which the training loss is computed
        without the [B, T, W] tensor (`objectives/copy_loss.py`)."""
        self_mask, cross, positions = decoder_masks(
            source_valid, decoder_inputs, packing, self.config.decoder_window
        )
        logits, feats = self.decoder(
            source["encoded"],
            self._embeddable(decoder_inputs),
            self_mask,
            cross,
            deterministic=deterministic,
            positions=positions,
            features=True,
        )
        if parts:
            return self._parts(logits, feats, source)
        log_probs, gate = self._mixture(logits, feats, source)
        return (log_probs, jax.nn.sigmoid(gate)) if return_gate else log_probs

    def precompute_cross_kv(self, source: dict[str, jax.Array]) -> dict:
        """Every layer's cross-attention keys/values, with what the head reads per step."""
        return {"kv": self.decoder.cross_kv(source["encoded"]), **source}

    def decode_step(
        self, tokens: jax.Array, cache: dict, cross_kv: dict, source_valid: jax.Array
    ) -> tuple[jax.Array, dict]:
        """Cached decoding of int[B, T] new tokens -> (log P float32[B, T, W], new cache)."""
        logits, cache, feats = self.decoder.step(
            self._embeddable(tokens), cache, cross_kv["kv"], source_valid, features=True
        )
        return self._mixture(logits, feats, cross_kv)[0], cache

    def __call__(
        self,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        source_valid: jax.Array | None = None,
        deterministic: bool = True,
        packing: Packing | None = None,
        replacements=None,
        parts: bool = False,
    ) -> jax.Array | dict[str, jax.Array]:
        """Teacher-forced pass: int[B, S], int[B, T] -> log P float32[B, T, W] (with `parts`
        the mixture's inputs, as `decode`)."""
        if replacements is not None:
            raise ValueError("the copy head does not run scheduled sampling")
        valid = token_validity(inputs) if source_valid is None else source_valid
        source = self.encode(inputs, valid, deterministic=deterministic, packing=packing)
        return self.decode(
            source, valid, decoder_inputs, deterministic=deterministic, packing=packing, parts=parts
        )
