"""Continuous batching on the device: a fixed set of slots, each decoding one sentence with
its own beams, position and settings, all stepped together by one compiled program.

A slot that finishes is free at once; `admit` encodes newcomers (for them alone) and writes
them into free slots while the others keep their state, so a batch never waits for its
longest sentence and never runs half empty while work is queued.

Shapes: N slots, K beams per slot (K = 1: a greedy pool), S source positions, L tokens a
slot may generate, V vocabulary. Per slot, the search is `search/beam.py`'s (the top 2K of
the K*V continuations, EOS ones ranked within the slot's width finish with a GNMT length
penalty, the best non-ending ones stay live) with the slot's own step index, width (beams
in use, <= K), alpha, min_len and max_len. Width 1 with alpha 0 is greedy search exactly,
with the summed log-probability as its score.

Memory is laid out for the step: the decoder cache has N*K rows, each at its own position
(`cache["index"]` int32[N*K]); cross-attention keys/values have N rows, one per sentence,
shared by its K beams (`nn/attention._beams_over_one_source`), so a beam pool reads them
once per step instead of K times.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.models import layer_layout
from flaxformer_lite.models.transformer import Transformer, init_cache
from flaxformer_lite.search.beam import length_penalty
from flaxformer_lite.search.primitives import NEG_INF, top_k


class Slots(NamedTuple):
    """The device state of a pool of N slots with K beams each."""

    cache: dict  # decoder self-attention K/V, N*K rows; "index" int32[N*K]
    cross_kv: list  # per decoder layer (k [N, heads, H, S], v [N, heads, S, H])
    valid: jax.Array  # bool[N, S] source positions holding input
    step: jax.Array  # int32[N] tokens generated so far
    max_len: jax.Array  # int32[N] tokens the slot may generate (EOS included), <= L
    min_len: jax.Array  # int32[N] EOS forbidden before this many tokens
    width: jax.Array  # int32[N] beams in use, 1..K
    alpha: jax.Array  # float32[N] length-penalty exponent
    live_seqs: jax.Array  # int32[N, K, L] tokens of the live beams
    live_logp: jax.Array  # float32[N, K] their summed log-probabilities
    last: jax.Array  # int32[N, K] token each beam feeds next
    fin_seqs: jax.Array  # int32[N, K, L] finished hypotheses, best first
    fin_scores: jax.Array  # float32[N, K] their length-normalised scores (NEG_INF: none)
    done: jax.Array  # bool[N] finished (or never admitted): the slot is free


class Requests(NamedTuple):
    """M sentences to admit, padded to a bucket of rows and source positions."""

    slot: jax.Array  # int32[M] slot each goes to; N (out of range) for padding rows
    inputs: jax.Array  # int32[M, S'] source ids, PAD_ID-padded, S' <= S
    max_len: jax.Array  # int32[M]
    min_len: jax.Array  # int32[M]
    width: jax.Array  # int32[M]
    alpha: jax.Array  # float32[M]


def plain_decoder(model: Transformer, params: Any) -> tuple[Transformer, Any]:
    """The model and parameters a pool steps: scanned layers are unstacked once here, so
    the step reads each layer's weights as they lie (as `models/predict.cached_step`)."""
    if model.config.scan_layers:
        return model.clone(config=model.config.replace(scan_layers=False)), layer_layout.unstack(
            params
        )
    return model, params


def empty(model: Transformer, slots: int, beams: int, source_len: int, max_len: int) -> Slots:
    """A pool with every slot free."""
    cfg = model.config
    n, k = slots, beams
    cache = init_cache(cfg, n * k, max_len)
    cache["index"] = jnp.zeros((n * k,), jnp.int32)
    heads, head_dim = cfg.num_heads, cfg.head_dim
    dtype = cache["layers"][0]["k"].dtype
    cross = [
        (
            jnp.zeros((n, heads, head_dim, source_len), dtype),
            jnp.zeros((n, heads, source_len, head_dim), dtype),
        )
        for _ in range(cfg.num_decoder_layers)
    ]
    ints = lambda value: jnp.full((n,), value, jnp.int32)  # distinct buffers (donated)
    return Slots(
        cache=cache,
        cross_kv=cross,
        valid=jnp.zeros((n, source_len), jnp.bool_),
        step=ints(0),
        max_len=ints(1),
        min_len=ints(0),
        width=ints(1),
        alpha=jnp.zeros((n,), jnp.float32),
        live_seqs=jnp.zeros((n, k, max_len), jnp.int32),
        live_logp=jnp.full((n, k), NEG_INF, jnp.float32),
        last=jnp.zeros((n, k), jnp.int32),
        fin_seqs=jnp.zeros((n, k, max_len), jnp.int32),
        fin_scores=jnp.full((n, k), NEG_INF, jnp.float32),
        done=jnp.ones((n,), jnp.bool_),
    )


