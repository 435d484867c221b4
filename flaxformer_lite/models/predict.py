"""Adapters from a `Transformer` and its parameters to the search functions.

`cached_step` is the production path: the source is encoded and projected to
cross-attention keys/values once, a forced decoder prefix is written into
the KV cache in one call, and each step runs the decoder on one new token.
`full_recompute_step` reruns the whole decoder prefix at every step; it
exists as the reference for tests and benchmarks.

`decode` is the jitted entry point behind the autoregressive model's
`predict` (`models/autoregressive.py`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_lite.models import layer_layout
from flaxformer_lite.models.copy_transformer import CopyTransformer
from flaxformer_lite.models.transformer import Transformer, init_cache, token_validity
from flaxformer_lite.search import beam, constrained, sampling


def _apply(model, variables, *args, method: str):
    """`model.apply` of a method; the copy head's modules read sown attention, so they run
    with "intermediates" mutable (and the collection is dropped)."""
    if isinstance(model, CopyTransformer):
        return model.apply(variables, *args, method=method, mutable=["intermediates"])[0]
    return model.apply(variables, *args, method=method)


def _repeat_rows(tree, times: int):
    """Repeats every non-scalar leaf `times` times along axis 0 (row b -> rows b*K..b*K+K-1)."""
    if times == 1:
        return tree
    return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, times, axis=0), tree)


def cached_step(
    model: Transformer,
    params,
    inputs: jax.Array,
    *,
    max_len: int,
    prefix: jax.Array | None = None,
    bos_id: int,
    beams: int = 1,
    source_valid: jax.Array | None = None,
):
    """A KV-cache `tokens_to_logits`, its initial cache and the first tokens to feed.

    Args:
      inputs: int32[B, S] source tokens (or float[B, S, F] features).
      source_valid: bool[B, S] (default: inputs != PAD_ID; needed for features).
      max_len: tokens the search will generate.
      prefix: int32[B, P] forced first target tokens (the same length for all
        rows), or None. [BOS, prefix[:-1]] is written into the cache in one
        call and the search starts by feeding prefix[:, -1].
      beams: rows per example (beam size); the encoder side and the cache
        are expanded to B * beams rows once, here.
    Returns:
      (tokens_to_logits, cache with B*beams rows, first_tokens int32[B]).
    """
    cfg = model.config
    if cfg.scan_layers:
        # Sliced from the stacked leaves inside the search loop, each step would copy every
        # layer's weights (a 6+6-layer model decoded greedily at batch 1 ran 2.3-4x slower);
        # sliced here, once per call, the loop reads them as they lie.
        cfg = cfg.replace(scan_layers=False)
        model, params = model.clone(config=cfg), layer_layout.unstack(params)
    batch = inputs.shape[0]
    variables = {"params": params}
    valid = token_validity(inputs) if source_valid is None else source_valid  # [B, S]
    encoded = _apply(model, variables, inputs, valid, method="encode")  # [B, S, D]
    cross_kv = _apply(model, variables, encoded, method="precompute_cross_kv")
    fill_len = 0 if prefix is None else prefix.shape[1]  # BOS + prefix[:-1]
    cache = init_cache(cfg, batch, fill_len + max_len)
    if prefix is None:
        first = jnp.full((batch,), bos_id, jnp.int32)
    else:
        bos = jnp.full((batch, 1), bos_id, jnp.int32)
        fill = jnp.concatenate([bos, prefix[:, :-1].astype(jnp.int32)], axis=1)  # [B, P]
        _, cache = _apply(model, variables, fill, cache, cross_kv, valid, method="decode_step")
        first = prefix[:, -1].astype(jnp.int32)
    cross_kv, valid_b, cache = _repeat_rows((cross_kv, valid, cache), beams)

    def tokens_to_logits(token_ids, cache):
        logits, cache = _apply(
            model, variables, token_ids, cache, cross_kv, valid_b, method="decode_step"
        )
        return logits[:, -1], cache  # [B*beams, V]

    return tokens_to_logits, cache, first


def full_recompute_step(
    model: Transformer,
    params,
    inputs: jax.Array,
    *,
    max_len: int,
    prefix: jax.Array | None = None,
    bos_id: int,
    beams: int = 1,
    source_valid: jax.Array | None = None,
):
    """A `tokens_to_logits` that reruns the whole decoder prefix at every step (no KV cache).

    The cache is {"tokens": int32[B, P + max_len] decoder inputs so far (PAD
    beyond), "index": int32 scalar}; step i writes the given token at position
    index and returns the logits there. Same arguments and returns as
    `cached_step`.
    """
    batch = inputs.shape[0]
    variables = {"params": params}
    valid = token_validity(inputs) if source_valid is None else source_valid  # [B, S]
    encoded = _apply(model, variables, inputs, valid, method="encode")
    fill_len = 0 if prefix is None else prefix.shape[1]
    tokens = jnp.zeros((batch, fill_len + max_len), jnp.int32)
    if prefix is None:
        first = jnp.full((batch,), bos_id, jnp.int32)
    else:
        tokens = tokens.at[:, 0].set(bos_id).at[:, 1:fill_len].set(prefix[:, :-1])
        first = prefix[:, -1].astype(jnp.int32)
    encoded, valid_b, tokens = _repeat_rows((encoded, valid, tokens), beams)

    def tokens_to_logits(token_ids, cache):
        i = cache["index"]
        tokens = jax.lax.dynamic_update_slice(cache["tokens"], token_ids, (0, i))  # [B, L]
        logits = _apply(model, variables, encoded, valid_b, tokens, method="decode")
        step_logits = jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False)  # [B, V]
        return step_logits, {"tokens": tokens, "index": i + 1}

    return tokens_to_logits, {"tokens": tokens, "index": jnp.int32(fill_len)}, first


class SearchConfig(NamedTuple):
    """How to search; hashable, so it is a static argument of `decode`."""

    method: str = "greedy"  # "greedy" | "sample" | "beam"
    max_len: int = 64  # tokens to generate (EOS included)
    beam_size: int = 4  # beams (method "beam")
    alpha: float = 0.6  # GNMT length-penalty exponent (method "beam"; 0 = none)
    temperature: float = 1.0  # method "sample"
    top_k: int = 0  # method "sample"; 0 = no top-k filter
    top_p: float = 1.0  # method "sample"; 1 = no nucleus filter
    min_len: int = 0  # EOS forbidden until this many tokens were generated
    cached: bool = True  # False: full recompute at every step (reference/benchmark)


@functools.partial(jax.jit, static_argnames=("model", "search", "bos_id", "eos_id"))
def decode(
    model: Transformer,
    params,
    inputs: jax.Array,
    *,
    search: SearchConfig,
    bos_id: int,
    eos_id: int,
    prefix: jax.Array | None = None,
    rng: jax.Array | None = None,
    source_valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Encodes `inputs` int32[B, S] once and searches.

    Returns:
      (tokens int32[B, n, max_len], scores float32[B, n]) with n = beam_size for
      beam search (n-best, best first; scores length-normalised log-probs) and
      n = 1 otherwise (scores: summed log-probs are not tracked, so 0). Tokens
      exclude the prefix, include EOS, and are PAD_ID after it.
    """
    batch = inputs.shape[0]
    beams = search.beam_size if search.method == "beam" else 1
    adapter = cached_step if search.cached else full_recompute_step
    step, cache, first = adapter(
        model,
        params,
        inputs,
        max_len=search.max_len,
        prefix=prefix,
        bos_id=bos_id,
        beams=beams,
        source_valid=source_valid,
    )
    shared = dict(
        max_len=search.max_len,
        bos_id=bos_id,
        eos_id=eos_id,
        min_len=search.min_len,
        first_tokens=first,
    )
    if search.method == "beam":
        return beam.beam_search(
            step, cache, batch_size=batch, beam_size=beams, alpha=search.alpha, **shared
        )
    if search.method == "sample":
        tokens = sampling.sample_search(
            step,
            cache,
            batch_size=batch,
            rng=rng,
            temperature=search.temperature,
            top_k=search.top_k,
            top_p=search.top_p,
            **shared,
        )
    elif search.method == "greedy":
        tokens = sampling.greedy_search(step, cache, batch_size=batch, **shared)
    else:
        raise ValueError(f"unknown search method {search.method!r}: greedy, sample or beam")
    return tokens[:, None, :], jnp.zeros((batch, 1), jnp.float32)


