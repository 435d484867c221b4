"""The autoregressive Transformer behind the model protocol (`models/base.py`).

Training is teacher forcing: decoder input = BOS + targets[:-1], labels =
targets (ids + EOS), so every position predicts the next token and EOS is
learned as the way to stop. With scheduled sampling on
(`objectives/scheduled_sampling.py`) the loss runs the decoder more than
once, feeding later passes inputs mixed from the previous pass's predictions.
Prediction is cached search (`models/predict.py` adapts the modules to the
model-free searches of `search/`); scoring is the same teacher-forced pass
read as log-probabilities.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.config.variants import CopyHead, GuidedAttention, ScheduledSampling
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.models import predict
from flaxformer_lite.models.base import Params, Seq2SeqModel
from flaxformer_lite.models.capture import captured_attention
from flaxformer_lite.models.copy_transformer import CopyTransformer
from flaxformer_lite.models.packed_rows import Packing
from flaxformer_lite.models.transformer import Transformer, token_validity
from flaxformer_lite.nn.subsampling import subsampled_validity
from flaxformer_lite.objectives import copy_loss, cross_entropy
from flaxformer_lite.objectives import guided_attention as ga
from flaxformer_lite.objectives import scheduled_sampling as ss


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
    return jnp.where(starts, bos_id, jnp.where(segments == 0, PAD_ID, shifted))


@dataclasses.dataclass(frozen=True)
class AutoregressiveModel(Seq2SeqModel):
    """Encoder + causal decoder trained with teacher forcing and label smoothing.

    With `copy` the output is the pointer-generator mixture over the extended
    vocabulary (`models/copy_transformer.py`): batches then carry extended ids
    (`data/extended_ids.py`), and every output of the protocol (predicted
    tokens, scores) may hold them.
    """

    config: TransformerConfig
    label_smoothing: float = 0.0  # eps_ls of the training loss (§5.4)
    scheduled_sampling: ScheduledSampling = ScheduledSampling()  # off: teacher forcing
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    copy: CopyHead | None = None  # None: the plain softmax output
    guided_attention: GuidedAttention = GuidedAttention()  # off: weight 0

    @property
    def module(self) -> Transformer | CopyTransformer:
        return self._module()

    def _module(self, capture: tuple[str, ...] = ()):
        if self.copy is None:
            return Transformer(self.config, capture=capture)
        return CopyTransformer(self.config, self.copy, capture=capture)

    def _forward(self, params, batch, decoder_inputs, *, rng=None, module=None, **kw):
        """Logits [B, T, V], or with the copy head log P [B, T, W] (the extended vocabulary)."""
        module = module or self.module
        copy_state = self.copy is not None and "mutable" not in kw
        if copy_state:
            kw["mutable"] = ["intermediates"]  # the head reads its attention from there
        out = module.apply(
            {"params": params},
            batch["inputs"],
            decoder_inputs,
            source_valid=batch.get("inputs_valid"),
            deterministic=rng is None,
            rngs=None if rng is None else {"dropout": rng},
            **kw,
        )
        return out[0] if copy_state else out

    def _outputs(self, params, batch, decoder_inputs, **kw):
        """What the loss reads: logits, or the copy mixture's inputs (its [B, T, W]
        log-probabilities are never built in training, `objectives/copy_loss.py`)."""
        if self.copy is not None:
            kw["parts"] = True
        return self._forward(params, batch, decoder_inputs, **kw)

    def _metrics(self, outputs, targets, segments=None):
        if self.copy is None:
            return cross_entropy.metrics_sums(
                outputs, targets, self.label_smoothing, segments, self.config.output_vocab_size
            )
        return copy_loss.parts_metrics_sums(outputs, targets, self.label_smoothing, segments)

    def init(self, rng: jax.Array, batch_shapes: dict[str, tuple[int, ...]]) -> Params:
        shape = batch_shapes["inputs"]  # (B, S) token ids or (B, S, F) features
        features = bool(self.config.input_features)
        if features and len(shape) == 2:  # (B, S) from length-only callers (train state, shapes)
            shape = (*shape, self.config.input_features)
        source = jnp.ones(shape, jnp.float32 if features else jnp.int32)
        valid = jnp.ones(shape[:2], jnp.bool_) if features else None
        target = jnp.ones(batch_shapes["targets"], jnp.int32)
        # The copy head reads its attention from "intermediates", which init leaves immutable.
        kw = {} if self.copy is None else {"mutable": ["params", "intermediates"]}
        return self.module.init({"params": rng}, source, target, source_valid=valid, **kw)["params"]

    def loss(self, params, batch, rng, step):
        packing = Packing.of(batch)
        segments = None if packing is None else packing.targets_segments
        decoder_inputs = shift_right(batch["targets"], self.bos_id, segments)  # BOS + targets[:-1]
        extra = {}
        if self.scheduled_sampling.enabled:
            logits, extra = self._sampled_passes(params, batch, decoder_inputs, rng, step, packing)
        elif self.guided_attention.enabled:
            return self._guided_loss(params, batch, decoder_inputs, rng, packing)
        else:
            logits = self._outputs(params, batch, decoder_inputs, rng=rng, packing=packing)
        sums = self._metrics(logits, batch["targets"], segments)
        return sums["loss"], {**sums, **extra}

    def _guided_loss(self, params, batch, decoder_inputs, rng, packing):
        """The loss plus the guided-attention term (`objectives/guided_attention.py`): the
        chosen cross-attention layers are captured in the same teacher-forced pass. After the
        train step's division by the token count the objective is
        cross-entropy per token + weight * mean(A * W)."""
        if self.copy is not None or packing is not None:
            raise ValueError("guided attention supports neither the copy head nor packed rows")
        g, cfg = self.guided_attention, self.config
        names = g.capture_names(cfg.num_decoder_layers)
        logits, state = self._forward(
            params,
            batch,
            decoder_inputs,
            rng=rng,
            module=self._module(names),
            mutable=["intermediates"],
        )
        targets = batch["targets"]
        sums = self._metrics(logits, targets)
        valid = batch.get("inputs_valid")
        valid = token_validity(batch["inputs"]) if valid is None else valid
        encoder_valid = subsampled_validity(valid, cfg)  # [B, S']
        weights = captured_attention(state["intermediates"], names, cfg)
        total = cells = jnp.zeros((), jnp.float32)
        for name in names:
            w = weights[name]  # [B, N, T, S']
            if g.heads:
                w = w[:, jnp.asarray(g.heads)]
            t, c = ga.guided_attention_loss(w, targets != PAD_ID, encoder_valid, g.sigma)
            total, cells = total + t, cells + c
        loss = sums["loss"] + ga.weighted_sum(total, cells, sums["tokens"], g.weight)
        extra = {"guided_attention": total, "guided_attention_cells": cells}
        return loss, {**sums, "loss": loss, **extra}

    def _sampled_passes(self, params, batch, decoder_inputs, rng, step, packing):
        """Scheduled sampling's decoder passes (`objectives/scheduled_sampling.py`): the
        encoder once, a teacher-forced pass, then `passes` - 1 passes on inputs mixed from
        the previous pass's predictions. Returns (last logits [B, T, V], metric sums)."""
        cfg = self.scheduled_sampling
        module = self.module
        valid = batch.get("inputs_valid")
        if valid is None:
            valid = token_validity(batch["inputs"])  # feature inputs always carry their validity
        keys = jax.random.split(rng, 2 * cfg.passes)  # dropout of encoder + passes; mixing
        encoded = module.apply(
            {"params": params},
            batch["inputs"],
            valid,
            deterministic=False,
            packing=packing,
            method="encode",
            rngs={"dropout": keys[0]},
        )

        def decode(key, replacements=None):
            return module.apply(
                {"params": params},
                encoded,
                valid,
                decoder_inputs,
                deterministic=False,
                packing=packing,
                replacements=replacements,
                method="decode",
                rngs={"dropout": key},
            )

        eps = ss.gold_probability(cfg, step)
        logits = decode(keys[1])
        for n in range(1, cfg.passes):
            previous = logits if cfg.gradient == "all" else jax.lax.stop_gradient(logits)
            use, new = ss.mix_inputs(
                cfg, previous, decoder_inputs, eps, keys[cfg.passes + n], self.bos_id
            )
            logits = decode(keys[n + 1], (use, new))
        replaceable = ss.replaceable(decoder_inputs, self.bos_id)
        return logits, {
            "ss_replaced": use.sum().astype(jnp.float32),
            "ss_replaceable": replaceable.sum().astype(jnp.float32),
        }

    def evaluate(self, params, batch):
        outputs = self._outputs(params, batch, shift_right(batch["targets"], self.bos_id))
        return self._metrics(outputs, batch["targets"])

    def predict(self, params, batch, search: predict.SearchConfig, rng=None):
        return predict.decode(
            self.module,
            params,
            batch["inputs"],
            search=search,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            prefix=batch.get("prefix"),
            rng=rng,
            source_valid=batch.get("inputs_valid"),
        )

    def score(self, params, batch):
        targets = batch["targets"]  # [B, T]
        logits = self._forward(params, batch, shift_right(targets, self.bos_id))  # [B, T, V]
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        token = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, T]
        token = jnp.where(targets != PAD_ID, token, 0.0)
        return token, token.sum(axis=-1)

    def attention_weights(self, params, batch, layers):
        module = self._module(tuple(layers))
        decoder_inputs = shift_right(batch["targets"], self.bos_id)
        _, state = self._forward(
            params, batch, decoder_inputs, module=module, mutable=["intermediates"]
        )
        return captured_attention(state["intermediates"], tuple(layers), self.config)

    def forced_argmax(self, params, batch):
        targets = batch["targets"]  # [B, T]
        logits = self._forward(params, batch, shift_right(targets, self.bos_id))  # [B, T, V]
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
        return jnp.where(targets != PAD_ID, best, PAD_ID)

    def copy_gate(self, params, batch) -> jax.Array:
        """The copy head's p_gen float32[B, T] at every target position, teacher forced
        (0 at padding); what decoding used when the targets are its output."""
        if self.copy is None:
            raise ValueError("this model has no copy head")
        targets = batch["targets"]
        (_, gate), _ = self.module.apply(
            {"params": params},
            batch["inputs"],
            batch.get("inputs_valid"),
            shift_right(targets, self.bos_id),
            method=_decode_with_gate,
            mutable=["intermediates"],
        )
        return jnp.where(targets != PAD_ID, gate, 0.0)


def _decode_with_gate(module: CopyTransformer, inputs, source_valid, decoder_inputs):
    valid = token_validity(inputs) if source_valid is None else source_valid
    source = module.encode(inputs, valid)
    return module.decode(source, valid, decoder_inputs, return_gate=True)
