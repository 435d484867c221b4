"""The non-autoregressive Transformer behind the model protocol (`models/base.py`).

The decoder (`models/nat_transformer.py`) predicts every output position in
one call, so it needs the output length before it starts. Two length modes:

  "predict"  a classifier on the mean encoder output predicts the number n of
             target tokens before EOS (as an offset from the source length);
             the decoder fills n positions and EOS is appended. Trained jointly,
             its loss weighted by `length_loss_weight` (fairseq's 0.1).
  "fixed"    the decoder always fills `max_len` positions, is trained to put
             EOS after the target (and at every position after it), and the
             output is cut after its first EOS.

Training is conditional masked language modelling: `masking="uniform"` masks
k ~ U{1..n} target tokens per row (CMLM, so Mask-Predict can refine), `"all"`
masks every token (single-pass NAT); the loss covers the masked tokens
(`objectives/nat_loss.py`). Prediction is `search/mask_predict.py`:
`length_beam` length candidates decoded in parallel, `iterations` Mask-Predict
calls each, the best candidate by mean token log-probability first.

Layout of targets (int[B, T], ending in EOS, PAD after): in "predict" mode the
decoder positions are those of the tokens before EOS; in "fixed" mode all T,
the labels being the targets with EOS in place of the padding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.models.base import Batch, Params, Seq2SeqModel
from flaxformer_lite.models.capture import captured_attention
from flaxformer_lite.models.nat_transformer import NATransformer
from flaxformer_lite.models.packed_rows import Packing
from flaxformer_lite.models.transformer import token_validity
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.objectives import nat_loss as objective
from flaxformer_lite.search import mask_predict as search_lib

LENGTH_MODES = ("predict", "fixed")
DECODER_INPUTS = ("mask", "copy")


class NATSearch(NamedTuple):
    """How to decode a non-autoregressive model; hashable (a static argument of jit)."""

    method: str = "nat"  # read by the decoders' shared code (never "sample")
    max_len: int = 64  # output tokens, EOS included
    iterations: int = 1  # Mask-Predict decoder calls (1: single-pass NAT)
    length_beam: int = 1  # length candidates decoded in parallel ("predict" mode)
    length_scale: float = 1.0  # predicted lengths are multiplied by this


class Layout(NamedTuple):
    """Where a batch's targets sit on the decoder's positions."""

    labels: jax.Array  # int32[B, T], PAD_ID outside `valid`
    valid: jax.Array  # bool[B, T], the decoder positions of each row
    rows: jax.Array  # bool[B], rows holding an example
    lengths: jax.Array  # int32[B], valid positions per row


@dataclasses.dataclass(frozen=True)
class NonAutoregressiveModel(Seq2SeqModel):
    """Encoder + non-causal decoder, a length classifier, CMLM training, Mask-Predict."""

    config: TransformerConfig
    label_smoothing: float = 0.0
    length_mode: str = "predict"  # "predict" | "fixed"
    length_classes: int = 256  # offsets target - source in [-C/2, C/2)
    length_loss_weight: float = 0.1
    length_stop_gradient: bool = False  # the length loss does not reach the encoder
    decoder_inputs: str = "mask"  # "mask" tokens | "copy" of the source embeddings
    masking: str = "uniform"  # "uniform" (CMLM) | "all" (single-pass NAT)
    mask_id: int = BOS_ID  # BOS never occurs in targets, so it can mark masked positions
    eos_id: int = EOS_ID

    def __post_init__(self):
        if self.length_mode not in LENGTH_MODES:
            raise ValueError(f"length_mode {self.length_mode!r}: one of {LENGTH_MODES}")
        if self.decoder_inputs not in DECODER_INPUTS:
            raise ValueError(f"decoder_inputs {self.decoder_inputs!r}: one of {DECODER_INPUTS}")
        if self.masking not in objective.MASKINGS:
            raise ValueError(f"masking {self.masking!r}: one of {objective.MASKINGS}")
        if self.length_mode == "predict" and self.length_classes < 2:
            raise ValueError("the length classifier needs length_classes >= 2")
        if self.config.subsampling_layers:
            raise ConfigError(
                "model.subsampling_layers shortens the encoder output, but the "
                "non-autoregressive model reads one encoder position per input frame: set it to 0"
            )
        if self.decoder_inputs == "copy" and self.config.input_features:
            raise ValueError("decoder_inputs='copy' copies token embeddings; features have none")

    @property
    def predicts_length(self) -> bool:
        return self.length_mode == "predict"

    def module_with(self, capture: tuple[str, ...] = ()) -> NATransformer:
        return NATransformer(
            self.config,
            length_classes=self.length_classes if self.predicts_length else 0,
            copy_source=self.decoder_inputs == "copy",
            length_stop_gradient=self.length_stop_gradient,
            capture=capture,
        )

    @property
    def module(self) -> NATransformer:
        return self.module_with()

    def layout(self, targets: jax.Array) -> Layout:
        """The decoder positions and labels of int[B, T] targets (module docstring)."""
        real = targets != PAD_ID
        rows = real.any(-1)
        positions = jnp.arange(targets.shape[1])[None, :]
        if self.predicts_length:
            lengths = jnp.maximum(real.sum(-1) - 1, 0)  # the tokens before EOS
            valid = positions < lengths[:, None]
            labels = jnp.where(valid, targets, PAD_ID)
        else:
            lengths = jnp.where(rows, targets.shape[1], 0)
            valid = jnp.broadcast_to(rows[:, None], targets.shape)
            labels = jnp.where(valid, jnp.where(real, targets, self.eos_id), PAD_ID)
        return Layout(labels.astype(jnp.int32), valid, rows, lengths.astype(jnp.int32))

    @staticmethod
    def _source_valid(batch: Batch) -> jax.Array:
        valid = batch.get("inputs_valid")
        return token_validity(batch["inputs"]) if valid is None else valid

    def _apply(self, params, batch, decoder_inputs, layout, *, rng=None, module=None, **kw):
        return (module or self.module).apply(
            {"params": params},
            batch["inputs"],
            self._source_valid(batch),
            decoder_inputs,
            layout.valid,
            mask_id=self.mask_id,
            deterministic=rng is None,
            rngs=None if rng is None else {"dropout": rng},
            **kw,
        )

    def _sums(self, batch, layout, logits, length_logits, loss_labels):
        sums = cross_entropy.metrics_sums(
            logits, loss_labels, self.label_smoothing, vocab_size=self.config.output_vocab_size
        )
        if not self.predicts_length:
            return sums["loss"], sums
        source_len = self._source_valid(batch).sum(-1)
        target = search_lib.offset_class(layout.lengths, source_len, self.length_classes)
        lengths = objective.length_metrics(length_logits, target, layout.rows)
        # Per token: mean token loss + weight * mean length loss over the rows.
        scale = sums["tokens"] / jnp.maximum(lengths["length_rows"], 1.0)
        total = sums["loss"] + self.length_loss_weight * lengths["length_loss"] * scale
        return total, {**sums, **lengths}

    def init(self, rng: jax.Array, batch_shapes: dict[str, tuple[int, ...]]) -> Params:
        shape = batch_shapes["inputs"]
        features = bool(self.config.input_features)
        if features and len(shape) == 2:  # (B, S) from length-only callers (train state, shapes)
            shape = (*shape, self.config.input_features)
        source = jnp.ones(shape, jnp.float32 if features else jnp.int32)
        target = jnp.ones(batch_shapes["targets"], jnp.int32)
        return self.module.init(
            {"params": rng},
            source,
            jnp.ones(shape[:2], jnp.bool_),
            target,
            jnp.ones(target.shape, jnp.bool_),
            mask_id=self.mask_id,
        )["params"]

    def loss(self, params, batch, rng, step):
        del step  # no schedule
        if Packing.of(batch) is not None:
            raise ValueError("the non-autoregressive model reads one example per row: no packing")
        layout = self.layout(batch["targets"])
        mask_rng, dropout_rng = jax.random.split(rng)
        masked = objective.random_masks(mask_rng, layout.valid, self.masking)
        decoder_inputs = jnp.where(masked, self.mask_id, layout.labels)
        logits, length_logits = self._apply(params, batch, decoder_inputs, layout, rng=dropout_rng)
        loss_labels = jnp.where(masked, layout.labels, PAD_ID)
        return self._sums(batch, layout, logits, length_logits, loss_labels)

    def _all_masked(self, params, batch, module=None, **kw):
        """The single-pass prediction at the gold length: (layout, outputs of the module)."""
        layout = self.layout(batch["targets"])
        decoder_inputs = jnp.where(layout.valid, self.mask_id, PAD_ID)
        return layout, self._apply(params, batch, decoder_inputs, layout, module=module, **kw)

    def evaluate(self, params, batch):
        layout, (logits, length_logits) = self._all_masked(params, batch)
        return self._sums(batch, layout, logits, length_logits, layout.labels)[1]

    def predict(self, params, batch, search: NATSearch, rng=None):
        del rng  # deterministic
        if batch.get("prefix") is not None:
            raise ValueError("a non-autoregressive model decodes no forced prefix")
        # The length scale is traced: one compilation serves every scale.
        scale = jnp.float32(search.length_scale)
        static = search._replace(length_scale=1.0)
        return _predict(self, params, batch["inputs"], self._source_valid(batch), static, scale)

    def score(self, params, batch):
        """Log-probabilities of the labels (`layout`) in one pass at the gold length, all
        positions masked; in "predict" mode without the length's own probability."""
        layout, (logits, _) = self._all_masked(params, batch)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        token = jnp.take_along_axis(log_probs, layout.labels[..., None], axis=-1)[..., 0]
        token = jnp.where(layout.valid, token, 0.0)
        return token, token.sum(axis=-1)

    def attention_weights(self, params, batch, layers):
        module = self.module_with(capture=tuple(layers))
        _, (_, state) = self._all_masked(params, batch, module=module, mutable=["intermediates"])
        return captured_attention(state["intermediates"], tuple(layers), self.config)

    def forced_argmax(self, params, batch):
        """The single-pass argmax at the gold length (every position masked)."""
        layout, (logits, _) = self._all_masked(params, batch)
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        best = jnp.where(layout.valid, best, PAD_ID)
        if self.predicts_length:  # EOS is appended, not predicted
            at_end = jnp.arange(best.shape[1])[None, :] == layout.lengths[:, None]
            best = jnp.where(at_end & layout.rows[:, None], self.eos_id, best)
        return best


