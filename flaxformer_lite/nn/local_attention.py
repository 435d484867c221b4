"""Restricted (local) self-attention in O(n * r) time and memory (Vaswani et al. 2017, Table 1).

With window r, encoder query i attends keys j with |i - j| <= r and causal
decoder query i attends i - r <= j <= i. The length n is padded up to a
multiple of the block size c = min(r, n) and cut into K = n / c chunks; chunk k's
queries attend only to the keys of chunks k - 1, k and (encoder) k + 1: with
c = r those 3c (causal: 2c) keys hold every key of the band (with c = n < r
the one chunk holds them all) and the band mask
within them removes the rest. Scores are then float32[B, N, K, c, W] with
W = 3c (2c), never [T, S]: the sizes grow linearly with n.

Masking is exactly that of the dense core (`attention.py`): band AND key
validity (AND same segment for packed rows), finfo.min before a float32
softmax, so masked weights are exactly 0.0. A query whose window holds no
valid key (a padded position far from real input) spreads its weight over
its W slots; such rows are never read, as with the dense masks.

Letter legend as in `nn/attention.py`, plus K chunks, C block size (queries
per chunk) and W keys per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.nn.precision import dot_f32


def block_size(length: int, window: int) -> int:
    """C = r: the band of a chunk lies within it and its neighbours; n when shorter."""
    return max(1, min(window, length))


def _chunk(x: jax.Array, block: int, num_chunks: int, fill) -> jax.Array:
    """[B, n, ...] -> [B, K, C, ...], padding the tail with `fill`."""
    pad = num_chunks * block - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x.reshape(x.shape[0], num_chunks, block, *x.shape[2:])


def _neighbours(x: jax.Array, block: int, num_chunks: int, causal: bool, fill) -> jax.Array:
    """Each chunk's keys: [B, n, ...] -> [B, K, W, ...], W = 2C (causal) or 3C.

    Chunk k gets the positions [(k - 1) C, (k + 1) C) or [(k - 1) C, (k + 2) C);
    positions outside [0, n) hold `fill`.
    """
    chunks = _chunk(x, block, num_chunks, fill)  # [B, K, C, ...]
    pad = [(0, 0), (1, 1)] + [(0, 0)] * (chunks.ndim - 2)
    chunks = jnp.pad(chunks, pad, constant_values=fill)  # [B, K + 2, C, ...]
    offsets = (0, 1) if causal else (0, 1, 2)
    views = [chunks[:, o : o + num_chunks] for o in offsets]  # each [B, K, C, ...]
    return jnp.concatenate(views, axis=2)  # [B, K, W, ...]


def positions(length: int, window: int, causal: bool) -> tuple[jax.Array, jax.Array]:
    """Absolute positions of the blocked layout: (queries int32[K, C], keys int32[K, W]).

    Key positions may fall outside [0, length) (before the first or after the
    last chunk); those slots hold padding.
    """
    block = block_size(length, window)
    num_chunks = -(-length // block)
    chunk_start = jnp.arange(num_chunks, dtype=jnp.int32)[:, None] * block  # [K, 1]
    width = (2 if causal else 3) * block
    query_pos = chunk_start + jnp.arange(block, dtype=jnp.int32)[None, :]  # [K, C]
    key_pos = chunk_start - block + jnp.arange(width, dtype=jnp.int32)[None, :]  # [K, W]
    return query_pos, key_pos


def band(window: int, causal: bool, length: int) -> jax.Array:
    """The band within the blocked layout: bool[K, C, W] (True = inside the window)."""
    query_pos, key_pos = positions(length, window, causal)
    offset = query_pos[:, :, None] - key_pos[:, None, :]  # [K, C, W]: i - j
    if causal:
        return (offset >= 0) & (offset <= window)
    return jnp.abs(offset) <= window


def blocked_mask(
    valid: jax.Array, segments: jax.Array | None, window: int, causal: bool
) -> jax.Array:
    """Band AND key validity (AND same segment): bool[B, K, C, W].

    Args:
      valid: bool[B, n], True at real positions.
      segments: int[B, n] (1, 2, ... per packed example, 0 = padding) or None.
    """
    length = valid.shape[1]
    block = block_size(length, window)
    num_chunks = -(-length // block)
    key_valid = _neighbours(valid, block, num_chunks, causal, False)  # [B, K, W]
    mask = band(window, causal, length)[None] & key_valid[:, :, None, :]  # [B, K, C, W]
    if segments is not None:
        query_seg = _chunk(segments, block, num_chunks, 0)  # [B, K, C]
        key_seg = _neighbours(segments, block, num_chunks, causal, 0)  # [B, K, W]
        same = query_seg[:, :, :, None] == key_seg[:, :, None, :]
        mask = mask & same & (key_seg[:, :, None, :] != 0)
    return mask


def local_weights(
    q: jax.Array, k: jax.Array, mask: jax.Array, window: int, causal: bool
) -> jax.Array:
    """The blocked attention probabilities: float32[B, N, K, C, W].

    Args:
      q, k: [B, n, N, H].
      mask: bool[B, K, C, W] (`blocked_mask`).
    """
    length = q.shape[1]
    block = block_size(length, window)
    num_chunks = -(-length // block)
    qc = _chunk(q, block, num_chunks, 0)  # [B, K, C, N, H]
    kc = _neighbours(k, block, num_chunks, causal, 0)  # [B, K, W, N, H]
    scores = dot_f32("bkcnh,bkwnh->bnkcw", qc, kc)  # float32; bf16 backward (precision.py)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)  # float32 [B, N, K, C, W]


def local_combine(weights: jax.Array, v: jax.Array, window: int, causal: bool) -> jax.Array:
    """Weights float32[B, N, K, C, W] x values [B, n, N, H] -> [B, n, N, H] in v's dtype."""
    length = v.shape[1]
    block = block_size(length, window)
    num_chunks = weights.shape[2]
    vc = _neighbours(v, block, num_chunks, causal, 0)  # [B, K, W, N, H]
    out = jnp.einsum("bnkcw,bkwnh->bkcnh", weights.astype(v.dtype), vc)
    out = out.reshape(out.shape[0], num_chunks * block, *out.shape[3:])  # [B, K*C, N, H]
    return out[:, :length]


