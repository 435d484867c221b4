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
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.models import predict
from flaxformer_lite.models.base import Batch, Params, Seq2SeqModel
from flaxformer_lite.models.capture import captured_attention
from flaxformer_lite.models.transformer import Transformer, token_validity
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.objectives import scheduled_sampling as ss

PACKING_KEYS = ("inputs_segments", "inputs_positions", "targets_segments", "targets_positions")


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


def packing_of(batch: Batch) -> dict[str, jax.Array] | None:
    """The packing fields of a batch of packed rows, or None."""
    return {k: batch[k] for k in PACKING_KEYS} if PACKING_KEYS[0] in batch else None


@dataclasses.dataclass(frozen=True)
class AutoregressiveModel(Seq2SeqModel):
    """Encoder + causal decoder trained with teacher forcing and label smoothing."""

    config: TransformerConfig
    label_smoothing: float = 0.0  # eps_ls of the training loss (§5.4)
    scheduled_sampling: ss.ScheduledSampling = ss.ScheduledSampling()  # off: teacher forcing
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    @property
    def module(self) -> Transformer:
        return Transformer(self.config)

    def _forward(self, params, batch, decoder_inputs, *, rng=None, module=None, **kw):
        module = module or self.module
        return module.apply(
            {"params": params},
            batch["inputs"],
            decoder_inputs,
            source_valid=batch.get("inputs_valid"),
            deterministic=rng is None,
            rngs=None if rng is None else {"dropout": rng},
            **kw,
        )

    def init(self, rng: jax.Array, batch_shapes: dict[str, tuple[int, ...]]) -> Params:
        shape = batch_shapes["inputs"]  # (B, S) token ids or (B, S, F) features
        features = bool(self.config.input_features)
        source = jnp.ones(shape, jnp.float32 if features else jnp.int32)
        valid = jnp.ones(shape[:2], jnp.bool_) if features else None
        target = jnp.ones(batch_shapes["targets"], jnp.int32)
        return self.module.init({"params": rng}, source, target, source_valid=valid)["params"]

    def loss(self, params, batch, rng, step):
        packing = packing_of(batch)
        segments = None if packing is None else packing["targets_segments"]
        decoder_inputs = shift_right(batch["targets"], self.bos_id, segments)  # BOS + targets[:-1]
        extra = {}
        if self.scheduled_sampling.enabled:
            logits, extra = self._sampled_passes(params, batch, decoder_inputs, rng, step, packing)
        else:
            logits = self._forward(params, batch, decoder_inputs, rng=rng, packing=packing)
        sums = cross_entropy.metrics_sums(logits, batch["targets"], self.label_smoothing, segments)
        return sums["loss"], {**sums, **extra}

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
        logits = self._forward(params, batch, shift_right(batch["targets"], self.bos_id))
        return cross_entropy.metrics_sums(logits, batch["targets"], self.label_smoothing)

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
        module = Transformer(self.config, capture=tuple(layers))
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
