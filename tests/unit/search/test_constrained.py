"""Constrained beam search (search/constrained.py): plain beam search when there are no
phrases, phrases in every hypothesis on a random model, an exhaustive enumeration on a
tiny vocabulary, and the bank allocation against Sockeye's loop."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config
from flax import linen as nn

from flaxformer_lite.models import predict
from flaxformer_lite.models.transformer import Transformer
from flaxformer_lite.search import beam, constrained
from flaxformer_lite.search.primitives import NEG_INF

jax.config.update("jax_default_matmul_precision", "highest")

BOS, EOS = 2, 3
SRC = jnp.array([[5, 6, 7, 8, 0, 0, 0], [9, 10, 11, 12, 13, 14, 15], [16, 0, 0, 0, 0, 0, 0]])
K, L = 4, 8


@functools.cache
def _model():
    """The tiny model with its random parameters scaled by 3: peaked distributions, so two
    candidates rarely tie and the compared searches have one right answer."""
    model = Transformer(tiny_model_config())
    tgt = jnp.full((3, 6), BOS, jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(1), SRC, tgt)["params"])
    return model, jax.tree.map(lambda x: 3 * x, params)


@jax.jit
def _beam_and_constrained(params, phrases, lengths):
    """Beam search and constrained search from the same cached step, in one program."""
    model = _model()[0]
    step, cache, first = predict.cached_step(model, params, SRC, max_len=L, bos_id=BOS, beams=K)
    kw = dict(batch_size=3, beam_size=K, max_len=L, bos_id=BOS, eos_id=EOS, first_tokens=first)
    plain = beam.beam_search(step, cache, **kw)
    cons = constrained.Constraints(phrases, lengths)
    return plain, constrained.constrained_beam_search(step, cache, cons, **kw)


def _contains(seq, phrase) -> bool:
    seq, phrase = list(seq), list(phrase)
    return any(seq[s : s + len(phrase)] == phrase for s in range(len(seq) - len(phrase) + 1))


def _generated(row) -> list[int]:
    """Tokens before EOS (or all max_len of them)."""
    row = list(np.asarray(row))
    return row[: row.index(EOS)] if EOS in row else row


# Row 0: two phrases, one with a repeated token; row 1: none; row 2: a three-token phrase.
PHRASES = jnp.array([[[7, 7, 0], [12, 0, 0]], [[0, 0, 0]] * 2, [[20, 21, 22], [0, 0, 0]]])
LENGTHS = jnp.array([[2, 1], [0, 0], [3, 0]])


def test_without_phrases_it_is_beam_search():
    """No phrases: exactly beam search's n-best lists; phrases in rows 0 and 2 leave row 1
    (none of its own) as beam search leaves it."""
    params = _model()[1]
    (want, want_scores), (got, scores) = _beam_and_constrained(
        params, jnp.zeros_like(PHRASES), jnp.zeros_like(LENGTHS)
    )
    assert len({tuple(r) for r in np.asarray(want).reshape(-1, L)}) == 3 * K  # non-trivial
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-6)
    (_, _), (got, scores) = _beam_and_constrained(params, PHRASES, LENGTHS)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(scores[1], want_scores[1], rtol=1e-6)
    assert not np.array_equal(got[0], want[0])


def test_every_hypothesis_contains_every_phrase():
    params = _model()[1]
    (plain, _), (got, scores) = _beam_and_constrained(params, PHRASES, LENGTHS)
    # Beam search alone finds none of row 0's and row 2's phrases: the constraints decide.
    assert not any(_contains(_generated(h), [20, 21, 22]) for h in np.asarray(plain[2]))
    for b in (0, 2):
        kept = np.asarray(scores[b]) > NEG_INF / 2
        assert kept[0], scores[b]
        for seq in np.asarray(got[b])[kept]:
            for c in range(PHRASES.shape[1]):
                phrase = np.asarray(PHRASES[b, c, : LENGTHS[b, c]])
                assert _contains(_generated(seq), phrase), (b, seq, phrase)
        assert np.all(np.diff(np.asarray(scores[b])[kept]) <= 0)  # best first
        assert np.all(np.asarray(got[b])[~kept] == 0)  # empty slots are padding


# ----------------------------------------------------------------------------
# Exhaustive: every sequence of a tiny language model, scored as beam search scores.
# ----------------------------------------------------------------------------

TOKENS = (4, 5, 6)  # the ordinary tokens; 0-2 are impossible, 3 is EOS
V, STEPS, ALPHA = 7, 4, 0.6


def _random_tables(batch: int) -> np.ndarray:
    """Log-probabilities [batch, step, previous token, next token] of a random model."""
    logits = np.random.default_rng(0).normal(0, 1.5, (batch, STEPS, V, V))
    logits[..., [0, 1, 2]] = -1e9
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def _table_step(tables: np.ndarray, beams: int):
    """tokens_to_logits of `_random_tables`: example b reads its own table."""
    tables = jnp.asarray(tables)

    def step(ids, cache):
        return tables[cache["example"], cache["i"], ids[:, 0]], dict(cache, i=cache["i"] + 1)

    example = jnp.repeat(jnp.arange(tables.shape[0], dtype=jnp.int32), beams)
    return step, {"i": jnp.int32(0), "example": example}


def _brute_force(table: np.ndarray, phrases) -> list[tuple[float, list[int]]]:
    """Every output (EOS-ended, or STEPS tokens long) holding every phrase, scored as
    beam search scores it, best first."""
    outputs = [[*body, EOS] for n in range(STEPS) for body in itertools.product(TOKENS, repeat=n)]
    outputs += [list(body) for body in itertools.product(TOKENS, repeat=STEPS)]  # cut at STEPS
    out = []
    for seq in outputs:
        if all(_contains(_generated(seq), p) for p in phrases):
            logp = sum(table[t, ([BOS, *seq])[t], seq[t]] for t in range(len(seq)))
            out.append((logp / ((5 + len(seq)) / 6) ** ALPHA, seq))
    return sorted(out, key=lambda x: -x[0])


def test_the_best_of_all_sequences_holding_the_phrases_is_found():
    """With a beam as wide as the search space (3^3 = 27 live prefixes at most), the n-best
    list is the exhaustive one: the best 8 outputs holding their row's phrases."""
    rows = [[[6, 4]], [[5, 5, 6]], [[4], [6, 6]], []]  # a phrase each, repeats, two, none
    tables, beams = _random_tables(len(rows)), 64
    phrases = np.zeros((len(rows), 2, 3), np.int32)
    lengths = np.zeros((len(rows), 2), np.int32)
    for b, row in enumerate(rows):
        for c, p in enumerate(row):
            phrases[b, c, : len(p)], lengths[b, c] = p, len(p)
    step, cache = _table_step(tables, beams)
    seqs, scores = constrained.constrained_beam_search(
        step,
        cache,
        constrained.Constraints(jnp.asarray(phrases), jnp.asarray(lengths)),
        **dict(batch_size=len(rows), beam_size=beams, max_len=STEPS, bos_id=BOS, eos_id=EOS),
        alpha=ALPHA,
    )
    for b, row in enumerate(rows):
        want = _brute_force(tables[b], row)[:8]
        got = [list(s[s != 0]) for s in np.asarray(seqs[b, : len(want)])]
        assert got == [w[1] for w in want], b
        np.testing.assert_allclose(scores[b, : len(want)], [w[0] for w in want], rtol=1e-5)