def admit(model: Transformer, params: Any, state: Slots, new: Requests, bos_id: int) -> Slots:
    """Encodes the M newcomers (them alone) and writes them into their slots.

    Padding rows (slot N) are dropped by the scatters. The slots' cache rows only get their
    position reset: what an earlier sentence left beyond it is masked until overwritten.
    """
    n, k = state.live_logp.shape
    s = state.valid.shape[1]
    valid = new.inputs != PAD_ID  # [M, S']
    variables = {"params": params}
    encoded = model.apply(variables, new.inputs, valid, method="encode")
    pairs = model.apply(variables, encoded, method="precompute_cross_kv")
    pad = s - new.inputs.shape[1]
    put = lambda table, rows, x: table.at[rows].set(x.astype(table.dtype), mode="drop")
    cross = [
        (
            put(k_all, new.slot, jnp.pad(k_new, ((0, 0), (0, 0), (0, 0), (0, pad)))),
            put(v_all, new.slot, jnp.pad(v_new, ((0, 0), (0, 0), (0, pad), (0, 0)))),
        )
        for (k_all, v_all), (k_new, v_new) in zip(state.cross_kv, pairs, strict=True)
    ]
    rows = (new.slot[:, None] * k + jnp.arange(k)).reshape(-1)  # [M*K] (>= N*K: dropped)
    cache = {**state.cache, "index": put(state.cache["index"], rows, jnp.zeros_like(rows))}
    m = new.slot.shape[0]
    first_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (m, 1))
    return state._replace(
        cache=cache,
        cross_kv=cross,
        valid=put(state.valid, new.slot, jnp.pad(valid, ((0, 0), (0, pad)))),
        step=put(state.step, new.slot, jnp.zeros_like(new.slot)),
        max_len=put(state.max_len, new.slot, new.max_len),
        min_len=put(state.min_len, new.slot, new.min_len),
        width=put(state.width, new.slot, new.width),
        alpha=put(state.alpha, new.slot, new.alpha),
        live_seqs=put(state.live_seqs, new.slot, jnp.zeros((m, *state.live_seqs.shape[1:]))),
        live_logp=put(state.live_logp, new.slot, first_logp),
        last=put(state.last, new.slot, jnp.full((m, k), bos_id)),
        fin_seqs=put(state.fin_seqs, new.slot, jnp.zeros((m, *state.fin_seqs.shape[1:]))),
        fin_scores=put(state.fin_scores, new.slot, jnp.full((m, k), NEG_INF)),
        done=put(state.done, new.slot, jnp.zeros((m,), jnp.bool_)),
    )


def _rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [N, K', ...] -> [N, K, ...] picking idx int[N, K] along axis 1."""
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)


def _candidates(logp: jax.Array, state: Slots):
    """The best 2K continuations of each slot's live beams (as `beam._top_candidates`), with
    the token written at each slot's own step. Returns (logp [N, 2K], parent [N, 2K],
    token int32[N, 2K], seqs int32[N, 2K, L])."""
    n, k, v = logp.shape
    beam_best, beam_tok = top_k(logp, min(2 * k, v))  # [N, K, 2K]
    cand = (state.live_logp[:, :, None] + beam_best).reshape(n, -1)
    cand_logp, flat = jax.lax.top_k(cand, 2 * k)
    parent = flat // beam_best.shape[-1]
    token = jnp.take_along_axis(beam_tok.reshape(n, -1), flat, axis=1).astype(jnp.int32)
    here = jnp.arange(state.live_seqs.shape[-1]) == state.step[:, None, None]  # [N, 1, L]
    seqs = jnp.where(here, token[:, :, None], _rows(state.live_seqs, parent))
    return cand_logp, parent, token, seqs


