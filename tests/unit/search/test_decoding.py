"""Decoding: the KV cache against the teacher-forced pass, and searches on hand-made logits."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config
from flax import linen as nn

from flaxformer_lite.models import layer_layout, predict
from flaxformer_lite.models.transformer import Transformer, init_cache
from flaxformer_lite.search import beam, sampling

jax.config.update("jax_default_matmul_precision", "highest")

BOS, EOS = 2, 3
TINY = tiny_model_config()
SRC = jnp.array([[5, 6, 7, 8, 0, 0, 0], [9, 10, 11, 12, 13, 14, 15], [16, 0, 0, 0, 0, 0, 0]])
TGT = jnp.array([[BOS, 4, 5, 6, 7, 8], [BOS, 7, 8, 9, 10, 11], [BOS, 20, 21, 22, 23, 24]])


@functools.cache
def _params(cfg):
    """The parameters of `cfg`'s model, initialised once per config (every test reads them
    only; a jitted init is one compile where the eager one dispatches each op)."""
    init = jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(1), SRC, TGT)
    return nn.meta.unbox(init["params"])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _full_and_cached(model, params, prefix_len):
    """The teacher-forced logits [B, T, V] and, in the same program, the logits of every
    cached step from position `prefix_len` on (the forced prefix TGT[:, 1:prefix_len + 1]
    written into the cache at once; none for 0), the first tokens, and the cache index after
    the fill and after the last step."""
    full = model.apply({"params": params}, SRC, TGT)  # [B, T, V]
    prefix = TGT[:, 1 : prefix_len + 1] if prefix_len else None
    max_len = TGT.shape[1] - prefix_len
    step, cache, first = predict.cached_step(
        model, params, SRC, max_len=max_len, prefix=prefix, bos_id=BOS
    )
    filled = cache["index"]

    def body(cache, tokens):  # tokens int32[B]: one step's body, compiled once
        logits, cache = step(tokens[:, None], cache)
        return cache, logits

    cache, steps = jax.lax.scan(body, cache, TGT[:, prefix_len:].T)  # steps [T', B, V]
    return full, steps.swapaxes(0, 1), first, (filled, cache["index"])


# ----------------------------------------------------------------------------
# Cached decoding == the full teacher-forced pass.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes", [{}, {"norm": "pre", "positions": "learned"}, {"attention_impl": "fast"}]
)
def test_cached_steps_equal_full_forward(changes):
    cfg = TINY.replace(**changes)
    full, steps, first, (_, index) = _full_and_cached(Transformer(cfg), _params(cfg), 0)
    np.testing.assert_array_equal(first, [BOS] * 3)
    for t in range(TGT.shape[1]):
        np.testing.assert_allclose(steps[:, t], full[:, t], atol=1e-5, rtol=1e-5)
    assert int(index) == 6


def test_prefix_filled_in_one_call_equals_full_forward():
    # Three forced target tokens TGT[:, 1:4]: the first step feeds prefix[-1] = TGT[:, 3].
    full, steps, first, (filled, _) = _full_and_cached(Transformer(TINY), _params(TINY), 3)
    assert int(filled) == 3  # BOS + prefix[:-1] written at once
    np.testing.assert_array_equal(first, TGT[:, 3])
    for i, t in enumerate(range(3, TGT.shape[1])):
        np.testing.assert_allclose(steps[:, i], full[:, t], atol=1e-5, rtol=1e-5)


MIN_LEN = 3  # a random model may end at once; forbid EOS so the compared outputs are sequences


def _assert_nontrivial(tokens):
    """int32[B, n, L]: no hypothesis ends (or pads) within MIN_LEN tokens."""
    first = np.asarray(tokens)[..., :MIN_LEN]
    assert np.all((first != EOS) & (first != 0)), tokens


def _decode(model, params, method, cached, prefix=None, **search):
    config = predict.SearchConfig(method, 6, cached=cached, min_len=MIN_LEN, **search)
    return predict.decode(model, params, SRC, search=config, bos_id=BOS, eos_id=EOS, prefix=prefix)


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_cached_and_uncached_searches_agree(method):
    model, params = Transformer(TINY), _params(TINY)
    a = _decode(model, params, method, cached=True)
    b = _decode(model, params, method, cached=False)
    _assert_nontrivial(a[0])
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)
    if method == "beam":
        assert len({tuple(x) for x in np.asarray(a[0])[0]}) == a[0].shape[1]  # distinct n-best


def test_scanned_layers_decode_as_the_unrolled_ones():
    """Layers stored stacked (`scan_layers`): cached greedy equals the full recompute (which
    runs the scan at every step) and the unrolled model on the same weights; the decoder's
    own cached step, which slices the stacked weights per layer, equals the unrolled one."""
    params = _params(TINY)
    scanned, stacked = Transformer(TINY.replace(scan_layers=True)), layer_layout.stack(params)
    a = _decode(scanned, stacked, "greedy", cached=True)
    _assert_nontrivial(a[0])
    np.testing.assert_array_equal(a[0], _decode(scanned, stacked, "greedy", cached=False)[0])
    np.testing.assert_array_equal(a[0], _decode(Transformer(TINY), params, "greedy", True)[0])

    @functools.partial(jax.jit, static_argnums=0)
    def steps(model, params):
        variables = {"params": params}
        encoded = model.apply(variables, SRC, method="encode")
        kv = model.apply(variables, encoded, method="precompute_cross_kv")
        cache = init_cache(TINY, SRC.shape[0], TGT.shape[1])
        out = []
        for t in range(3):
            logits, cache = model.apply(
                variables, TGT[:, t : t + 1], cache, kv, SRC != 0, method="decode_step"
            )
            out.append(logits)
        return jnp.concatenate(out, 1), cache

    (got, got_cache), (want, want_cache) = steps(scanned, stacked), steps(Transformer(TINY), params)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for x, y in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_beam_search_with_a_prefix_equals_full_recompute():
    """Beams > 1 after a forced prefix (one length for all rows, different tokens):
    the prefix filled into the KV cache at once equals rerunning the whole decoder."""
    model, params = Transformer(TINY), _params(TINY)
    prefix = TGT[:, 1:4]
    assert len({tuple(r) for r in np.asarray(prefix)}) == 3
    a = _decode(model, params, "beam", cached=True, prefix=prefix, beam_size=3)
    b = _decode(model, params, "beam", cached=False, prefix=prefix, beam_size=3)
    _assert_nontrivial(a[0])
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)


def test_beam_one_equals_greedy_on_a_model():
    model, params = Transformer(TINY), _params(TINY)
    search = dict(max_len=8, min_len=MIN_LEN)
    greedy, _ = predict.decode(
        model, params, SRC, search=predict.SearchConfig("greedy", **search), bos_id=BOS, eos_id=EOS
    )
    beam, _ = predict.decode(
        model,
        params,
        SRC,
        search=predict.SearchConfig("beam", beam_size=1, alpha=0.0, **search),
        bos_id=BOS,
        eos_id=EOS,
    )
    _assert_nontrivial(greedy)
    np.testing.assert_array_equal(greedy, beam)


# ----------------------------------------------------------------------------
# Hand-made language models: logits depend on (step, previous token) only.
# ----------------------------------------------------------------------------

A, B_, C = 4, 5, 6  # three ordinary tokens
V = 7


def table_lm(rules: dict[tuple[int, int], dict[int, float]], max_len: int, batch: int = 1):
    """A tokens_to_logits from {(step, previous token): {next token: probability}}.

    Unlisted (step, previous) pairs put all mass on EOS. Returns (fn, cache).
    """
    table = np.full((max_len, V, V), -1e9, np.float32)
    table[:, :, EOS] = 0.0
    for (step, prev), dist in rules.items():
        table[step, prev] = -1e9
        for tok, p in dist.items():
            table[step, prev, tok] = math.log(p)
    table = jnp.asarray(table)

    def fn(ids, cache):
        logits = table[cache["i"], ids[:, 0]]  # [rows, V]
        return logits, {"i": cache["i"] + 1}

    fn.table = table  # [max_len, V, V], for `per_row_table_lm`
    return fn, {"i": jnp.int32(0)}


# Greedy takes A (0.6), then C (0.55), then EOS: 0.33. B then EOS has
# 0.4 * 0.9 = 0.36, the best sequence; A then EOS has 0.27.
BEAM_BEATS_GREEDY = {
    (0, BOS): {A: 0.6, B_: 0.4},
    (1, A): {C: 0.55, EOS: 0.45},
    (1, B_): {EOS: 0.9, C: 0.1},
    (2, C): {EOS: 1.0},
}


def test_beam_search_beats_greedy_exactly():
    fn, cache = table_lm(BEAM_BEATS_GREEDY, 4)
    greedy = sampling.greedy_search(fn, cache, batch_size=1, max_len=4, bos_id=BOS, eos_id=EOS)
    assert greedy.tolist() == [[A, C, EOS, 0]]
    seqs, scores = beam.beam_search(
        fn, cache, batch_size=1, beam_size=2, max_len=4, bos_id=BOS, eos_id=EOS, alpha=0.0
    )
    assert seqs[0, 0].tolist() == [B_, EOS, 0, 0]
    assert float(scores[0, 0]) == pytest.approx(math.log(0.4 * 0.9), abs=1e-5)
    # The runner-up is greedy's answer, one token longer.
    assert seqs[0, 1].tolist() == [A, C, EOS, 0]
    assert float(scores[0, 1]) == pytest.approx(math.log(0.6 * 0.55), abs=1e-5)
    one, _ = beam.beam_search(
        fn, cache, batch_size=1, beam_size=1, max_len=4, bos_id=BOS, eos_id=EOS, alpha=0.0
    )
    np.testing.assert_array_equal(one[:, 0], greedy)


def test_beams_finish_at_different_lengths_nbest_sorted():
    rules = {
        (0, BOS): {A: 0.5, B_: 0.3, C: 0.2},
        (1, A): {EOS: 0.2, A: 0.8},
        (2, A): {EOS: 1.0},
        (1, B_): {EOS: 1.0},
        (1, C): {EOS: 1.0},
    }
    fn, cache = table_lm(rules, 5)
    seqs, scores = beam.beam_search(
        fn, cache, batch_size=1, beam_size=3, max_len=5, bos_id=BOS, eos_id=EOS, alpha=0.0
    )
    expected = [([A, A, EOS, 0, 0], 0.5 * 0.8), ([B_, EOS, 0, 0, 0], 0.3), ([C, EOS, 0, 0, 0], 0.2)]
    for k, (seq, p) in enumerate(expected):
        assert seqs[0, k].tolist() == seq
        assert float(scores[0, k]) == pytest.approx(math.log(p), abs=1e-5)


# Short: B EOS with p = 0.5 (len 2). Long: A A A EOS with p = 0.45 (len 4).
LENGTH_PENALTY_RULES = {
    (0, BOS): {A: 0.5, B_: 0.5},
    (1, B_): {EOS: 1.0},
    (1, A): {A: 0.9, EOS: 0.1},
    (2, A): {A: 1.0},
    (3, A): {EOS: 1.0},
}


def test_length_penalty_changes_the_winner():
    fn, cache = table_lm(LENGTH_PENALTY_RULES, 6)
    kwargs = dict(batch_size=1, beam_size=2, max_len=6, bos_id=BOS, eos_id=EOS)
    seqs, scores = beam.beam_search(fn, cache, alpha=0.0, **kwargs)
    assert seqs[0, 0, :2].tolist() == [B_, EOS]
    seqs, scores = beam.beam_search(fn, cache, alpha=2.0, **kwargs)
    assert seqs[0, 0, :4].tolist() == [A, A, A, EOS]
    lp = ((5 + 4) / 6) ** 2.0
    assert float(scores[0, 0]) == pytest.approx(math.log(0.45) / lp, abs=1e-5)


def test_beam_search_skips_steps_once_every_beam_finished():
    """The model is not called again once all examples are done (checked per chunk)."""
    fn, cache = table_lm({(0, BOS): {A: 0.5, B_: 0.5}}, 32)  # then EOS: done after 2 steps
    calls = []

    def recording(ids, cache):
        jax.debug.callback(lambda: calls.append(1))
        return fn(ids, cache)

    seqs, scores = beam.beam_search(
        recording, cache, batch_size=2, beam_size=2, max_len=32, bos_id=BOS, eos_id=EOS, alpha=0.0
    )
    jax.effects_barrier()
    assert len(calls) == beam.SKIP_CHUNK  # the first chunk only, not all 32 steps
    assert seqs[0, 0, :2].tolist() in ([A, EOS], [B_, EOS])
    np.testing.assert_allclose(scores, math.log(0.5), atol=1e-6)


def test_min_len_forbids_early_eos():
    fn, cache = table_lm({(0, BOS): {EOS: 0.9, A: 0.1}, (1, A): {EOS: 1.0}}, 3)
    out = sampling.greedy_search(
        fn, cache, batch_size=1, max_len=3, bos_id=BOS, eos_id=EOS, min_len=1
    )
    assert out.tolist() == [[A, EOS, 0]]


def per_row_table_lm(rows_rules, max_len: int, beams: int):
    """Like `table_lm`, but example b follows its own rules rows_rules[b].

    Which example a row belongs to travels in the cache (int32[B * beams]), as
    an encoder output would, so a search that mixes rows when it reorders
    beams feeds a row another example's table.
    """
    tables = jnp.stack([table_lm(r, max_len)[0].table for r in rows_rules])  # [B, L, V, V]

    def fn(ids, cache):
        logits = tables[cache["example"], cache["i"], ids[:, 0]]  # [rows, V]
        return logits, {"i": cache["i"] + 1, "example": cache["example"]}

    example = jnp.repeat(jnp.arange(len(rows_rules), dtype=jnp.int32), beams)
    return fn, {"i": jnp.int32(0), "example": example}


SPREAD_RULES = {
    (0, BOS): {A: 0.5, B_: 0.3, C: 0.2},
    (1, A): {EOS: 0.2, A: 0.8},
    (2, A): {EOS: 1.0},
    (1, B_): {C: 0.7, EOS: 0.3},
    (2, C): {B_: 0.6, EOS: 0.4},
    (1, C): {EOS: 1.0},
}


@pytest.mark.parametrize("beam_size", [1, 3])
def test_batch_rows_are_independent_in_beam_search(beam_size):
    """Three examples with different distributions, searched together, give each
    example's n-best list searched alone (in either batch order)."""
    rules = [BEAM_BEATS_GREEDY, LENGTH_PENALTY_RULES, SPREAD_RULES]
    kw = dict(beam_size=beam_size, max_len=6, bos_id=BOS, eos_id=EOS, alpha=0.6)
    alone = []
    for r in rules:
        fn, cache = table_lm(r, 6)
        alone.append(beam.beam_search(fn, cache, batch_size=1, **kw))
    # The examples really differ, so a row fed another's table would show.
    assert len({tuple(np.asarray(s)[0, 0]) for s, _ in alone}) == 3
    for order in ([0, 1, 2], [2, 0, 1]):
        fn, cache = per_row_table_lm([rules[i] for i in order], 6, beam_size)
        seqs, scores = beam.beam_search(fn, cache, batch_size=3, **kw)
        for row, i in enumerate(order):
            np.testing.assert_array_equal(seqs[row], alone[i][0][0])
            np.testing.assert_allclose(scores[row], alone[i][1][0], atol=1e-6)
    if beam_size == 1:
        fn, cache = per_row_table_lm(rules, 6, 1)
        greedy = sampling.greedy_search(fn, cache, batch_size=3, max_len=6, bos_id=BOS, eos_id=EOS)
        for row, r in enumerate(rules):
            fn1, cache1 = table_lm(r, 6)
            one = sampling.greedy_search(
                fn1, cache1, batch_size=1, max_len=6, bos_id=BOS, eos_id=EOS
            )
            np.testing.assert_array_equal(greedy[row], one[0])


