"""CTC decoding: the jitted collapse against plain Python, on hand-made and random paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.search import ctc_collapse

BLANK, PAD = 0, 0


def reference(symbols, length, width):
    """Plain Python: merge each run of equal symbols, drop blanks, keep `width` tokens."""
    out, previous = [], None
    for s in symbols[:length]:
        if s != previous and s != BLANK:
            out.append(int(s))
        previous = s
    return out[:width]


def test_collapse_of_hand_made_paths():
    symbols = jnp.array(
        [
            [5, 5, 0, 5, 6, 6, 0, 7],  # "5 5 _ 5 6 6 _ 7": the blank keeps the second 5
            [0, 0, 4, 4, 4, 0, 0, 0],
            [9, 8, 9, 8, 3, 3, 3, 3],  # the last four are padding
        ]
    )
    valid = jnp.arange(8)[None, :] < jnp.array([[8], [8], [4]])
    tokens, lengths = ctc_collapse.collapse(symbols, valid, blank_id=BLANK, pad_id=PAD, width=5)
    np.testing.assert_array_equal(tokens, [[5, 5, 6, 7, 0], [4, 0, 0, 0, 0], [9, 8, 9, 8, 0]])
    np.testing.assert_array_equal(lengths, [4, 1, 4])


@pytest.mark.parametrize("width", [3, 12])
def test_collapse_equals_plain_python_on_random_paths(width):
    rng = np.random.default_rng(width)
    # Few symbols, so that repeats and blanks are frequent.
    symbols = rng.integers(0, 4, size=(64, 12))
    lengths = rng.integers(0, 13, size=64)
    valid = np.arange(12)[None, :] < lengths[:, None]
    fn = jax.jit(ctc_collapse.collapse, static_argnames=("blank_id", "pad_id", "width"))
    tokens, counts = fn(
        jnp.asarray(symbols), jnp.asarray(valid), blank_id=BLANK, pad_id=PAD, width=width
    )
    for row in range(64):
        want = reference(symbols[row], lengths[row], width)
        assert int(counts[row]) == len(want)
        np.testing.assert_array_equal(tokens[row], want + [PAD] * (width - len(want)))


def test_best_path_takes_the_argmax_of_every_position():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 9, 5)) * 3, jnp.float32)
    valid = jnp.arange(9)[None, :] < jnp.array([[9], [5], [1], [0]])
    tokens, lengths, score = ctc_collapse.best_path(
        logits, valid, blank_id=BLANK, pad_id=PAD, width=9
    )
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    for row, n in enumerate([9, 5, 1, 0]):
        want = reference(log_probs[row].argmax(-1), n, 9)
        np.testing.assert_array_equal(tokens[row, : len(want)], want)
        assert int(lengths[row]) == len(want)
        np.testing.assert_allclose(score[row], log_probs[row, :n].max(-1).sum(), rtol=1e-5)
