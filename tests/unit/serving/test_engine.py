"""Continuous batching against the batch search it replaces: `serving/slots.py` stepped by
`serving/engine.py`, sentences joining and leaving slots while others run, must give what
`models/predict.decode` gives for the same sentences decoded together."""

import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config

from flaxformer_lite.constants import BOS_ID, EOS_ID
from flaxformer_lite.models import predict
from flaxformer_lite.models.transformer import Transformer, init_cache
from flaxformer_lite.serving import engine as engine_lib

SOURCE_LEN, MAX_LEN, LINES = 16, 12, 14
CFG = tiny_model_config(vocab_size=29, num_encoder_layers=1)
MODEL = Transformer(CFG)
APPLY = jax.jit(MODEL.apply, static_argnames="method")  # one compile per method and shape


def _sources():
    rng = np.random.default_rng(0)
    src = rng.integers(4, 29, (LINES, SOURCE_LEN)).astype(np.int32)
    lengths = rng.integers(2, SOURCE_LEN, LINES)
    for r, n in enumerate(lengths):  # ragged: a few admission buckets, EOS last
        src[r, n:] = 0
        src[r, n - 1] = EOS_ID
    return src


SRC = _sources()


@functools.cache
def _params():
    params = MODEL.init(jax.random.PRNGKey(1), SRC, SRC[:, :5])["params"]
    # Scaled up, the random model's distributions are peaked: its searches are no
    # near-tie lottery, and outputs have different lengths (slots free at different steps).
    return jax.tree.map(lambda x: x * 3.0, nn.meta.unbox(params))


@functools.cache
def _reference(beams: int, alpha: float, min_len: int = 0, max_len: int = MAX_LEN):
    method = "greedy" if beams == 1 else "beam"
    search = predict.SearchConfig(
        method=method, max_len=max_len, beam_size=beams, alpha=alpha, min_len=min_len
    )
    tokens, scores = predict.decode(
        MODEL, _params(), jnp.asarray(SRC), search=search, bos_id=BOS_ID, eos_id=EOS_ID
    )
    return np.asarray(tokens), np.asarray(scores)


def _ids(row) -> list[int]:
    out = [int(t) for t in row if t != 0]
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


@functools.cache
def _engine(continuous: bool = True) -> engine_lib.Engine:
    return engine_lib.Engine(
        MODEL,
        _params(),
        slots=4,
        beam_size=4,
        source_len=SOURCE_LEN,
        max_len=MAX_LEN,
        steps_per_sync=3,
        continuous=continuous,
    ).start()


def _run(engine, **fields) -> list:
    jobs = [engine_lib.Job(ids=[int(t) for t in row if t], **fields) for row in SRC]
    engine.submit(jobs)
    return [job.future.result(timeout=120) for job in jobs]


@pytest.mark.parametrize("continuous", [True, False])
def test_greedy_equals_batch_greedy_with_more_sentences_than_slots(continuous):
    want, _ = _reference(1, 0.0)
    got = _run(_engine(continuous), width=1, max_len=MAX_LEN)
    assert [g[0][0] for g in got] == [_ids(w[0]) for w in want]
    assert len({len(g[0][0]) for g in got}) > 2  # sentences ended at different steps


def test_beam_nbest_and_scores_equal_batch_beam_search():
    want_tokens, want_scores = _reference(4, 0.6)
    got = _run(_engine(), width=4, alpha=0.6, max_len=MAX_LEN, nbest=4)
    for (tokens, scores), w_tokens, w_scores in zip(got, want_tokens, want_scores, strict=True):
        assert tokens == [_ids(w) for w in w_tokens]
        np.testing.assert_allclose(scores, w_scores, rtol=1e-4, atol=1e-4)


def test_a_narrower_beam_in_the_beam_pool_is_that_beam_search():
    """width 2 in slots of 4 beams: the search of beam_size 2 (the spare beams never live)."""
    want_tokens, want_scores = _reference(2, 1.0, min_len=2, max_len=8)
    got = _run(_engine(), width=2, alpha=1.0, min_len=2, max_len=8, nbest=2)
    for (tokens, scores), w_tokens, w_scores in zip(got, want_tokens, want_scores, strict=True):
        assert tokens == [_ids(w) for w in w_tokens]
        assert all(len(t) >= 2 for t in tokens)  # min_len: no EOS before 2 tokens
        np.testing.assert_allclose(scores, w_scores, rtol=1e-4, atol=1e-4)


def test_greedy_and_beam_requests_interleave():
    engine = _engine()
    jobs = []
    for row in SRC:
        ids = [int(t) for t in row if t]
        jobs += [
            engine_lib.Job(ids=ids, max_len=MAX_LEN),
            engine_lib.Job(ids=ids, width=4, alpha=0.6, max_len=MAX_LEN),
        ]
    engine.submit(jobs)
    got = [job.future.result(timeout=120)[0][0] for job in jobs]
    assert got[0::2] == [_ids(w[0]) for w in _reference(1, 0.0)[0]]
    assert got[1::2] == [_ids(w[0]) for w in _reference(4, 0.6)[0]]


