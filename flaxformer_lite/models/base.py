"""The model protocol: the one seam between models and everything that uses them.

Training, evaluation, `decode.py`, `bench.py` and `--dry_run` talk to a model
only through `Seq2SeqModel`; none of them calls a flax module's methods or
builds decoder inputs. A new model kind (a non-autoregressive decoder, a copy
head) is a new implementation of this class. In the spirit of T5X's
`BaseModel`, without gin.

Batches are dicts of arrays (B batch, S source length, T target length):

  "inputs"          int32[B, S] source token ids, PAD_ID-padded (token encoders)
  "targets"         int32[B, T] target ids ending in EOS, PAD_ID-padded
  "inputs_segments", "inputs_positions"    int32[B, S]  packed rows only
  "targets_segments", "targets_positions"  int32[B, T]  packed rows only
  "prefix"          int32[B, P] forced first target tokens (`predict` only, optional)

With a copy head, ids >= V in "inputs" and "targets" are per-example extended
ids of source pieces the vocabulary cannot spell (`data/extended_ids.py`), and
`predict` may return them.

Implementations are frozen dataclasses: hashable, so they are static
arguments of `jax.jit`, and cheap to rebuild with `dataclasses.replace`.
"""

from __future__ import annotations

import abc
from typing import Any

import jax

Params = Any  # a pytree of arrays
Batch = dict[str, jax.Array]


class Seq2SeqModel(abc.ABC):
    """What a sequence-to-sequence model offers the trainer, the decoders and the tools."""

    @abc.abstractmethod
    def init(self, rng: jax.Array, batch_shapes: dict[str, tuple[int, ...]]) -> Params:
        """Parameters for batches of these shapes ({"inputs": (B, S), "targets": (B, T)}).

        Returns flax's boxed parameters (logical axis names on every leaf), so
        `jax.eval_shape(model.init, ...)` gives shapes and shardings without
        allocating.
        """

    @abc.abstractmethod
    def loss(
        self, params: Params, batch: Batch, rng: jax.Array, step: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Training loss of one (micro-)batch, with dropout.

        Args:
          rng: dropout key of this step (and micro-batch).
          step: int32 scalar, the global step (schedules such as scheduled
            sampling read it). The loss may run more than one forward pass.
        Returns:
          (summed loss, float32 metric sums with at least "loss" and "tokens");
          the trainer divides the gradient by the "tokens" sum.
        """

    @abc.abstractmethod
    def evaluate(self, params: Params, batch: Batch) -> dict[str, jax.Array]:
        """Deterministic metric sums of one batch (padding rows count for nothing)."""

    @abc.abstractmethod
    def predict(
        self, params: Params, batch: Batch, search: Any, rng: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Free-running output: (tokens int32[B, n, L], scores float32[B, n]), best first.

        `search` is the implementation's hashable search config; tokens end in
        EOS and are PAD_ID after it. A "prefix" in the batch is forced first
        and not returned.
        """

    @abc.abstractmethod
    def score(self, params: Params, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """Forced decoding of the given targets.

        Returns:
          (token log-probabilities float32[B, T], 0 at padding; sequence
          log-probabilities float32[B], their sum over the real tokens, EOS
          included).
        """

    @abc.abstractmethod
    def attention_weights(
        self, params: Params, batch: Batch, layers: tuple[str, ...]
    ) -> dict[str, jax.Array]:
        """Teacher-forced attention probabilities of the chosen layers.

        Args:
          layers: names such as "encoder/self/0", "decoder/self/-1",
            "decoder/cross/2" (negative layer indices count from the end).
        Returns:
          {name: float32[B, N, T_q, T_k]}, each row summing to 1 where a query
          has any key to attend to.
        """

    @abc.abstractmethod
    def forced_argmax(self, params: Params, batch: Batch) -> jax.Array:
        """The most likely token at every target position given the gold prefix.

        The teacher-forced counterpart of greedy decoding: position t is the
        argmax of p(. | source, targets[:t]). Exposure-bias reports compare it
        with free-running output (`evaluation/exposure_bias.py`).

        Returns:
          int32[B, T], PAD_ID where the targets are PAD_ID.
        """