def step(model: Transformer, params: Any, state: Slots, eos_id: int) -> Slots:
    """One token for every slot (done slots compute and are left as they were)."""
    n, k = state.live_logp.shape
    tokens = state.last.reshape(n * k, 1)
    logits, cache = model.apply(
        {"params": params}, tokens, state.cache, state.cross_kv, state.valid, method="decode_step"
    )
    logp = jax.nn.log_softmax(logits[:, -1].astype(jnp.float32), axis=-1).reshape(n, k, -1)
    i = state.step  # [N]
    eos_banned = (i < state.min_len)[:, None, None] & (jnp.arange(logp.shape[-1]) == eos_id)
    cand_logp, parent, token, seqs = _candidates(jnp.where(eos_banned, NEG_INF, logp), state)
    is_eos = token == eos_id
    last_step = (i == state.max_len - 1)[:, None]  # [N, 1]
    in_width = jnp.arange(2 * k) < state.width[:, None]  # candidates come best first
    ends = (is_eos | last_step) & in_width & (cand_logp > NEG_INF / 2)
    penalty = length_penalty(i + 1, state.alpha)[:, None]  # alpha per slot
    new_scores = jnp.where(ends, cand_logp / penalty, NEG_INF)
    all_scores = jnp.concatenate([state.fin_scores, new_scores], axis=1)  # [N, 3K]
    fin_scores, keep = jax.lax.top_k(all_scores, k)
    fin_seqs = _rows(jnp.concatenate([state.fin_seqs, seqs], axis=1), keep)
    used = jnp.arange(k) < state.width[:, None]  # [N, K]
    fin_scores = jnp.where(used, fin_scores, NEG_INF)

    live_logp, pick = jax.lax.top_k(jnp.where(is_eos, NEG_INF, cand_logp), k)
    live_logp = jnp.where(used, live_logp, NEG_INF)
    parents = (_rows(parent, pick) + jnp.arange(n)[:, None] * k).reshape(-1)  # [N*K] rows
    cache = jax.tree.map(lambda x: x[parents] if x.ndim > 1 else x, cache)

    # Done once the best live beam, even at its most favourable length, cannot beat the
    # worst finished hypothesis kept (log-probabilities only fall).
    worst_kept = jnp.take_along_axis(fin_scores, state.width[:, None] - 1, axis=1)[:, 0]
    best_live = live_logp[:, 0] / length_penalty(state.max_len, state.alpha)
    was_done = state.done
    done = was_done | (worst_kept >= best_live) | last_step[:, 0]
    keep_old = lambda old, new: jnp.where(was_done.reshape(-1, *([1] * (old.ndim - 1))), old, new)
    rows_done = jnp.repeat(was_done, k)
    cache["index"] = jnp.where(rows_done, state.cache["index"], cache["index"])
    return state._replace(
        cache=cache,
        step=keep_old(state.step, i + 1),
        live_seqs=keep_old(state.live_seqs, _rows(seqs, pick)),
        live_logp=keep_old(state.live_logp, live_logp),
        last=keep_old(state.last, _rows(token, pick)),
        fin_seqs=keep_old(state.fin_seqs, fin_seqs),
        fin_scores=keep_old(state.fin_scores, fin_scores),
        done=done,
    )


class View(NamedTuple):
    """What the host reads after a device call (one transfer)."""

    done: jax.Array  # bool[N]
    tokens: jax.Array  # int32[N, K, L] finished hypotheses, PAD_ID after EOS, best first
    scores: jax.Array  # float32[N, K]
    live: jax.Array  # int32[N, L] the best live beam's tokens (greedy: the output so far)
    step: jax.Array  # int32[N]


def run(model: Transformer, params: Any, state: Slots, steps: int, eos_id: int):
    """`steps` steps of every slot in one device call (a `lax.fori_loop`): (state, View)."""
    state = jax.lax.fori_loop(0, steps, lambda _, s: step(model, params, s, eos_id), state)
    seqs = state.fin_seqs
    after_eos = jnp.cumsum(jnp.cumsum(seqs == eos_id, axis=-1), axis=-1) > 1
    tokens = jnp.where(after_eos, PAD_ID, seqs)
    return state, View(state.done, tokens, state.fin_scores, state.live_seqs[:, 0], state.step)
