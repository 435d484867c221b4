"""The arrays of the exposure-bias report, from any model through the model protocol.

Per batch: one `forced_argmax` pass, one `score` pass of the gold targets and
one `score` pass per prefix length k of the sequences greedy[:k] + gold[k:],
all in one jitted function (compiled once per batch shape), plus a greedy
decode unless the caller already decoded greedily. The figures themselves are
`exposure_bias.py`'s, computed on the host once the set is done.

Under multi-process evaluation every process feeds its rows of the same
global batch; the per-example arrays are all-gathered (as the evaluation does
with its hypotheses), so every process computes the same report.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.evaluation import exposure_bias
from flaxformer_lite.models import predict
from flaxformer_lite.models.base import Batch, Params, Seq2SeqModel


def _fit(tokens: jax.Array, width: int) -> jax.Array:
    """int[B, L] -> int[B, width]: cut, or PAD_ID-padded on the right."""
    if tokens.shape[1] >= width:
        return tokens[:, :width]
    return jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=PAD_ID)


@functools.partial(jax.jit, static_argnames=("model", "ks"))
def probe_batch(
    model: Seq2SeqModel, params: Params, batch: Batch, greedy: jax.Array, ks: tuple[int, ...]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Teacher-forced argmax and the prefix-swap NLLs of one batch.

    Args:
      batch: "inputs" and "targets" int32[B, T] (and what else the model reads).
      greedy: int32[B, L] greedy output of the same rows (only greedy[:, :max(ks)] is read).
    Returns:
      (forced int32[B, T], gold_nll float32[B, K], own_nll float32[B, K]):
      `model.forced_argmax`, and for each k the summed NLL of targets[k:] after
      targets[:k] and after greedy[:k]. Rows the report does not count (see
      `exposure_bias.prefix_swap`) hold meaningless NLLs.
    """
    targets = batch["targets"]  # [B, T]
    positions = jnp.arange(targets.shape[1])  # [T]
    forced = model.forced_argmax(params, batch)
    gold_logp, _ = model.score(params, batch)  # [B, T]
    own_prefix = _fit(greedy.astype(targets.dtype), targets.shape[1])  # [B, T]
    gold_nll, own_nll = [], []
    for k in ks:
        suffix = positions >= k  # [T]
        gold_nll.append(-jnp.where(suffix, gold_logp, 0.0).sum(axis=-1))
        swapped = jnp.where(suffix, targets, own_prefix)  # greedy[:k] + targets[k:]
        own_logp, _ = model.score(params, {**batch, "targets": swapped})
        own_nll.append(-jnp.where(suffix, own_logp, 0.0).sum(axis=-1))
    return forced, jnp.stack(gold_nll, axis=1), jnp.stack(own_nll, axis=1)


@functools.partial(jax.jit, static_argnames=("model", "search"))
def greedy_batch(model: Seq2SeqModel, params: Params, batch: Batch, search) -> jax.Array:
    """int32[B, L]: the model's greedy output (`search` is its greedy search config)."""
    return model.predict(params, batch, search)[0][:, 0]


class ProbeArrays(NamedTuple):
    """The report's per-example arrays on the host (`exposure_bias` names them)."""

    gold: np.ndarray  # int32[N, T]
    forced: np.ndarray  # int32[N, T]
    greedy: np.ndarray  # int32[N, L]
    gold_nll: np.ndarray  # float32[N, K]
    own_nll: np.ndarray  # float32[N, K]
    canonical: np.ndarray  # int32[N, L] greedy output re-tokenized (= greedy without a vocabulary)

    def rows(self, keep: np.ndarray) -> ProbeArrays:
        """The rows where bool[N] `keep` is True (the real rows of a padded batch)."""
        return ProbeArrays(*(a[keep] for a in self))


