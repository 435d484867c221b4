"""Beam search with a GNMT length penalty, model-free.

It takes a `TokensToLogits` step (`search/primitives.py`) and a cache of
batch * beam rows, and reorders the leading axis of the cache's array leaves by
parent beam at each step (scalar leaves, such as a step index, are left alone).
It runs on the device as a `lax.scan` over chunks of at most `max_len` steps
that skips the chunks left once every example is done: it compiles once per
shape and runs without Python work per token. Sequences returned hold the
generated tokens only (no BOS), EOS included, and PAD_ID after EOS.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.search.primitives import NEG_INF, TokensToLogits, rows_top_k

SKIP_CHUNK = 8  # beam search checks for early exit every this many steps (or a divisor)


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016); 1 when alpha = 0."""
    return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


class BeamState(NamedTuple):
    """The beam search carry. K = beam size, L = max_len."""

    live_seqs: jax.Array  # int32[B, K, L] generated tokens of the live beams
    live_logp: jax.Array  # float32[B, K] summed log-probabilities
    last: jax.Array  # int32[B, K] token to feed next (BOS at first)
    cache: Any  # the adapter's cache, leading axis B*K (flattened batch-major)
    fin_seqs: jax.Array  # int32[B, K, L] finished hypotheses
    fin_scores: jax.Array  # float32[B, K] length-normalised scores (NEG_INF: empty slot)
    done: jax.Array  # bool[B] no live beam can beat the worst kept finished one


def _gather_beams(x: jax.Array, beam_idx: jax.Array) -> jax.Array:
    """x [B, K', ...] -> [B, K, ...] picking beam_idx int[B, K] along axis 1."""
    return jnp.take_along_axis(x, beam_idx.reshape(*beam_idx.shape, *([1] * (x.ndim - 2))), axis=1)


def _gather_cache(cache: Any, beam_idx: jax.Array, batch: int, beams: int) -> Any:
    """Reorders the [B*K, ...] leaves of a cache by parent beam; scalars stay.

    Each leaf is seen as [B, K, ...] and gathered along the beam axis only, so
    every example's beams stay where they are: with the batch split over devices
    each device reorders its own rows. (A gather on the flat B*K axis reads rows
    of any example, and SPMD partitioning then all-gathers the whole cache at
    every step.) Each picked row is one beam's contiguous cache: a block copy.
    """

    def reorder(leaf: jax.Array) -> jax.Array:
        if leaf.ndim == 0:
            return leaf
        beamed = leaf.reshape(batch, beams, *leaf.shape[1:])  # [B, K, ...]
        # mode="clip": the indices are in bounds by construction, and the default
        # fill mode's per-element bounds check costs half again as much as the copy.
        picked = jnp.take_along_axis(
            beamed,
            beam_idx.reshape(batch, beams, *([1] * (leaf.ndim - 1))),
            axis=1,
            mode="clip",
        )
        return picked.reshape(leaf.shape)

    return jax.tree.map(reorder, cache)


def beam_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    alpha: float = 0.6,
    min_len: int = 0,
    first_tokens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Beam search as one `lax.scan` of `max_len` steps.

    The cache given must already hold batch_size * beam_size rows (batch-major:
    row b * K + k is beam k of example b); the adapter expands the encoder side
    to beams once. Each step scores all K*V continuations, keeps the top 2K so
    that K beams stay alive when some of them end in EOS, moves the EOS ones
    ranked within the top K to the finished set with score
    logp / ((5 + len) / 6) ** alpha (len counts the generated tokens, EOS
    included), continues the best K that did not end, and reorders the cache
    by parent beam. At the last step the top K candidates are finished as they
    stand. With beam_size 1 and alpha 0 this is exactly greedy search. Once every
    example is done (no live beam can beat its worst kept finished hypothesis)
    the remaining steps are skipped with `lax.cond` (checked every few steps).

    Args:
      alpha: length-penalty exponent (0 = none).
      min_len: EOS is forbidden until this many tokens were generated.
      first_tokens: int32[batch] fed at the first step (default: BOS).
    Returns:
      (sequences int32[batch, beam, max_len], scores float32[batch, beam]),
      sorted best first along the beam axis: n-best lists.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if first_tokens is None:
        first_tokens = jnp.full((batch_size,), bos_id, jnp.int32)
    init = _initial_beams(cache, first_tokens, beam_size, max_len)
    advance = functools.partial(
        _beam_step,
        tokens_to_logits,
        beam_size=beam_size,
        max_len=max_len,
        eos_id=eos_id,
        alpha=alpha,
        min_len=min_len,
    )
    final = _scan_until_done(advance, init, max_len)
    return _pad_after_eos(final.fin_seqs, eos_id), final.fin_scores