def local_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
    segments: jax.Array | None,
    window: int,
    causal: bool,
) -> tuple[jax.Array, jax.Array]:
    """Banded self-attention.

    Args:
      q, k, v: [B, n, N, H] (self-attention: one length n).
      valid: bool[B, n] key validity; segments: int[B, n] or None.
      window: r >= 1 (the block size C = min(r, n)).
      causal: the decoder's band i - r <= j <= i instead of |i - j| <= r.
    Returns:
      (out [B, n, N, H], weights float32[B, N, K, C, W]).
    """
    mask = blocked_mask(valid, segments, window, causal)
    weights = local_weights(q, k, mask, window, causal)
    return local_combine(weights, v, window, causal), weights


def to_dense(weights: jax.Array, length: int, window: int, causal: bool) -> jax.Array:
    """Scatters blocked weights float32[B, N, K, C, W] into float32[B, N, n, n].

    O(n^2): for reading attention maps only (`capture`). Slots outside [0, n)
    are dropped; the band's weights land at (query, key) positions.
    """
    query_pos, key_pos = positions(length, window, causal)
    (num_chunks, block), width = query_pos.shape, key_pos.shape[1]
    padded = num_chunks * block
    q_idx = jnp.broadcast_to(query_pos[:, :, None], (num_chunks, block, width))
    k_idx = jnp.broadcast_to(key_pos[:, None, :], (num_chunks, block, width)) + block
    batch, heads = weights.shape[:2]
    dense = jnp.zeros((batch, heads, padded, padded + 2 * block), jnp.float32)
    dense = dense.at[:, :, q_idx, k_idx].set(weights)  # keys shifted by C: none negative
    return dense[:, :, :length, block : block + length]