def concatenate(parts: list[ProbeArrays]) -> ProbeArrays:
    """The parts' rows in order, token arrays PAD_ID-padded to the widest part."""

    def tokens(arrays):
        width = max(a.shape[1] for a in arrays)
        return np.concatenate([exposure_bias.pad_to(a, width) for a in arrays])

    return ProbeArrays(
        gold=tokens([p.gold for p in parts]),
        forced=tokens([p.forced for p in parts]),
        greedy=tokens([p.greedy for p in parts]),
        gold_nll=np.concatenate([p.gold_nll for p in parts]),
        own_nll=np.concatenate([p.own_nll for p in parts]),
        canonical=tokens([p.canonical for p in parts]),
    )


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the report needs from a model: its greedy search and the prefix lengths.

    Hashable and cheap to rebuild: the jitted functions above are compiled
    once per (model, search, batch shape), whichever Probe calls them.
    """

    model: Seq2SeqModel
    search: predict.SearchConfig  # greedy
    reuse_decoded: bool = False  # the caller's decoded tokens are this greedy output
    ks: tuple[int, ...] = exposure_bias.KS
    # Greedy output int[N, L] -> the same texts tokenized as references are, int[N, L].
    retokenize: Callable[[np.ndarray], np.ndarray] | None = None

    @classmethod
    def for_search(
        cls, model: Seq2SeqModel, search: predict.SearchConfig, target_vocab=None
    ) -> Probe:
        """The probe of an evaluation that decodes with `search`.

        The report always decodes greedily, up to the same length; when `search`
        is that greedy search, its tokens are reused instead of decoding twice.
        With `target_vocab` (a `data.tokenizer.Tokenizer`), greedy output is
        compared with the gold tokens as text: decoded and encoded again, since a
        model may write the reference's text in other pieces than the encoder's
        (`retokenized`). The prefix swap scores the model's own pieces.
        """
        greedy = predict.SearchConfig("greedy", search.max_len)
        same = search.method == "greedy" and search.min_len == 0  # cached or not: same tokens
        retokenize = None if target_vocab is None else functools.partial(retokenized, target_vocab)
        return cls(model, greedy, reuse_decoded=same, retokenize=retokenize)

    def arrays(self, params: Params, batch: Batch, decoded: jax.Array | None = None):
        """`ProbeArrays` of every row of one (global) batch, on every process.

        Args:
          batch: the device batch ("inputs", "targets" int32[B, T], ...).
          decoded: int32[B, L] tokens the caller decoded with the search given to
            `for_search`, reused when `reuse_decoded`; otherwise greedy decoding runs.
        """
        if self.reuse_decoded and decoded is not None:
            greedy = decoded
        else:
            greedy = greedy_batch(self.model, params, batch, self.search)
        forced, gold_nll, own_nll = probe_batch(self.model, params, batch, greedy, self.ks)
        outputs = (batch["targets"], forced, greedy, gold_nll, own_nll)
        # A plain host copy with one process, an all-gather across processes.
        gathered = list(map(np.asarray, multihost_utils.process_allgather(outputs, tiled=True)))
        canonical = gathered[2] if self.retokenize is None else self.retokenize(gathered[2])
        return ProbeArrays(*gathered, canonical)

    def report(self, parts: list[ProbeArrays], min_width: int = 0) -> exposure_bias.Report:
        """The report of the rows of `parts`; gold arrays padded to at least `min_width`.

        `min_width` fixes the length of the first-error histogram (e.g. the
        run's target length) when the parts are narrower.
        """
        if not parts:
            width = max(min_width, 1)
            empty = np.zeros((0, width), np.int32)
            nll = np.zeros((0, len(self.ks)))
            parts = [ProbeArrays(empty, empty, empty, nll, nll, empty)]
        a = concatenate(parts)
        gold = exposure_bias.pad_to(a.gold, min_width)
        forced = exposure_bias.pad_to(a.forced, min_width)
        return exposure_bias.compute_report(
            gold, forced, a.canonical, a.gold_nll, a.own_nll, self.ks, own=a.greedy
        )


def retokenized(vocab, tokens: np.ndarray) -> np.ndarray:
    """int[N, L] output ids -> int[N, L]: their texts encoded again (ids, EOS, PAD_ID), as the
    references are; a text that no longer fits is cut to L ids ending in EOS."""
    return vocab.encode_batch(vocab.decode_batch(tokens), tokens.shape[1])[0]