# ----------------------------------------------------------------------------
# The bank allocation.
# ----------------------------------------------------------------------------


def _sockeye_bank_sizes(num_constraints, beam_size, candidate_counts):
    """sockeye/lexical_constraints.py `get_bank_sizes`, verbatim but for names."""
    num_banks = num_constraints + 1
    bank_size = beam_size // num_banks
    remainder = beam_size - bank_size * num_banks
    assigned = [bank_size for _ in range(num_banks)]
    assigned[-1] += remainder
    for i in reversed(range(num_banks)):
        overfill = assigned[i] - candidate_counts[i]
        if overfill > 0:
            assigned[i] -= overfill
            assigned[(i - 1) % num_banks] += overfill
    return assigned


@pytest.mark.parametrize("k", [1, 3, 5, 12])
def test_bank_sizes_are_sockeyes(k):
    rng = np.random.default_rng(k)
    tops = np.array([0, 1, 2, 4, 6, 6])
    counts = rng.integers(0, 6, (len(tops), 7))
    counts[:, 0] = 0  # an empty bottom bank passes its room to the top bank
    got = np.asarray(constrained._bank_sizes(jnp.asarray(counts), jnp.asarray(tops), k))
    for row, top in enumerate(tops):
        want = _sockeye_bank_sizes(int(top), k, counts[row, : top + 1])
        assert got[row].tolist() == want + [0] * (6 - top), (row, top)
        assert got[row].sum() == k


def test_phrase_scores_are_log_probabilities():
    """A hand-made model: the phrase's score is the log-probability of the one sequence
    holding it, `math.log(p) / lp`."""
    table = np.full((1, STEPS, V, V), -1e9, np.float32)
    table[..., EOS] = 0.0
    table[0, 0, BOS, [EOS, 4, 5]] = [
        -1e9,
        *np.log([0.9, 0.1]),
    ]  # 4 then EOS is the unconstrained best
    table[0, 1, 5, [EOS, 6]] = np.log([0.8, 0.2])
    step, cache = _table_step(table, 2)
    cons = constrained.Constraints(jnp.array([[[6]]]), jnp.array([[1]]))
    seqs, scores = constrained.constrained_beam_search(
        step, cache, cons, batch_size=1, beam_size=2, max_len=STEPS, bos_id=BOS, eos_id=EOS
    )
    assert seqs[0, 0].tolist() == [5, 6, EOS, 0]
    assert float(scores[0, 0]) == pytest.approx(math.log(0.1 * 0.2) / (8 / 6) ** 0.6, abs=1e-5)
