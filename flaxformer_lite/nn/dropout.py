"""Dropout (Srivastava et al. 2014) with a choice of random-bit generator.

`Dropout` keeps each element with probability 1 - rate and scales the kept
ones by 1 / (1 - rate), exactly as `flax.linen.Dropout`. Two generators:

  "hash"     (default) Each element's 32 random bits are a keyed integer
             hash of its flat index: two rounds of the lowbias32 mixer, keyed
             by two 32-bit words drawn from the layer's "dropout" PRNG key.
             The bits are a pure elementwise function of (key, index), so XLA
             fuses them into the multiply that applies the mask; no mask
             array is written to memory (docs/results.md: the measured gain).
  "threefry" `jax.random.bernoulli` on the layer's key (flax's own dropout):
             counter-based Threefry-2x32, the reference generator.

Both are deterministic functions of the PRNG key, so a resumed run draws the
same masks as an uninterrupted one. The hash generator is a dropout mask, not
a cryptographic or general-purpose generator: its tests check the keep rate,
the independence of neighbouring elements, of different keys and of
different layers.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config.model import DROPOUT_RNGS


def mix32(x: jax.Array) -> jax.Array:
    """lowbias32 (C. Wellons): a bijective uint32 -> uint32 mixer with low bias."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32[shape] random bits: a keyed hash of each element's flat index.

    Args:
      key: a JAX PRNG key; only two uint32 words drawn from it are used.
    """
    k0, k1 = jax.random.bits(key, (2,), jnp.uint32)
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(f"hash dropout indexes elements with uint32; {shape} has {size}")
    return keyed_hash(jax.lax.iota(jnp.uint32, size).reshape(shape), k0, k1)


def keyed_hash(index: jax.Array, k0: jax.Array, k1: jax.Array) -> jax.Array:
    """mix32(mix32(index ^ k0) ^ k1), elementwise on uint32.

    Two keyed rounds: with one, mix32(index ^ k0), any two keys k0 and k0 ^ d
    give the same bits at indices i and i ^ d, i.e. one mask permuted; with
    the second round that needs the second words to coincide as well.
    """
    return mix32(mix32(index ^ k0) ^ k1)


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...], rng: str) -> jax.Array:
    """bool[shape], True with probability 1 - rate (to within 2^-32 for "hash")."""
    if rng == "threefry":
        return jax.random.bernoulli(key, 1.0 - rate, shape)
    if rng != "hash":
        raise ValueError(f"dropout rng {rng!r} is not one of {', '.join(DROPOUT_RNGS)}")
    threshold = min(round(rate * 2**32), 2**32 - 1)
    return hash_bits(key, shape) >= jnp.uint32(threshold)


KEYS = "dropout_keys"  # collection of explicit keys, {"key": key} per Dropout module


class Dropout(nn.Module):
    """Inverted dropout drawing its key from the "dropout" PRNG stream.

    Same contract as `flax.linen.Dropout`: identity when `deterministic` or
    `rate` is 0; otherwise kept elements are scaled by 1 / (1 - rate).
    """

    rate: float
    rng: str = "hash"

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: any shape, returned with the same shape and dtype."""
        if deterministic or self.rate == 0.0:
            return x
        # A layer run inside a scan gets the key it would draw unrolled (models/blocks.py).
        if self.has_variable(KEYS, "key"):
            key = self.get_variable(KEYS, "key")
        else:
            key = self.make_rng("dropout")
        keep = keep_mask(key, self.rate, x.shape, self.rng)
        scale = jnp.asarray(1.0 / (1.0 - self.rate), x.dtype)
        return jnp.where(keep, x * scale, jnp.zeros_like(x))
