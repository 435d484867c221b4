"""Lexically constrained beam search: Dynamic Beam Allocation (Post & Vilar 2018), model-free.

Every returned hypothesis contains each of its example's constraint phrases (target
token sequences) as a contiguous run of generated tokens. The search is
`search/beam.py`'s (same `TokensToLogits` protocol, cache of batch * beam rows reordered
by parent beam, GNMT-normalised scores, finished set, early exit) with three changes,
after Post & Vilar §3:

* Candidates (§3.1): besides the top 2K of the K*V continuations, every live beam
  extended by its single best token and by the next token of each phrase it has not
  met, so that a phrase the model finds unlikely can still be started and continued.
* Banks (§3.2): a candidate's bank is the number of constraint tokens it has met (the
  lengths of its met phrases plus its progress inside an unmet one). The K live beams
  are shared among the banks (K // banks each, the remainder to the top bank, unused
  room passed down, as in Sockeye's `get_bank_sizes`), each bank keeping its best.
* EOS is forbidden until a beam has met every phrase; only candidates of the top bank
  (all met) finish. A batch row whose phrases are all empty therefore has one bank and
  is searched exactly as `beam.beam_search` searches it.

Phrase progress is exact matching on the beam's last P tokens, not Sockeye's counter:
after a mismatch a beam keeps the longest prefix of the phrase that ends its output
(usually nothing: the phrase is abandoned and restarts), so a phrase is met whenever
its tokens appear contiguously, and phrases may overlap. Constraints are matched in
the generated tokens only (a forced prefix does not count).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_lite.search import beam
from flaxformer_lite.search.beam import length_penalty
from flaxformer_lite.search.primitives import NEG_INF, TokensToLogits, rows_top_k

# Candidates that are not candidates (duplicates, phrases already met) score this: below
# every real one, live beams' dead rows (NEG_INF) included.
_NONE = 4 * NEG_INF
_NO_TOKEN = -1  # tail entries before the first generated token; never a phrase token


class Constraints(NamedTuple):
    """C phrases of at most P target ids per example, padded."""

    tokens: jax.Array  # int32[B, C, P] phrase c of example b: tokens[b, c, :lengths[b, c]]
    lengths: jax.Array  # int32[B, C] tokens of each phrase; 0: no phrase in that slot


class ConstrainedState(NamedTuple):
    """`beam.BeamState` plus what each live beam has met. K = beam size, L = max_len."""

    live_seqs: jax.Array  # int32[B, K, L] generated tokens of the live beams
    live_logp: jax.Array  # float32[B, K] summed log-probabilities (NEG_INF: dead row)
    last: jax.Array  # int32[B, K] token to feed next
    cache: Any  # the adapter's cache, leading axis B*K
    tail: jax.Array  # int32[B, K, P] each beam's last P generated tokens (_NO_TOKEN before)
    met: jax.Array  # bool[B, K, C] phrases the beam contains (empty slots count as met)
    progress: jax.Array  # int32[B, K, C] tokens of each unmet phrase ending the beam
    fin_seqs: jax.Array  # int32[B, K, L] finished hypotheses
    fin_scores: jax.Array  # float32[B, K] length-normalised scores (NEG_INF: empty slot)
    done: jax.Array  # bool[B] no live beam can beat the worst kept finished one


def constrained_beam_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    constraints: Constraints,
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
    """Beam search whose hypotheses all contain their example's phrases (module docstring).

    Args:
      cache: as `beam.beam_search`: batch_size * beam_size rows, batch-major.
      constraints: phrases per example (no PAD_ID, EOS or BOS among their tokens).
      alpha, min_len, first_tokens: as `beam.beam_search`.
    Returns:
      (sequences int32[batch, beam, max_len], scores float32[batch, beam]), best first.
      A slot no hypothesis filled (no beam met every phrase within max_len tokens) has
      score NEG_INF and tokens PAD_ID.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if first_tokens is None:
        first_tokens = jnp.full((batch_size,), bos_id, jnp.int32)
    init = _initial_state(cache, first_tokens, constraints, beam_size, max_len)
    advance = functools.partial(
        _step,
        tokens_to_logits,
        constraints,
        beam_size=beam_size,
        max_len=max_len,
        eos_id=eos_id,
        alpha=alpha,
        min_len=min_len,
    )
    final = beam._scan_until_done(advance, init, max_len)
    seqs = jnp.where(final.fin_scores[..., None] > NEG_INF / 2, final.fin_seqs, 0)
    return beam._pad_after_eos(seqs, eos_id), final.fin_scores


def _initial_state(
    cache: Any, first_tokens: jax.Array, constraints: Constraints, k: int, length: int
) -> ConstrainedState:
    """Before the first step: beam 0 alone is live (as in `beam._initial_beams`)."""
    b = first_tokens.shape[0]
    _, c, p = constraints.tokens.shape
    return ConstrainedState(
        live_seqs=jnp.zeros((b, k, length), jnp.int32),
        live_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
        last=jnp.tile(first_tokens.astype(jnp.int32)[:, None], (1, k)),
        cache=cache,
        tail=jnp.full((b, k, p), _NO_TOKEN, jnp.int32),
        met=jnp.broadcast_to(constraints.lengths[:, None, :] == 0, (b, k, c)),
        progress=jnp.zeros((b, k, c), jnp.int32),
        fin_seqs=jnp.zeros((b, k, length), jnp.int32),
        fin_scores=jnp.full((b, k), NEG_INF, jnp.float32),
        done=jnp.zeros((b,), jnp.bool_),
    )


