"""The attention core against a float64 NumPy reference, and the mask helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn import attention

jax.config.update("jax_default_matmul_precision", "highest")


def reference_attention(q, k, v, mask):
    """softmax(QK^T / sqrt(d_k)) V in float64, one batch x head loop at a time.

    q: [B, T, N, H], k/v: [B, S, N, H], mask: bool[B, T, S] or None.
    Returns out [B, T, N, H], weights [B, N, T, S].
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    s = k.shape[1]
    out = np.zeros((b, t, n, v.shape[-1]))
    weights = np.zeros((b, n, t, s))
    for bi in range(b):
        for ni in range(n):
            scores = q[bi, :, ni] @ k[bi, :, ni].T / np.sqrt(h)
            if mask is not None:
                scores = np.where(np.asarray(mask[bi]), scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            w = np.exp(scores)
            w = w / w.sum(axis=-1, keepdims=True)
            weights[bi, ni] = w
            out[bi, :, ni] = w @ v[bi, :, ni]
    return out, weights


def _qkv(seed, b=2, t=5, s=7, n=3, h=4):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(b, t, n, h)).astype(np.float32),
        rng.normal(size=(b, s, n, h)).astype(np.float32),
        rng.normal(size=(b, s, n, h)).astype(np.float32),
    )


def _source_tokens():
    # Two sources of length 7: the first has 3 pad columns, the second none.
    return jnp.array([[5, 6, 7, 8, 0, 0, 0], [4, 4, 4, 4, 4, 4, 4]])


@pytest.mark.parametrize("masked", [False, True])
def test_vmapped_core_matches_float64_reference(masked):
    q, k, v = _qkv(0)
    mask = attention.cross_mask(jnp.ones((2, 5), jnp.int32), _source_tokens()) if masked else None
    out, weights = attention.batched_attention(q, k, v, mask)
    ref_out, ref_w = reference_attention(q, k, v, None if mask is None else np.asarray(mask))
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(weights, ref_w, atol=1e-6)
    if masked:
        assert np.all(np.asarray(weights)[0, :, :, 4:] == 0.0)  # pad columns exactly 0


@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_matches_reference(masked):
    q, k, v = _qkv(1, t=7)
    mask = attention.decoder_self_mask(_source_tokens()) if masked else None
    out = attention.fast_attention(q, k, v, mask)
    ref_out, _ = reference_attention(q, k, v, None if mask is None else np.asarray(mask))
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)


def test_single_head_core_is_the_formula():
    q, k, v = (x[0, :, 0] for x in _qkv(2))
    out, w = attention.scaled_dot_product_attention(q, k, v, None)
    scores = q.astype(np.float64) @ k.T.astype(np.float64) / 2.0  # sqrt(d_k = 4)
    expected = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    np.testing.assert_allclose(w, expected, atol=1e-6)
    np.testing.assert_allclose(out, expected @ v, atol=1e-5)


def test_causal_weights_exactly_zero_above_diagonal_and_rows_sum_to_one():
    q, k, v = _qkv(3, t=6, s=6)
    tokens = jnp.full((2, 6), 9)
    _, w = attention.batched_attention(q * 3.0, k, v, attention.decoder_self_mask(tokens))
    w = np.asarray(w)
    upper = np.triu(np.ones((6, 6), bool), k=1)
    assert np.all(w[..., upper] == 0.0)
    assert np.all(w[..., ~upper] > 0.0)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)


def test_mask_helpers():
    dec = jnp.array([[2, 5, 6, 0]])
    enc = jnp.array([[7, 0, 0]])
    np.testing.assert_array_equal(attention.causal_mask(3), np.tril(np.ones((3, 3), bool)))
    self_mask = np.asarray(attention.decoder_self_mask(dec))[0]
    expected = np.tril(np.ones((4, 4), bool))
    expected[:, 3] = False  # pad key column
    np.testing.assert_array_equal(self_mask, expected)
    cross = np.asarray(attention.cross_mask(dec, enc))
    assert cross.shape == (1, 4, 3)  # N_dec x N_enc
    np.testing.assert_array_equal(cross[0], np.array([[True, False, False]] * 4))


def test_multihead_module_output_projection_and_d_kv():
    cfg = TransformerConfig(
        vocab_size=10, d_model=12, num_heads=3, d_kv=5, d_ff=8, dropout_rate=0.0
    )
    mha = attention.MultiHeadAttention(cfg, self_attention=False)
    x, y = jnp.ones((2, 4, 12)), jnp.ones((2, 6, 12))
    params = mha.init(jax.random.PRNGKey(0), x, y, None, deterministic=True)["params"]
    shapes = {k: getattr(v, "value", v).shape for k, v in params.items()}
    assert shapes["q_kernel"] == (12, 3, 5)
    assert shapes["kv_kernel"] == (12, 2, 3, 5)
    assert shapes["out_kernel"] == (3, 5, 12)
    out, weights, cache = mha.apply({"params": params}, x, y, None, deterministic=True)
    assert cache is None and weights.shape == (2, 3, 4, 6)
    assert out.shape == (2, 4, 12)
