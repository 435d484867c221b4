"""The CTC non-autoregressive Transformer behind the model protocol (`models/base.py`).

Libovický & Helcl (2018)'s CTC decoder, trained with glancing (Qian et al. 2021)
as in Gu & Kong (2021). Its module is the Mask-Predict model's decoder
(`models/nat_transformer.py`, no length classifier); what differs is how its
positions are laid out, trained and read:

- **Upsampled source.** A row of S source tokens (EOS included) gets
  T = ceil(upsample_ratio * S) decoder positions, each reading the uniform copy of
  the source embeddings (`NATransformer.copied_inputs`: position t takes source
  position round((S - 1) / (T - 1) t), so with ratio 3 nearly every source token
  is read three times). Self-attention covers the T valid positions only.
- **Outputs.** Each position emits a token or the blank. The blank is PAD_ID:
  no target holds it, so it cannot be a real token, and its softmax row and
  embedding already exist. BOS (the mask token of the inputs) and EOS are never
  emitted (logit PADDED_LOGIT): the labels are the target's tokens before EOS,
  and decoding appends EOS. No length is predicted: the output length is what
  the collapse (merge repeats, drop blanks) leaves.
- **Training.** The CTC loss (`objectives/ctc_loss.py`) over every alignment of
  the labels to the T positions, summed per row and divided by the labels'
  count. A target that needs more than T positions (its tokens plus one blank
  per adjacent repeat) has no alignment: it is left out of the loss and of
  "tokens", and counted as "unalignable". With glancing
  (`objectives/glancing.py`, on unless both ratios are 0) a first decoder pass
  without gradient and without dropout, on the same encoder output, is aligned
  to the target (Viterbi); floor(ratio(step) * distance) random positions of the
  second pass are fed the embeddings of their aligned symbols (the blank's
  included) instead of the copied source.
- **Decoding** (`search/ctc_collapse.py`): the argmax of every position, then
  the collapse, in one jitted decoder call; the score is the best path's
  log-probability.
- **Scoring** is log P(target | source) summed over the alignments (the negated
  CTC loss; IMPOSSIBLE for an unalignable target). CTC does not split it over
  the tokens: `score` puts all of it on the EOS position, so that the tokens'
  sum is the sequence's, and `decode.py` refuses --score_tokens.

Batches hold one example per row (no packing) of token ids (no features).
Letters: B batch, S source, T decoder positions, N target tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.config.variants import upsampled_length
from flaxformer_lite.constants import BOS_ID, EOS_ID, IMPOSSIBLE, PAD_ID
from flaxformer_lite.models.base import Batch, Params, Seq2SeqModel
from flaxformer_lite.models.capture import captured_attention
from flaxformer_lite.models.nat_transformer import NATransformer
from flaxformer_lite.models.non_autoregressive import NATSearch
from flaxformer_lite.models.packed_rows import Packing
from flaxformer_lite.models.transformer import token_validity
from flaxformer_lite.nn.vocab import PADDED_LOGIT
from flaxformer_lite.objectives import ctc_loss, glancing
from flaxformer_lite.search import ctc_collapse


class Labels(NamedTuple):
    """A batch's CTC targets: the tokens before EOS."""

    tokens: jax.Array  # int32[B, N], PAD_ID after each row's tokens
    valid: jax.Array  # bool[B, N], a prefix of each row
    rows: jax.Array  # bool[B], rows holding an example


def labels_of(targets: jax.Array) -> Labels:
    """The labels of int[B, N] targets ending in EOS (PAD_ID after it)."""
    rows = (targets != PAD_ID).any(-1)
    count = jnp.maximum((targets != PAD_ID).sum(-1) - 1, 0)  # EOS left out
    valid = jnp.arange(targets.shape[1])[None, :] < count[:, None]
    return Labels(jnp.where(valid, targets, PAD_ID).astype(jnp.int32), valid, rows)