def _candidates(
    logp: jax.Array, state: ConstrainedState, constraints: Constraints, i: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step's N = 2K + K + K*C candidates: beam search's top 2K (in its order), each
    beam's best token, each beam's next token of every unmet phrase; repeats score _NONE.

    Args:
      logp: float32[B, K, V] next-token log-probabilities (EOS already masked).
    Returns:
      (parent int32[B, N], token int32[B, N], score float32[B, N] summed log-probs).
    """
    b, k, v = logp.shape
    c, p = constraints.tokens.shape[1:]
    top_logp, top_parent, top_token, _ = beam._top_candidates(logp, state, i)  # [B, 2K]
    best_token = jnp.argmax(logp, axis=-1).astype(jnp.int32)  # [B, K]
    best_logp = state.live_logp + jnp.max(logp, axis=-1)
    phrases = jnp.broadcast_to(constraints.tokens[:, None], (b, k, c, p))
    at = jnp.minimum(state.progress, p - 1)[..., None]  # [B, K, C, 1]
    next_token = jnp.take_along_axis(phrases, at, axis=-1)[..., 0]  # [B, K, C]
    next_logp = state.live_logp[..., None] + jnp.take_along_axis(logp, next_token, axis=-1)
    next_logp = jnp.where(state.met, _NONE, next_logp)
    beams = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    parent = jnp.concatenate(
        [top_parent.astype(jnp.int32), beams, jnp.repeat(beams, c, axis=1)], axis=1
    )
    token = jnp.concatenate([top_token, best_token, next_token.reshape(b, k * c)], axis=1)
    score = jnp.concatenate([top_logp, best_logp, next_logp.reshape(b, k * c)], axis=1)
    # A (parent, token) pair met before in this order is a repeat (same score): drop it.
    key = parent * v + token  # [B, N]
    n = key.shape[1]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [n, m]: m comes before n
    repeat = jnp.any((key[:, :, None] == key[:, None, :]) & earlier, axis=-1)
    return parent, token, jnp.where(repeat, _NONE, score)


def _advance_phrases(
    state: ConstrainedState, constraints: Constraints, parent: jax.Array, token: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each candidate's phrase state once `token` follows its parent beam.

    Phrase c ends with its first m tokens when the last m tokens of the output equal
    them; it is met when m is its length, and its progress is the largest shorter m.
    Returns:
      (tail int32[B, N, P], met bool[B, N, C], progress int32[B, N, C],
      bank int32[B, N]: the lengths of met phrases plus the largest unmet progress).
    """
    p = constraints.tokens.shape[-1]
    tail = beam._gather_beams(state.tail, parent)[..., 1:]
    tail = jnp.concatenate([tail, token[..., None]], axis=-1)  # [B, N, P]
    m = jnp.arange(1, p + 1)  # prefix lengths
    j = jnp.arange(p)  # positions inside a prefix
    window = jnp.clip(p - m[:, None] + j[None, :], 0, p - 1)  # [m, j]: tail index of j
    ends = tail[:, :, window]  # [B, N, P(m), P(j)]: the last m tokens, left-aligned
    same = ends[:, :, None] == constraints.tokens[:, None, :, None, :]  # [B, N, C, m, j]
    prefix_ends = jnp.all(same | (j[None, :] >= m[:, None]), axis=-1)  # [B, N, C, m]
    length = constraints.lengths[:, None, :, None]  # [B, 1, C, 1]
    met = beam._gather_beams(state.met, parent) | jnp.any(prefix_ends & (m == length), -1)
    partial = jnp.where(prefix_ends & (m < length), m, 0)
    progress = jnp.where(met, 0, jnp.max(partial, axis=-1))  # [B, N, C]
    bank = jnp.sum(jnp.where(met, constraints.lengths[:, None, :], 0), axis=-1)
    return tail, met, progress, bank + jnp.max(progress, axis=-1)


def _rank_in_bank(score: jax.Array, bank: jax.Array, member: jax.Array) -> jax.Array:
    """rank[b, n]: the members of candidate n's bank that come before it, best score first
    and, at equal scores, in candidate order (as `lax.top_k` orders ties). [B, N] each."""
    n = score.shape[-1]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [n, m]: m before n
    s_n, s_m = score[:, :, None], score[:, None, :]
    before = (s_m > s_n) | ((s_m == s_n) & earlier)
    same_bank = bank[:, :, None] == bank[:, None, :]
    return jnp.sum(before & same_bank & member[:, None, :], axis=-1)


def _bank_sizes(counts: jax.Array, top: jax.Array, k: int) -> jax.Array:
    """Live beams per bank, Sockeye's `get_bank_sizes` (Post & Vilar §3.2).

    Banks 0..top[b] get k // (top + 1) beams each and the top bank the remainder; then,
    from the top bank down, room a bank has no candidates for passes to the bank below
    (bank 0's to the top bank).
    Args:
      counts: int32[B, NB] live candidates per bank; top: int32[B] each row's top bank.
    Returns:
      int32[B, NB], summing to k per row.
    """
    nb = counts.shape[-1]
    banks = top + 1  # [B]
    index = jnp.arange(nb)
    base = k // banks
    sizes = jnp.where(index < banks[:, None], base[:, None], 0)
    sizes = sizes + jnp.where(index == top[:, None], (k - base * banks)[:, None], 0)

    def pass_down(j, sizes):
        bank = nb - 1 - j
        spare = jnp.maximum(sizes[:, bank] - counts[:, bank], 0) * (bank < banks)  # [B]
        below = jnp.where(bank == 0, top, bank - 1)
        moved = jnp.where(index == below[:, None], spare[:, None], 0)
        return sizes.at[:, bank].add(-spare) + moved

    return jax.lax.fori_loop(0, nb, pass_down, sizes)


def _step(
    tokens_to_logits: TokensToLogits,
    constraints: Constraints,
    state: ConstrainedState,
    i: jax.Array,
    *,
    beam_size: int,
    max_len: int,
    eos_id: int,
    alpha: float,
    min_len: int,
) -> ConstrainedState:
    """One step: extend, finish the top bank's EOS candidates, allocate the live beams."""
    logp, cache = beam.next_log_probs(tokens_to_logits, state.last, state.cache)
    b, k, v = logp.shape
    may_end = (i >= min_len) & jnp.all(state.met, axis=-1)  # [B, K]
    logp = jnp.where(~may_end[..., None] & (jnp.arange(v) == eos_id), NEG_INF, logp)
    parent, token, score = _candidates(logp, state, constraints, i)
    tail, met, progress, bank = _advance_phrases(state, constraints, parent, token)
    valid = score > NEG_INF / 2
    is_eos = token == eos_id
    top = jnp.sum(constraints.lengths, axis=-1)  # [B]: the all-met bank
    last_step = i == max_len - 1

    # Finished: EOS candidates (at the last step, any) ranked within the top bank's best K,
    # as beam search finishes EOS candidates ranked within its best K.
    in_top = valid & (bank == top[:, None])
    ends = (is_eos | last_step) & in_top & (_rank_in_bank(score, bank, in_top) < k)
    seqs = beam._gather_beams(state.live_seqs, parent)  # [B, N, L]
    seqs = jax.lax.dynamic_update_slice_in_dim(seqs, token[:, :, None], i, axis=2)
    fin_seqs, fin_scores = beam._merge_finished(state, seqs, score, ends, i + 1, alpha)

    nb = constraints.tokens.shape[1] * constraints.tokens.shape[2] + 1
    pick, live_logp = _allocate(score, bank, valid & ~is_eos, top, k, nb)
    live = (
        beam._gather_beams(seqs, pick),
        live_logp,
        beam._gather_beams(token, pick),
        beam._gather_cache(cache, beam._gather_beams(parent, pick), b, k),
        *(beam._gather_beams(x, pick) for x in (tail, met, progress)),
    )
    # Done as in beam search: the best live beam at its most favourable length cannot beat
    # the worst finished hypothesis kept (log-probs only fall).
    best_live = jnp.max(live_logp, axis=-1) / length_penalty(jnp.asarray(max_len), alpha)
    done = state.done | (fin_scores[:, -1] >= best_live) | last_step
    fin_seqs = jnp.where(state.done[:, None, None], state.fin_seqs, fin_seqs)
    fin_scores = jnp.where(state.done[:, None], state.fin_scores, fin_scores)
    return ConstrainedState(*live, fin_seqs, fin_scores, done)


def _allocate(
    score: jax.Array, bank: jax.Array, member: jax.Array, top: jax.Array, k: int, nb: int
) -> tuple[jax.Array, jax.Array]:
    """The K live beams among the candidates that may continue (`member`, bool[B, N]).

    Each bank keeps its best `_bank_sizes` candidates (nb: banks of the widest row);
    room still unused goes to the best of the rest.
    Returns (pick int32[B, K] candidate indices, live_logp float32[B, K]): the chosen
    beams best first, then the others; NEG_INF for a row no candidate filled.
    """
    counts = jnp.sum(member[..., None] & (bank[..., None] == jnp.arange(nb)), axis=1)  # [B, NB]
    sizes = jnp.take_along_axis(_bank_sizes(counts, top, k), bank, axis=1)  # [B, N]
    chosen = member & (_rank_in_bank(score, bank, member) < sizes)
    # Chosen first by score, then the other members by score, then the rest.
    priority = jnp.where(chosen, score, jnp.where(member, score + 2 * NEG_INF, 2 * _NONE))
    _, pick = rows_top_k(priority, k)
    live_logp = jnp.where(
        beam._gather_beams(member, pick), beam._gather_beams(score, pick), NEG_INF
    )
    return pick, live_logp