@functools.partial(jax.jit, static_argnames=("model", "search", "bos_id", "eos_id"))
def decode_with_constraints(
    model: Transformer,
    params,
    inputs: jax.Array,
    phrases: jax.Array,
    phrase_lengths: jax.Array,
    *,
    search: SearchConfig,
    bos_id: int,
    eos_id: int,
    source_valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Encodes `inputs` int32[B, S] once and runs lexically constrained beam search
    (`search/constrained.py`) with `search`'s beam_size, alpha, max_len and min_len.

    Args:
      phrases: int32[B, C, P] target ids every hypothesis of row b must contain,
        phrase c in phrases[b, c, :phrase_lengths[b, c]]; phrase_lengths int32[B, C]
        (0: no phrase).
    Returns:
      (tokens int32[B, beam_size, max_len], scores float32[B, beam_size]) as `decode`'s
      beam search; a slot no hypothesis filled (no beam met every phrase) scores
      constrained.NEG_INF.
    """
    step, cache, first = cached_step(
        model,
        params,
        inputs,
        max_len=search.max_len,
        bos_id=bos_id,
        beams=search.beam_size,
        source_valid=source_valid,
    )
    return constrained.constrained_beam_search(
        step,
        cache,
        constrained.Constraints(phrases, phrase_lengths),
        batch_size=inputs.shape[0],
        beam_size=search.beam_size,
        max_len=search.max_len,
        bos_id=bos_id,
        eos_id=eos_id,
        alpha=search.alpha,
        min_len=search.min_len,
        first_tokens=first,
    )