@dataclasses.dataclass(frozen=True)
class CTCModel(Seq2SeqModel):
    """Encoder + non-causal decoder over the upsampled source, CTC loss, glancing."""

    config: TransformerConfig
    upsample_ratio: float = 3.0  # decoder positions per source token
    glance_start: float = 0.5  # the glancing ratio at step 0 (0 and 0: no glancing)
    glance_end: float = 0.3  # ... from glance_steps on
    glance_steps: int = 300_000  # steps of the linear anneal
    mask_id: int = BOS_ID  # a decoder input that reads the copied source
    blank_id: int = PAD_ID  # never a target token
    eos_id: int = EOS_ID

    def __post_init__(self):
        if not self.upsample_ratio >= 1.0:
            raise ValueError(f"upsample_ratio {self.upsample_ratio}: need >= 1")
        if self.config.input_features or self.config.subsampling_layers:
            raise ValueError("the CTC decoder copies source token embeddings: token inputs only")
        if self.glance_steps < 1:
            raise ValueError(f"glance_steps {self.glance_steps}: need >= 1")

    @property
    def glances(self) -> bool:
        return self.glance_start > 0 or self.glance_end > 0

    def module_with(self, capture: tuple[str, ...] = ()) -> NATransformer:
        return NATransformer(self.config, length_classes=0, copy_source=True, capture=capture)

    @property
    def module(self) -> NATransformer:
        return self.module_with()

    def decoder_valid(self, source_valid: jax.Array) -> jax.Array:
        """bool[B, T]: each row's ceil(ratio * S) decoder positions, T that of the padded S."""
        width = upsampled_length(source_valid.shape[1], self.upsample_ratio)
        lengths = upsampled_length(source_valid.sum(-1), self.upsample_ratio)
        return jnp.arange(width)[None, :] < lengths[:, None]

    def emittable(self, logits: jax.Array) -> jax.Array:
        """float[B, T, V] logits with the mask token and EOS made PADDED_LOGIT."""
        never = jnp.zeros((logits.shape[-1],), logits.dtype)
        never = never.at[jnp.array([self.mask_id, self.eos_id])].set(PADDED_LOGIT)
        return logits + never

    @staticmethod
    def _source_valid(batch: Batch) -> jax.Array:
        valid = batch.get("inputs_valid")
        return token_validity(batch["inputs"]) if valid is None else valid

    def _single_pass(self, params, batch, module=None, **kw):
        """The decoder over the copied source alone, without dropout: (decoder validity
        bool[B, T], the module's output: (logits, None), with `mutable` also its state)."""
        source_valid = self._source_valid(batch)
        decoder_valid = self.decoder_valid(source_valid)
        decoder_inputs = jnp.where(decoder_valid, self.mask_id, PAD_ID)
        out = (module or self.module).apply(
            {"params": params},
            batch["inputs"],
            source_valid,
            decoder_inputs,
            decoder_valid,
            mask_id=self.mask_id,
            **kw,
        )
        return decoder_valid, out

    def _sums(self, nll, labels: Labels, fits) -> dict[str, jax.Array]:
        """The loss sums over the alignable rows, and the rows counted."""
        counted = labels.rows & fits
        total = jnp.where(counted, nll, 0.0).sum()  # where, not a product: no 0 * 1e5
        return {
            "loss": total,
            "nll": total,
            "tokens": jnp.where(counted, labels.valid.sum(-1), 0).sum().astype(jnp.float32),
            "sequences": labels.rows.sum().astype(jnp.float32),
            "unalignable": (labels.rows & ~fits).sum().astype(jnp.float32),
        }

    def _aligned(self, log_probs, decoder_valid, labels: Labels, fits):
        """(best CTC path int32[B, T], the argmax's wrong positions int32[B] against it,
        the positions compared bool[B, T]: those of the alignable rows)."""
        path, _ = ctc_loss.best_alignment(
            log_probs, decoder_valid, labels.tokens, labels.valid, self.blank_id
        )
        compared = decoder_valid & (fits & labels.rows)[:, None]
        wrong = (jnp.argmax(log_probs, axis=-1) != path) & compared
        return path, wrong.sum(-1), compared

    def init(self, rng: jax.Array, batch_shapes: dict[str, tuple[int, ...]]) -> Params:
        source = jnp.ones(batch_shapes["inputs"][:2], jnp.int32)
        width = upsampled_length(source.shape[1], self.upsample_ratio)
        decoder_valid = jnp.ones((source.shape[0], width), jnp.bool_)
        return self.module.init(
            {"params": rng},
            source,
            jnp.ones(source.shape, jnp.bool_),
            jnp.full(decoder_valid.shape, self.mask_id, jnp.int32),
            decoder_valid,
            mask_id=self.mask_id,
        )["params"]

    def loss(self, params, batch, rng, step):
        if Packing.of(batch) is not None:
            raise ValueError("the CTC model reads one example per row: no packing")
        source_valid = self._source_valid(batch)
        labels = labels_of(batch["targets"])
        decoder_valid = self.decoder_valid(source_valid)
        fits = ctc_loss.alignable(labels.tokens, labels.valid, decoder_valid)
        glance_rng, encoder_rng, decoder_rng = jax.random.split(rng, 3)
        encoded, decode = self._training_passes(
            params, batch["inputs"], source_valid, decoder_valid, encoder_rng
        )
        decoder_inputs = jnp.where(decoder_valid, self.mask_id, PAD_ID)
        extra = {}
        if self.glances:  # the first pass: no gradient, no dropout, the same encoder output
            first = jax.lax.stop_gradient(decode(jax.lax.stop_gradient(encoded), decoder_inputs))
            log_probs = jax.nn.log_softmax(self.emittable(first), axis=-1)
            path, wrong, compared = self._aligned(log_probs, decoder_valid, labels, fits)
            ratio = glancing.ratio(step, self.glance_start, self.glance_end, self.glance_steps)
            shown = glancing.positions(glance_rng, compared, glancing.count(ratio, wrong))
            decoder_inputs = jnp.where(shown, path, decoder_inputs)
            extra = {
                "aligned_errors": wrong.sum().astype(jnp.float32),
                "aligned_positions": compared.sum().astype(jnp.float32),
                "glanced": shown.sum().astype(jnp.float32),
            }
        logits = self.emittable(decode(encoded, decoder_inputs, decoder_rng))
        nll = ctc_loss.ctc_nll(logits, decoder_valid, labels.tokens, labels.valid, self.blank_id)
        sums = self._sums(nll, labels, fits) | extra
        return sums["loss"], sums

    def _training_passes(self, params, inputs, source_valid, decoder_valid, encoder_rng):
        """(the encoder output [B, S, D] with dropout, `decode(encoded, decoder_inputs,
        rng=None) -> logits float32[B, T, V]`: the decoder over the copied source, with
        dropout when given a key)."""
        module, variables = self.module, {"params": params}
        encoded = module.apply(
            variables,
            inputs,
            source_valid,
            deterministic=False,
            rngs={"dropout": encoder_rng},
            method=NATransformer.encode,
        )
        copied = module.apply(
            variables,
            inputs,
            source_valid,
            decoder_valid.sum(-1),
            decoder_valid.shape[1],
            method=NATransformer.copied_inputs,
        )

        def decode(encoded, decoder_inputs, rng=None):
            return module.apply(
                variables,
                encoded,
                source_valid,
                decoder_inputs,
                decoder_valid,
                copied=copied,
                mask_id=self.mask_id,
                deterministic=rng is None,
                rngs=None if rng is None else {"dropout": rng},
                method=NATransformer.decode,
            )

        return encoded, decode

    def evaluate(self, params, batch):
        decoder_valid, (logits, _) = self._single_pass(params, batch)
        logits = self.emittable(logits)
        labels = labels_of(batch["targets"])
        fits = ctc_loss.alignable(labels.tokens, labels.valid, decoder_valid)
        nll = ctc_loss.ctc_nll(logits, decoder_valid, labels.tokens, labels.valid, self.blank_id)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        _, wrong, compared = self._aligned(log_probs, decoder_valid, labels, fits)
        output, _ = ctc_collapse.collapse(
            jnp.argmax(log_probs, axis=-1),
            decoder_valid,
            blank_id=self.blank_id,
            pad_id=PAD_ID,
            width=labels.tokens.shape[1],
        )
        # The labels have a PAD column at least (EOS's), so a longer output differs there.
        exact = labels.rows & (output == labels.tokens).all(-1)
        return self._sums(nll, labels, fits) | {
            "seq_correct": exact.sum().astype(jnp.float32),
            "aligned_errors": wrong.sum().astype(jnp.float32),
            "aligned_positions": compared.sum().astype(jnp.float32),
        }

    def predict(self, params, batch, search: NATSearch, rng=None):
        del rng  # deterministic
        if batch.get("prefix") is not None:
            raise ValueError("a non-autoregressive model decodes no forced prefix")
        if (search.iterations, search.length_beam, search.length_scale) != (1, 1, 1.0):
            raise ValueError(
                "the CTC model decodes in one pass with no length to choose: "
                "iterations=1, length_beam=1, length_scale=1"
            )
        return _predict(self, params, batch["inputs"], self._source_valid(batch), search)

    def score(self, params, batch):
        """log P(targets | source) over every alignment, all of it at each row's EOS position
        (CTC has no per-token split); IMPOSSIBLE where the target cannot be aligned."""
        decoder_valid, (logits, _) = self._single_pass(params, batch)
        labels = labels_of(batch["targets"])
        fits = ctc_loss.alignable(labels.tokens, labels.valid, decoder_valid)
        nll = ctc_loss.ctc_nll(
            self.emittable(logits), decoder_valid, labels.tokens, labels.valid, self.blank_id
        )
        sequence = jnp.where(labels.rows, jnp.where(fits, -nll, IMPOSSIBLE), 0.0)
        at_eos = jnp.arange(labels.tokens.shape[1])[None, :] == labels.valid.sum(-1)[:, None]
        token = jnp.where(at_eos & labels.rows[:, None], sequence[:, None], 0.0)
        return token, sequence

    def attention_weights(self, params, batch, layers):
        """The single pass's attention: decoder queries are the T upsampled positions, not
        target tokens ({name: float32[B, N, T, T or S]})."""
        module = self.module_with(capture=tuple(layers))
        _, (_, state) = self._single_pass(params, batch, module=module, mutable=["intermediates"])
        return captured_attention(state["intermediates"], tuple(layers), self.config)

    def forced_argmax(self, params, batch):
        raise ValueError(
            "the CTC model has no prediction per target position given the gold prefix: its "
            "positions are upsampled source positions (no exposure-bias report)"
        )


@functools.partial(jax.jit, static_argnames=("model", "search"))
def _predict(model: CTCModel, params, inputs, source_valid, search: NATSearch):
    """(tokens int32[B, 1, max_len] ending in EOS, best-path log-probabilities float32[B, 1])."""
    batch = {"inputs": inputs, "inputs_valid": source_valid}
    decoder_valid, (logits, _) = model._single_pass(params, batch)
    tokens, lengths, score = ctc_collapse.best_path(
        model.emittable(logits),
        decoder_valid,
        blank_id=model.blank_id,
        pad_id=PAD_ID,
        width=search.max_len - 1,  # room for EOS
    )
    tokens = jnp.pad(tokens, ((0, 0), (0, 1)), constant_values=PAD_ID)
    tokens = tokens.at[jnp.arange(tokens.shape[0]), lengths].set(model.eos_id)
    return tokens[:, None, :], score[:, None]