def test_streamed_pieces_add_up_to_the_answer():
    engine = _engine()
    pieces = {i: [] for i in range(LINES)}
    jobs = [
        engine_lib.Job(ids=[int(t) for t in row if t], max_len=MAX_LEN, on_tokens=pieces[i].extend)
        for i, row in enumerate(SRC)
    ]
    engine.submit(jobs)
    answers = [job.future.result(timeout=120)[0][0] for job in jobs]
    assert [pieces[i] for i in range(LINES)] == answers


def test_a_full_queue_refuses_all_of_a_submission_and_a_deadline_expires():
    engine = engine_lib.Engine(
        MODEL,
        _params(),
        slots=2,
        beam_size=1,
        source_len=SOURCE_LEN,
        max_len=MAX_LEN,
        max_queue=3,
    )  # not started: nothing leaves the queue
    jobs = [engine_lib.Job(ids=[5, EOS_ID], max_len=4) for _ in range(3)]
    engine.submit(jobs[:2])
    with pytest.raises(engine_lib.Busy, match="limit 3"):
        engine.submit(jobs[2:] + [engine_lib.Job(ids=[5, EOS_ID], max_len=4)])
    assert len(engine.queue) == 2  # none of the refused submission was queued
    jobs[0].deadline = time.monotonic() - 1  # expired while waiting
    engine.start()
    with pytest.raises(engine_lib.Expired):
        jobs[0].future.result(timeout=60)
    assert jobs[1].future.result(timeout=60)
    engine.stop()
    with pytest.raises(engine_lib.Busy, match="shutting down"):
        engine.submit([engine_lib.Job(ids=[5, EOS_ID], max_len=4)])


def test_jobs_outside_the_engines_shapes_are_refused():
    engine = _engine()
    for bad in (
        dict(ids=[5] * (SOURCE_LEN + 1)),
        dict(ids=[5], width=5),
        dict(ids=[5], max_len=MAX_LEN + 1),
        dict(ids=[]),
    ):
        with pytest.raises(ValueError):
            engine.submit([engine_lib.Job(**bad)])


def test_rows_at_their_own_positions_equal_rows_at_one_position():
    """The per-row cache index (each row at its own position) against the shared one: the
    same tokens fed at the same positions give the same logits and cache."""
    params = _params()
    variables = {"params": params}
    src = jnp.asarray(SRC[:3])
    valid = src != 0
    encoded = APPLY(variables, src, valid, method="encode")
    cross = APPLY(variables, encoded, method="precompute_cross_kv")
    tokens = jnp.asarray([[BOS_ID, 7, 9, 11]] * 3)
    shared = init_cache(CFG, 3, 8)
    per_row = {**init_cache(CFG, 3, 8), "index": jnp.zeros((3,), jnp.int32)}
    for t in range(4):
        step = tokens[:, t : t + 1]
        a, shared = APPLY(variables, step, shared, cross, valid, method="decode_step")
        b, per_row = APPLY(variables, step, per_row, cross, valid, method="decode_step")
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # logits ~10, two programs
    np.testing.assert_array_equal(per_row["index"], [4, 4, 4])
    # Rows at different positions: row 1 one step behind gives row 1's earlier logits.
    late = {**per_row, "index": jnp.array([3, 2, 3], jnp.int32)}
    c, _ = APPLY(variables, tokens[:, 2:3], late, cross, valid, method="decode_step")
    np.testing.assert_allclose(c[1], _logits_at(variables, src, valid, tokens, 2)[1], atol=1e-4)


def _logits_at(variables, src, valid, tokens, t):
    """Logits of position t from the teacher-forced pass."""
    logits = APPLY(variables, src, tokens)
    return logits[:, t : t + 1]


def test_beams_sharing_one_cross_kv_row_equal_repeated_rows():
    params = _params()
    variables = {"params": params}
    src = jnp.asarray(SRC[:2])
    valid = src != 0
    cross = APPLY(
        variables,
        APPLY(variables, src, valid, method="encode"),
        method="precompute_cross_kv",
    )
    repeated = jax.tree.map(lambda x: jnp.repeat(x, 3, axis=0), cross)
    tokens = jnp.asarray([[BOS_ID], [5], [6], [BOS_ID], [8], [9]])  # 2 sentences x 3 beams
    cache = init_cache(CFG, 6, 4)
    a, _ = APPLY(variables, tokens, cache, cross, valid, method="decode_step")
    b, _ = APPLY(
        variables, tokens, cache, repeated, jnp.repeat(valid, 3, axis=0), method="decode_step"
    )
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # logits ~10: float32 sums