def _repeat(x: jax.Array, times: int) -> jax.Array:
    return x if times == 1 else jnp.repeat(x, times, axis=0)


def decoder_width(longest: int, full: int) -> int:
    """Decoder positions for candidates of at most `longest` tokens: the next power of two
    (at least 8), at most `full`, so a file compiles a few widths, not one per length."""
    width = 8
    while width < longest:
        width *= 2
    return min(width, full)


@functools.partial(jax.jit, static_argnames=("model", "search"))
def _lengths(model, params, inputs, source_valid, search: NATSearch, length_scale):
    """(encoded [B, S, D], candidate lengths int32[B, l])."""
    module, variables = model.module, {"params": params}
    encoded = module.apply(variables, inputs, source_valid, method=NATransformer.encode)
    if not model.predicts_length:
        return encoded, jnp.full((inputs.shape[0], 1), search.max_len, jnp.int32)
    length_logits = module.apply(
        variables, encoded, source_valid, method=NATransformer.length_logits
    )
    lengths = search_lib.length_candidates(
        length_logits,
        source_valid.sum(-1),
        beam=search.length_beam,
        scale=length_scale,
        max_len=search.max_len - 1,  # room for the appended EOS
    )
    return encoded, lengths


def _predict(model, params, inputs, source_valid, search: NATSearch, length_scale):
    """(tokens int32[B, l, max_len], mean token log-probabilities float32[B, l]), best first.

    Called eagerly, the decoder is as wide as the longest candidate needs (a host read of
    the lengths between the two jitted halves); traced inside another jit, as wide as
    max_len allows.
    """
    encoded, lengths = _lengths(model, params, inputs, source_valid, search, length_scale)
    full = search.max_len - 1 if model.predicts_length else search.max_len
    width = full
    traced = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)
    if model.predicts_length:
        with contextlib.suppress(*traced):  # traced: the lengths are not known here
            width = decoder_width(int(lengths.max()), full)
    return _refine(model, params, encoded, inputs, source_valid, lengths, search, width)


