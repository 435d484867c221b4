"""search/primitives.py: the blocked top-k against `lax.top_k`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.search.primitives import NEG_INF, TOP_K_BLOCK, top_k


@pytest.mark.parametrize(
    "shape, k",
    [((3, 4, 8000), 8), ((2, 8000), 2), ((5, 1000), 16), ((2, 3, 517), 8), ((4, 300), 2)],
)
def test_blocked_top_k_gives_lax_top_k_values_and_indices(shape, k):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    want = jax.lax.top_k(x, k)
    got = jax.jit(top_k, static_argnums=1)(x, k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_ties_masked_entries_and_padding_go_as_in_lax_top_k():
    """Equal values in several blocks (the lowest index first), rows of NEG_INF (masked
    tokens) and a row length that is no multiple of the block: indices as lax.top_k's."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (6, 20 * TOP_K_BLOCK + 7)).astype(np.float32)  # many ties
    x[1] = NEG_INF
    x[2, ::3] = NEG_INF
    for k in (1, 4, 8):
        want = jax.lax.top_k(jnp.asarray(x), k)
        got = top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
