"""Every attention mask of the project, built from validity arrays and positions.

Masks are boolean, True where a query may attend to a key, and are built
once per forward pass (`models/transformer.py`'s `encoder_masks` and
`decoder_masks`, `Decoder.step`) and passed down to the layers; nothing
below this module looks at token ids to decide what to attend to.

Validity is a property of keys: a padded key column is hidden from every
query. A padded query row still attends to the valid keys (its output is
never read: padded keys are hidden and padded targets carry no loss), so
no row is ever fully masked unless a whole sequence is padding.

With a window (`config.encoder_window`, `config.decoder_window`) a
self-attention mask is a `LocalMask` instead: the validity (and segments)
from which the blocked kernel (`local_attention.py`) builds its band mask
chunk by chunk, since a dense [B, T, T] mask would itself be O(n^2).

Shapes: B batch, T query length, S key length, L decoder cache length.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def padding_mask(key_valid: jax.Array, query_len: int) -> jax.Array:
    """Hides padded key columns.

    Args:
      key_valid: bool[B, S], True at real positions.
      query_len: T.
    Returns:
      bool[B, T, S].
    """
    batch, length = key_valid.shape
    return jnp.broadcast_to(key_valid[:, None, :], (batch, query_len, length))


def causal_mask(length: int) -> jax.Array:
    """Lower-triangular mask: position t attends to positions <= t. bool[length, length]."""
    return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """Packed rows: a query attends only to keys of its own example.

    Args:
      query_segments: int[B, T], 1, 2, ... per packed example, 0 = padding.
      key_segments: int[B, S], same numbering.
    Returns:
      bool[B, T, S].
    """
    same = query_segments[:, :, None] == key_segments[:, None, :]
    return same & (key_segments[:, None, :] != 0)


class LocalMask(NamedTuple):
    """Self-attention within a window, in place of a dense mask (`local_attention.py`).

    Query i attends key j when |i - j| <= window (causal: i - window <= j <= i),
    the key is valid and, for packed rows, of the same segment.
    """

    valid: jax.Array  # bool[B, T] key validity
    segments: jax.Array | None  # int[B, T] packed examples (0 = padding) or None
    window: int  # r >= 1 (a Python int: the block size of the kernel)
    causal: bool


class AttentionMask(NamedTuple):
    """A teacher-forced attention's mask as structure, which fused kernels take directly.

    cuDNN flash attention takes the causal flag, key lengths and a causal window;
    Pallas splash attention takes a static causal/local pattern and segment ids for
    padding and packing (`nn/kernels.py`). The XLA path materialises `dense()` (or, with a
    window, runs the blocked kernel through `local()`). Rows are right-padded: a row's
    valid keys are a prefix, so `key_valid` is also a length; packed rows (several
    examples per row, numbered 1, 2, ... with 0 for padding) carry segments.

    Query i attends key j when: key j is valid; (causal) j <= i; (window r > 0) |i - j|
    <= r, or i - r <= j <= i when causal; (segments) both hold the same example.
    """

    key_valid: jax.Array  # bool[B, S]
    query_len: int  # T
    causal: bool = False
    window: int = 0  # > 0: a band of this radius (self-attention only)
    query_segments: jax.Array | None = None  # int[B, T], packed rows only
    key_segments: jax.Array | None = None  # int[B, S], packed rows only

    @property
    def packed(self) -> bool:
        return self.key_segments is not None

    def dense(self) -> jax.Array:
        """bool[B, T, S], True where a query may attend a key."""
        t, s = self.query_len, self.key_valid.shape[1]
        mask = padding_mask(self.key_valid, t)
        if self.causal or self.window:
            i = jnp.arange(t)[:, None]
            j = jnp.arange(s)[None, :]
            band = j <= i if self.causal else jnp.ones((t, s), jnp.bool_)
            if self.window:
                band = band & (j >= i - self.window) & (self.causal | (j <= i + self.window))
            mask = mask & band
        if self.packed:
            mask = mask & segment_mask(self.query_segments, self.key_segments)
        return mask

    def local(self) -> LocalMask:
        """The blocked kernel's mask (`local_attention.py`) of a windowed self-attention."""
        if not self.window or self.query_len != self.key_valid.shape[1]:
            raise ValueError("local() is for windowed self-attention")
        return LocalMask(self.key_valid, self.key_segments, self.window, self.causal)