@functools.partial(jax.jit, static_argnames=("model", "search", "width"))
def _refine(model, params, encoded, inputs, source_valid, lengths, search: NATSearch, width: int):
    """Mask-Predict over every candidate length at once, then the best candidate first."""
    module, variables = model.module, {"params": params}
    batch, beam = lengths.shape
    lengths = lengths.reshape(-1)  # [R], row b * l + j is candidate j of example b
    encoded, valid, inputs = (_repeat(x, beam) for x in (encoded, source_valid, inputs))
    copied = None
    if model.decoder_inputs == "copy":
        copied = module.apply(
            variables, inputs, valid, lengths, width, method=NATransformer.copied_inputs
        )
    # Padding and the mask are never outputs; nor is EOS where the length is known.
    never = [PAD_ID, model.mask_id] + ([model.eos_id] if model.predicts_length else [])
    columns = model.config.padded(model.config.output_vocab_size)  # the logits' (`nn/vocab.py`)
    bias = jnp.zeros((columns,), jnp.float32).at[jnp.array(never)].set(-jnp.inf)

    def logits_fn(tokens, target_valid):
        logits = module.apply(
            variables,
            encoded,
            valid,
            tokens,
            target_valid,
            copied=copied,
            mask_id=model.mask_id,
            method=NATransformer.decode,
        )
        return logits + bias

    tokens, scores = search_lib.mask_predict(
        logits_fn,
        lengths,
        width=width,
        iterations=search.iterations,
        mask_id=model.mask_id,
        pad_id=PAD_ID,
    )  # [R, W] each
    pad = search.max_len - width  # back to max_len columns: n tokens, EOS, padding
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)), constant_values=PAD_ID)
    scores = jnp.pad(scores, ((0, 0), (0, pad)))
    if model.predicts_length:
        at_end = jnp.arange(search.max_len)[None, :] == lengths[:, None]
        tokens = jnp.where(at_end, model.eos_id, tokens)
    tokens = search_lib.truncate_at_eos(tokens, model.eos_id, PAD_ID)
    kept = (tokens != PAD_ID) & (tokens != model.eos_id if model.predicts_length else True)
    scores = jnp.where(kept, scores, 0.0)
    return search_lib.best_candidate(
        tokens.reshape(batch, beam, -1),
        scores.reshape(batch, beam, -1),
        kept.sum(-1).reshape(batch, beam),
    )