def _initial_beams(cache: Any, first_tokens: jax.Array, k: int, length: int) -> BeamState:
    """The state before the first step; only beam 0 is live, as identical beams would fill
    the top K with duplicates."""
    b = first_tokens.shape[0]
    return BeamState(
        live_seqs=jnp.zeros((b, k, length), jnp.int32),
        live_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
        last=jnp.tile(first_tokens.astype(jnp.int32)[:, None], (1, k)),
        cache=cache,
        fin_seqs=jnp.zeros((b, k, length), jnp.int32),
        fin_scores=jnp.full((b, k), NEG_INF, jnp.float32),
        done=jnp.zeros((b,), jnp.bool_),
    )


def _top_candidates(
    logp: jax.Array, state: BeamState, i: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The best 2K of all K*V continuations of the live beams, sorted best first.

    Args:
      logp: float32[B, K, V] next-token log-probabilities of each live beam.
    Returns:
      (cand_logp float32[B, 2K], parent int[B, 2K], token int32[B, 2K],
      seqs int32[B, 2K, L]: the parent's tokens with `token` written at step i).
    """
    b, k, v = logp.shape
    # Two stages: the global top 2K lies in the union of each beam's own top 2K, so a
    # [B, K, V] -> [B, K, 2K] pass and a [B, 2K^2] -> [B, 2K] pass replace one top-k over
    # K*V per row.
    beam_best, beam_tok = rows_top_k(logp, min(2 * k, v))  # [B, K, 2K]
    cand = (state.live_logp[:, :, None] + beam_best).reshape(b, -1)  # [B, K*2K]
    cand_logp, flat = rows_top_k(cand, 2 * k)  # [B, 2K], sorted best first
    parent = flat // beam_best.shape[-1]  # [B, 2K]
    token = jnp.take_along_axis(beam_tok.reshape(b, -1), flat, axis=1).astype(jnp.int32)
    seqs = _gather_beams(state.live_seqs, parent)  # [B, 2K, L]
    seqs = jax.lax.dynamic_update_slice_in_dim(seqs, token[:, :, None], i, axis=2)
    return cand_logp, parent, token, seqs


def _merge_finished(
    state: BeamState,
    seqs: jax.Array,
    cand_logp: jax.Array,
    ends: jax.Array,
    score_len: jax.Array,
    alpha: float,
) -> tuple[jax.Array, jax.Array]:
    """The best K of the kept finished hypotheses and the candidates that `ends` [B, 2K]."""
    k = state.fin_scores.shape[1]
    new_scores = jnp.where(ends, cand_logp / length_penalty(score_len, alpha), NEG_INF)
    all_seqs = jnp.concatenate([state.fin_seqs, seqs], axis=1)  # [B, 3K, L]
    all_scores = jnp.concatenate([state.fin_scores, new_scores], axis=1)
    fin_scores, keep = rows_top_k(all_scores, k)  # sorted best first
    return _gather_beams(all_seqs, keep), fin_scores


def next_log_probs(tokens_to_logits: TokensToLogits, last: jax.Array, cache: Any):
    """Each beam's next-token log-probabilities float32[B, K, V] after feeding `last`
    int32[B, K] (the cache's rows batch-major, b * K + k), and the new cache."""
    b, k = last.shape
    logits, cache = tokens_to_logits(last.reshape(b * k, 1), cache)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B*K, V]
    return logp.reshape(b, k, -1), cache


def _beam_step(
    tokens_to_logits: TokensToLogits,
    state: BeamState,
    i: jax.Array,
    *,
    beam_size: int,
    max_len: int,
    eos_id: int,
    alpha: float,
    min_len: int,
) -> BeamState:
    """One step of `beam_search`: extend, finish the EOS candidates, keep the best K live."""
    logp, cache = next_log_probs(tokens_to_logits, state.last, state.cache)  # [B, K, V]
    b, k, v = logp.shape
    logp = jnp.where((i < min_len) & (jnp.arange(v) == eos_id), NEG_INF, logp)
    cand_logp, parent, token, seqs = _top_candidates(logp, state, i)
    is_eos = token == eos_id
    last_step = i == max_len - 1

    # Finished candidates: EOS ones ranked within the top K (as in fairseq: an EOS
    # below rank K would not have been a beam; this makes beam 1 exactly greedy),
    # and at the last step every top-K candidate.
    in_top_k = jnp.arange(2 * k) < k  # candidates come sorted best first
    ends = (is_eos | last_step) & in_top_k & (cand_logp > NEG_INF / 2)
    fin_seqs, fin_scores = _merge_finished(state, seqs, cand_logp, ends, i + 1, alpha)

    # Live beams: the best K candidates that did not end.
    live_cand = jnp.where(is_eos, NEG_INF, cand_logp)
    live_logp, pick = rows_top_k(live_cand, k)  # [B, K]
    live_seqs = _gather_beams(seqs, pick)
    last = _gather_beams(token, pick)
    cache = _gather_cache(cache, _gather_beams(parent, pick), b, k)

    # Done when the best live beam, even at its most favourable length, cannot
    # beat the worst finished hypothesis we keep (log-probs only fall).
    best_live = live_logp[:, 0] / length_penalty(jnp.asarray(max_len), alpha)
    done = state.done | (fin_scores[:, -1] >= best_live) | last_step
    # Examples already done keep their finished set untouched.
    keep_old = state.done
    fin_seqs = jnp.where(keep_old[:, None, None], state.fin_seqs, fin_seqs)
    fin_scores = jnp.where(keep_old[:, None], state.fin_scores, fin_scores)
    return BeamState(live_seqs, live_logp, last, cache, fin_seqs, fin_scores, done)


def _scan_until_done(advance, init: BeamState, max_len: int) -> BeamState:
    """`advance(state, i)` for i in [0, max_len), skipping the rest once every example is done.

    Steps run in chunks: a chunk is skipped when every example is done. The
    check is per chunk, not per step, because a `lax.cond` hands its whole
    operand (the cache) to the branch taken, which costs a copy of it.
    """
    chunk = max(c for c in range(1, SKIP_CHUNK + 1) if max_len % c == 0)

    def run_chunk(state: BeamState, steps: jax.Array) -> BeamState:
        return jax.lax.scan(lambda s, i: (advance(s, i), None), state, steps)[0]

    def outer(state: BeamState, steps: jax.Array):
        return jax.lax.cond(jnp.all(state.done), lambda s, _: s, run_chunk, state, steps), None

    final, _ = jax.lax.scan(outer, init, jnp.arange(max_len).reshape(-1, chunk))
    return final


def _pad_after_eos(seqs: jax.Array, eos_id: int) -> jax.Array:
    """Tokens after EOS are PAD: keeps what search wrote up to and including EOS."""
    after_eos = jnp.cumsum(jnp.cumsum(seqs == eos_id, axis=-1), axis=-1) > 1
    return jnp.where(after_eos, PAD_ID, seqs)
