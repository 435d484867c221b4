"""Dropout masks: keep rate, scaling, independence, and flax's dropout as the reference."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.nn import dropout

SHAPE = (64, 128, 128)  # 1M elements: the keep rate is known to ~0.0003 (1 sigma)


def _mask(seed: int, rate: float, rng: str = "hash", shape=SHAPE) -> np.ndarray:
    return np.asarray(dropout.keep_mask(jax.random.PRNGKey(seed), rate, shape, rng))


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_keep_rate(rate):
    keep = _mask(0, rate)
    sigma = np.sqrt(rate * (1 - rate) / keep.size)
    assert abs(keep.mean() - (1 - rate)) < 5 * sigma


def test_hash_bits_are_uniform():
    bits = np.asarray(dropout.hash_bits(jax.random.PRNGKey(1), (1 << 20,)))
    # each of the 32 bit positions is set half the time
    per_bit = np.array([((bits >> b) & 1).mean() for b in range(32)])
    assert np.abs(per_bit - 0.5).max() < 5 * 0.5 / np.sqrt(bits.size)
    # the low byte is uniform over 256 values (chi-square, 255 dof: mean 255, sd 22.6)
    counts = np.bincount(bits & 0xFF, minlength=256)
    expected = bits.size / 256
    assert ((counts - expected) ** 2 / expected).sum() < 255 + 6 * 22.6


def test_masks_are_uncorrelated_across_elements_and_keys():
    rate = 0.3
    a = _mask(0, rate).astype(np.float64)
    b = _mask(1, rate).astype(np.float64)
    limit = 5 / np.sqrt(a.size)  # 5 sigma for the correlation of independent masks

    def corr(x, y):
        return np.corrcoef(x.ravel(), y.ravel())[0, 1]

    assert abs(corr(a, b)) < limit  # two keys
    flat = a.ravel()
    for lag in (1, 2, 128, 128 * 128):  # neighbours, next row, next matrix
        assert abs(corr(flat[:-lag], flat[lag:])) < limit
    # Keys whose first words differ by d = 1: one hash round would give key 2
    # the bits of key 1 at index i ^ 1 (a permuted copy); two rounds do not.
    index = jnp.arange(1 << 20, dtype=jnp.uint32)
    one_a = np.asarray(dropout.mix32(index ^ jnp.uint32(12345)))
    one_b = np.asarray(dropout.mix32((index ^ 1) ^ jnp.uint32(12345 ^ 1)))
    assert np.array_equal(one_a, one_b)
    two_a = np.asarray(dropout.keyed_hash(index, jnp.uint32(12345), jnp.uint32(777)))
    two_b = np.asarray(dropout.keyed_hash(index ^ 1, jnp.uint32(12345 ^ 1), jnp.uint32(778)))
    assert (two_a == two_b).mean() < 1e-4


def test_same_key_same_mask_and_fusion_does_not_change_it():
    eager = _mask(7, 0.2, shape=(3, 5, 8))
    jitted = jax.jit(lambda k: dropout.keep_mask(k, 0.2, (3, 5, 8), "hash"))(jax.random.PRNGKey(7))
    np.testing.assert_array_equal(eager, np.asarray(jitted))
    assert not np.array_equal(eager, _mask(8, 0.2, shape=(3, 5, 8)))


@pytest.mark.parametrize("rng", ["hash", "threefry"])
def test_dropout_scales_kept_values_and_zeroes_the_rest(rng):
    x = jnp.asarray(np.random.default_rng(0).uniform(1.0, 2.0, size=(32, 64)), jnp.float32)
    layer = dropout.Dropout(0.25, rng)
    y = np.asarray(layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)}))
    kept = y != 0.0
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
    assert 0.6 < kept.mean() < 0.9
    assert layer.apply({}, x, deterministic=True) is x
    assert dropout.Dropout(0.0, rng).apply({}, x, deterministic=False) is x


def test_threefry_option_is_flax_dropout():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 32)), jnp.float32)
    rngs = {"dropout": jax.random.PRNGKey(3)}
    ours = dropout.Dropout(0.1, "threefry").apply({}, x, deterministic=False, rngs=rngs)
    flax_ = nn.Dropout(0.1).apply({}, x, deterministic=False, rngs=rngs)
    np.testing.assert_allclose(ours, flax_, rtol=1e-6)


def test_two_layers_in_one_model_draw_different_masks():
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return (
                dropout.Dropout(0.5)(x, deterministic=False),
                dropout.Dropout(0.5)(x, deterministic=False),
            )

    a, b = Two().apply({}, jnp.ones((64, 64)), rngs={"dropout": jax.random.PRNGKey(0)})
    assert 0.35 < float(jnp.mean((a == 0) == (b == 0))) < 0.65


def test_unknown_generator_is_a_config_error():
    with pytest.raises(ConfigError, match="dropout_rng"):
        TransformerConfig(dropout_rng="philox")