# ----------------------------------------------------------------------------
# Sampling.
# ----------------------------------------------------------------------------


def _constant_lm(logits_row, batch):
    logits = jnp.tile(jnp.asarray(logits_row, jnp.float32), (batch, 1))
    return (lambda ids, cache: (logits, cache)), {}


ROW = [-1.0, 0.5, -2.0, 0.0, 2.0, 1.0, 1.5]  # distinct; order: 4 > 6 > 5 > 1 > 3 > 0 > 2


def test_top_k_never_leaves_the_allowed_set():
    fn, cache = _constant_lm(ROW, 4000)
    out = sampling.sample_search(
        fn,
        cache,
        batch_size=4000,
        max_len=1,
        bos_id=BOS,
        eos_id=-1,
        rng=jax.random.PRNGKey(0),
        temperature=1.0,
        top_k=3,
    )
    assert set(np.unique(out).tolist()) == {4, 6, 5}


def test_top_p_never_leaves_the_nucleus():
    probs = np.exp(ROW) / np.exp(ROW).sum()
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.8)) + 1].tolist())
    fn, cache = _constant_lm(ROW, 4000)
    out = sampling.sample_search(
        fn,
        cache,
        batch_size=4000,
        max_len=1,
        bos_id=BOS,
        eos_id=-1,
        rng=jax.random.PRNGKey(1),
        temperature=1.0,
        top_p=0.8,
    )
    assert set(np.unique(out).tolist()) == nucleus
    assert len(nucleus) < V


def test_sampling_is_reproducible_and_temperature_zero_is_greedy():
    fn, cache = _constant_lm(ROW, 64)
    kw = dict(batch_size=64, max_len=5, bos_id=BOS, eos_id=-1, temperature=1.0)
    a = sampling.sample_search(fn, cache, rng=jax.random.PRNGKey(7), **kw)
    b = sampling.sample_search(fn, cache, rng=jax.random.PRNGKey(7), **kw)
    c = sampling.sample_search(fn, cache, rng=jax.random.PRNGKey(8), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(np.unique(np.asarray(a))) > 3  # it really samples
    kw["temperature"] = 0.0
    g = sampling.sample_search(fn, cache, rng=jax.random.PRNGKey(7), **kw)
    assert np.all(np.asarray(g) == 4)
    with pytest.raises(ValueError, match="rng"):
        sampling.sample_search(
            fn, cache, batch_size=2, max_len=1, bos_id=BOS, eos_id=EOS, temperature=0.5
        )