def self_attention(
    valid: jax.Array, segments: jax.Array | None = None, *, causal: bool, window: int = 0
) -> AttentionMask:
    """An encoder's (causal=False) or a decoder's (causal=True) self-attention mask, from
    the validity bool[B, T] (and segments int[B, T] of packed rows)."""
    return AttentionMask(valid, valid.shape[1], causal, window, segments, segments)


def cross_attention(
    source_valid: jax.Array,
    target_len: int,
    target_segments: jax.Array | None = None,
    source_segments: jax.Array | None = None,
) -> AttentionMask:
    """Decoder queries x encoder keys: source padding (and segments of packed rows)."""
    return AttentionMask(source_valid, target_len, False, 0, target_segments, source_segments)


def dense(mask: jax.Array | AttentionMask | None) -> jax.Array | None:
    """bool[B, T, S] of a dense or structured mask (None stays None)."""
    return mask.dense() if isinstance(mask, AttentionMask) else mask


def cache_mask(positions: jax.Array, cache_len: int, batch: int, window: int = 0) -> jax.Array:
    """Cached decoding: query t (at absolute position positions[t]) sees cache slots <= it.

    Causal over the prefix and within a block of new tokens, and never the
    empty slots beyond the last written one.

    Args:
      positions: int32[T] absolute positions of the new tokens, shared by the rows, or
        int32[B, T], each row at its own position (rows of a continuous batch).
      window: > 0: also hide slots more than `window` positions back (the decoder's band).
    Returns:
      bool[B, T, L].
    """
    slots = jnp.arange(cache_len)  # [L]
    mask = slots <= positions[..., None]  # [T, L] or [B, T, L]
    if window:
        mask = mask & (slots >= positions[..., None] - window)
    return jnp.broadcast_to(mask, (batch, *mask.shape[-2:]))


class Masks(NamedTuple):
    """The masks of one teacher-forced encoder-decoder pass."""

    encoder: jax.Array | LocalMask  # bool[B, S, S] encoder self-attention
    decoder: jax.Array | LocalMask  # bool[B, T, T] decoder self-attention (causal)
    cross: jax.Array  # bool[B, T, S] decoder queries x encoder keys


def encoder_mask(
    source_valid: jax.Array, source_segments: jax.Array | None = None, window: int = 0
) -> jax.Array | LocalMask:
    """Encoder self-attention: padding (and segments of packed rows). bool[B, S, S],
    or with a window > 0 the `LocalMask` |i - j| <= window."""
    if window:
        return LocalMask(source_valid, source_segments, window, causal=False)
    mask = padding_mask(source_valid, source_valid.shape[1])
    if source_segments is not None:
        mask = mask & segment_mask(source_segments, source_segments)
    return mask


def decoder_mask(
    target_valid: jax.Array, target_segments: jax.Array | None = None, window: int = 0
) -> jax.Array | LocalMask:
    """Decoder self-attention: causal AND padding (AND segments). bool[B, T, T],
    or with a window > 0 the `LocalMask` i - window <= j <= i."""
    if window:
        return LocalMask(target_valid, target_segments, window, causal=True)
    mask = padding_mask(target_valid, target_valid.shape[1]) & causal_mask(target_valid.shape[1])
    if target_segments is not None:
        mask = mask & segment_mask(target_segments, target_segments)
    return mask


def cross_mask(
    source_valid: jax.Array,
    target_len: int,
    target_segments: jax.Array | None = None,
    source_segments: jax.Array | None = None,
) -> jax.Array:
    """Decoder queries x encoder keys: source padding (and segments). bool[B, T, S]."""
    mask = padding_mask(source_valid, target_len)
    if target_segments is not None:
        mask = mask & segment_mask(target_segments, source_segments)
    return mask


def seq2seq_masks(
    source_valid: jax.Array,
    target_valid: jax.Array,
    source_segments: jax.Array | None = None,
    target_segments: jax.Array | None = None,
    encoder_window: int = 0,
    decoder_window: int = 0,
) -> Masks:
    """All three masks of a teacher-forced pass (segments: both or neither; windows as in
    `encoder_mask`, `decoder_mask`)."""
    return Masks(
        encoder=encoder_mask(source_valid, source_segments, encoder_window),
        decoder=decoder_mask(target_valid, target_segments, decoder_window),
        cross=cross_mask(source_valid, target_valid.shape[1], target_segments, source_segments),
    )
