"""The CTC loss, the best CTC alignment and the glancing schedule against brute force.

Every path of T frames over a vocabulary of 4 (the blank 0 and tokens 1, 2, 3) is
enumerated: the loss is -log of the summed probability of the paths that collapse to
the target, the best alignment is the most probable of them.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.objectives import ctc_loss, glancing

BLANK, V, T, N = 0, 4, 7, 4
# Per row: the frames it has (the rest is padding) and its target (padded to N). Row 0
# repeats a token (the two 1s need a blank between them), row 2 needs all 4 of its frames.
FRAMES = [6, 7, 4, 5]
TARGETS = [[1, 1, 2], [2, 3], [3, 3, 1], []]


def collapse(path):
    """Plain Python: merge repeats, then drop blanks."""
    out, previous = [], None
    for s in path:
        if s != previous and s != BLANK:
            out.append(s)
        previous = s
    return out


def brute_force(log_probs, frames, target):
    """(-log P(target), the best path, its log-probability) over all V**frames paths."""
    paths = np.array(list(itertools.product(range(V), repeat=frames)))  # [P, frames]
    scores = log_probs[np.arange(frames)[None, :], paths].sum(-1)  # [P]
    hits = np.array([collapse(p) == target for p in paths])
    best = np.argmax(np.where(hits, scores, -np.inf))
    return -np.logaddexp.reduce(scores[hits]), paths[best], scores[best]


def batch(seed, padding_value=0.0, label_padding=BLANK):
    """(logits float32[B, T, V], frame_valid, labels int32[B, N], label_valid), the padded
    frames' logits and the padded labels set to the given values."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(FRAMES), T, V)) * 1.5
    frame_valid = np.arange(T)[None, :] < np.array(FRAMES)[:, None]
    logits = np.where(frame_valid[..., None], logits, padding_value)
    labels = np.full((len(TARGETS), N), label_padding)
    for row, target in enumerate(TARGETS):
        labels[row, : len(target)] = target
    label_valid = np.arange(N)[None, :] < np.array([len(t) for t in TARGETS])[:, None]
    return (jnp.asarray(logits, jnp.float32), jnp.asarray(frame_valid), jnp.asarray(labels),
            jnp.asarray(label_valid))  # fmt: skip


def reference(logits):
    log_probs = np.asarray(jax.nn.log_softmax(logits.astype(np.float64)))
    return [brute_force(log_probs[r], FRAMES[r], TARGETS[r]) for r in range(len(FRAMES))]


@pytest.mark.parametrize("seed", [0, 1])
def test_ctc_loss_is_minus_log_of_the_summed_alignments(seed):
    logits, frame_valid, labels, label_valid = batch(seed)
    got = ctc_loss.ctc_nll(logits, frame_valid, labels, label_valid, BLANK)
    want = [nll for nll, _, _ in reference(np.asarray(logits))]
    np.testing.assert_allclose(got, want, rtol=2e-5)


def test_ctc_loss_ignores_the_padding_on_both_sides():
    plain = ctc_loss.ctc_nll(*batch(0), BLANK)
    # Large logits at the padded frames; padded labels equal to a row's last token (2, 3, 1).
    for padding, label_padding in [(9.0, 2), (-7.0, 3), (0.0, 1)]:
        got = ctc_loss.ctc_nll(*batch(0, padding, label_padding), BLANK)
        np.testing.assert_allclose(got, plain, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_best_alignment_is_the_most_probable_path_of_the_target(seed):
    logits, frame_valid, labels, label_valid = batch(seed, padding_value=5.0, label_padding=3)
    log_probs = jax.nn.log_softmax(logits)
    path, score = jax.jit(ctc_loss.best_alignment, static_argnums=4)(
        log_probs, frame_valid, labels, label_valid, BLANK
    )
    for row, (_, best, best_score) in enumerate(reference(np.asarray(logits))):
        np.testing.assert_array_equal(path[row, : FRAMES[row]], best)
        assert (np.asarray(path[row, FRAMES[row] :]) == BLANK).all()  # padded frames
        assert collapse(np.asarray(path[row, : FRAMES[row]])) == TARGETS[row]
        np.testing.assert_allclose(score[row], best_score, rtol=1e-5)


def test_a_target_needs_one_frame_per_token_and_per_repeat():
    _, frame_valid, labels, label_valid = batch(0)
    np.testing.assert_array_equal(ctc_loss.required_frames(labels, label_valid), [4, 2, 4, 0])
    assert ctc_loss.alignable(labels, label_valid, frame_valid).all()
    short = jnp.arange(T)[None, :] < jnp.array([[3], [1], [3], [0]])
    np.testing.assert_array_equal(
        ctc_loss.alignable(labels, label_valid, short), [False, False, False, True]
    )


# Glancing.


def test_glancing_ratio_anneals_linearly_then_stays():
    at = lambda step: float(glancing.ratio(step, 0.5, 0.3, 1000))
    assert at(0) == pytest.approx(0.5)
    assert at(500) == pytest.approx(0.4)
    assert at(1000) == pytest.approx(0.3)
    assert at(5000) == pytest.approx(0.3)  # past the end
    assert float(jax.jit(glancing.ratio, static_argnums=(1, 2, 3))(250, 0.5, 0.3, 1000)) == (
        pytest.approx(0.45)
    )


@pytest.mark.parametrize("step", [0, 500, 1000, 4000])
def test_glanced_positions_are_floor_of_ratio_times_distance(step):
    distance = jnp.array([0, 1, 2, 3, 5, 10, 17])
    ratio = glancing.ratio(step, 0.5, 0.3, 1000)
    want = np.floor(np.float32(ratio) * np.asarray(distance, np.float32))
    np.testing.assert_array_equal(glancing.count(ratio, distance), want)
    valid = jnp.arange(12)[None, :] < jnp.array([12, 12, 12, 2, 12, 12, 12])[:, None]
    shown = glancing.positions(jax.random.PRNGKey(step), valid, glancing.count(ratio, distance))
    np.testing.assert_array_equal(shown.sum(-1), np.minimum(want, np.asarray(valid.sum(-1))))
    assert not bool((shown & ~valid).any())


def test_no_glancing_at_ratio_zero():
    distance = jnp.array([0, 4, 30])
    assert not glancing.count(glancing.ratio(7, 0.0, 0.0, 10), distance).any()
    valid = jnp.ones((3, 30), bool)
    assert not glancing.positions(jax.random.PRNGKey(0), valid, jnp.zeros(3, int)).any()
