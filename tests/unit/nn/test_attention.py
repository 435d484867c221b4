"""The attention core against a float64 NumPy reference, and the mask helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.nn import attention, masks

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
    mask = masks.cross_mask(_source_tokens() != 0, 5) if masked else None
    out, weights = attention.batched_attention(q, k, v, mask)
    ref_out, ref_w = reference_attention(q, k, v, None if mask is None else np.asarray(mask))
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(weights, ref_w, atol=1e-6)
    if masked:
        assert np.all(np.asarray(weights)[0, :, :, 4:] == 0.0)  # pad columns exactly 0


@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_matches_reference(masked):
    q, k, v = _qkv(1, t=7)
    mask = masks.decoder_mask(_source_tokens() != 0) if masked else None
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
    _, w = attention.batched_attention(q * 3.0, k, v, masks.decoder_mask(tokens != 0))
    w = np.asarray(w)
    upper = np.triu(np.ones((6, 6), bool), k=1)
    assert np.all(w[..., upper] == 0.0)
    assert np.all(w[..., ~upper] > 0.0)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)


def test_masks_from_validity():
    dec = jnp.array([[2, 5, 6, 0]])
    enc = jnp.array([[7, 0, 0]])
    np.testing.assert_array_equal(masks.causal_mask(3), np.tril(np.ones((3, 3), bool)))
    self_mask = np.asarray(masks.decoder_mask(dec != 0))[0]
    expected = np.tril(np.ones((4, 4), bool))
    expected[:, 3] = False  # pad key column
    np.testing.assert_array_equal(self_mask, expected)
    cross = np.asarray(masks.cross_mask(enc != 0, dec.shape[1]))
    assert cross.shape == (1, 4, 3)  # N_dec x N_enc
    np.testing.assert_array_equal(cross[0], np.array([[True, False, False]] * 4))


def _random_params(params, seed):
    """Every parameter (biases too, which init to zero) replaced by a random draw."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=v.shape) * 0.5, jnp.float32) for k, v in params.items()}


@pytest.mark.parametrize("self_attention", [False, True])
def test_multihead_module_output_projection_and_d_kv(self_attention):
    """The module equals the §3.2.2 formula in float64 from its own parameters:
    per head softmax(Q K^T / sqrt(d_kv)) V, heads concatenated, times W_O plus bias,
    with d_kv = 5 != d_model / num_heads = 4."""
    d, n, h = 12, 3, 5
    cfg = TransformerConfig(vocab_size=10, d_model=d, num_heads=n, d_kv=h, d_ff=8, dropout_rate=0.0)
    mha = attention.MultiHeadAttention(cfg, self_attention=self_attention, capture=True)
    rng = np.random.default_rng(4)
    t, s = 4, (4 if self_attention else 6)
    x = jnp.asarray(rng.normal(size=(2, t, d)), jnp.float32)
    y = None if self_attention else jnp.asarray(rng.normal(size=(2, s, d)), jnp.float32)
    keys = jnp.array([[5, 6, 7, 0, 0, 0][:s], [4] * s])  # row 0 has padded key columns
    mask = masks.padding_mask(keys != 0, t)
    init = mha.init(jax.random.PRNGKey(0), x, mask, deterministic=True, inputs_kv=y)["params"]
    params = _random_params(nn.meta.unbox(init), 5)
    shapes = {k: v.shape for k, v in params.items()}
    if self_attention:
        assert shapes["qkv_kernel"] == (d, 3, n, h)
    else:
        assert shapes["q_kernel"] == (d, n, h) and shapes["kv_kernel"] == (d, 2, n, h)
    assert shapes["out_kernel"] == (n, h, d)
    (out, cache), sown = mha.apply(
        {"params": params}, x, mask, deterministic=True, inputs_kv=y, mutable="intermediates"
    )
    assert cache is None
    weights = sown["intermediates"]["attention_weights"][0]

    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    xq = np.asarray(x, np.float64)
    xkv = xq if self_attention else np.asarray(y, np.float64)
    if self_attention:
        wq, wk, wv = (p["qkv_kernel"][:, i] for i in range(3))  # each [D, N, H]
        bq, bk, bv = p["qkv_bias"]
    else:
        wq, bq = p["q_kernel"], p["q_bias"]
        wk, wv = p["kv_kernel"][:, 0], p["kv_kernel"][:, 1]
        bk, bv = p["kv_bias"]
    m = np.asarray(mask)
    want = np.zeros((2, t, d))
    for b in range(2):
        heads = []
        for i in range(n):
            q = xq[b] @ wq[:, i] + bq[i]  # [T, H]
            k = xkv[b] @ wk[:, i] + bk[i]  # [S, H]
            v = xkv[b] @ wv[:, i] + bv[i]
            scores = np.where(m[b], q @ k.T / np.sqrt(h), -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            np.testing.assert_allclose(weights[b, i], w, atol=1e-5)
            heads.append(w @ v)
        concat = np.concatenate(heads, axis=-1)  # [T, N*H]
        want[b] = concat @ p["out_kernel"].reshape(n * h, d) + p["out_bias"]
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)


def test_fast_and_vmap_gradients_agree_with_masked_key_columns():
    """Gradients of fast and per-head attention, w.r.t. q, k, v and a module's
    parameters, with whole key columns masked (their k, v gradients exactly 0)."""
    q, k, v = _qkv(6, t=7)
    tokens = _source_tokens()  # row 0: columns 4..6 are padding
    mask = masks.decoder_mask(tokens != 0)
    cot = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

    def loss_vmap(q, k, v):
        return jnp.sum(attention.batched_attention(q, k, v, mask)[0] * cot)

    def loss_fast(q, k, v):
        return jnp.sum(attention.fast_attention(q, k, v, mask) * cot)

    want = jax.grad(loss_vmap, argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss_fast, argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)
    for g in (got[1], got[2], want[1], want[2]):
        assert np.all(np.asarray(g)[0, 4:] == 0.0)  # masked keys get no gradient
    assert np.abs(np.asarray(want[1])[0, :4]).max() > 1e-3  # the rest do

    cfg = TransformerConfig(vocab_size=10, d_model=12, num_heads=3, d_ff=8, dropout_rate=0.0)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, 7, 12)), jnp.float32)
    mods = {
        impl: attention.MultiHeadAttention(cfg.replace(attention_impl=impl), True)
        for impl in ("vmap", "fast")
    }
    init = mods["vmap"].init(jax.random.PRNGKey(0), x, mask, deterministic=True)["params"]
    params = _random_params(nn.meta.unbox(init), 9)

    def module_loss(impl):
        def f(params, x):
            out = mods[impl].apply({"params": params}, x, mask, deterministic=True)[0]
            return jnp.sum(out * x)

        return jax.grad(f, argnums=(0, 1))(params, x)

    (gp_fast, gx_fast), (gp_vmap, gx_vmap) = module_loss("fast"), module_loss("vmap")
    np.testing.assert_allclose(gx_fast, gx_vmap, atol=1e-5, rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(gp_fast[name], gp_vmap[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_cache_mask_rows_are_the_causal_rows_of_the_full_pass():
    """Cached decoding at positions p..p+t sees exactly the causal rows p..p+t of the
    teacher-forced mask (and never the empty slots beyond them)."""
    full = np.asarray(masks.decoder_mask(jnp.ones((1, 8), bool)))[0]  # [8, 8]
    for start, count in ((0, 1), (3, 1), (2, 4)):
        cached = np.asarray(masks.cache_mask(start + jnp.arange(count), 8, 1))[0]  # [T, L]
        np.testing.assert_array_equal(cached, full[start : start + count])


def test_packed_masks_are_the_conjunction_of_padding_causality_and_segments():
    src_seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    tgt_seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    m = masks.seq2seq_masks(src_seg != 0, tgt_seg != 0, src_seg, tgt_seg)
    s, t = np.asarray(src_seg[0]), np.asarray(tgt_seg[0])
    same = lambda a, b: (a[:, None] == b[None, :]) & (b[None, :] != 0)  # noqa: E731
    np.testing.assert_array_equal(m.encoder[0], same(s, s))
    np.testing.assert_array_equal(m.decoder[0], same(t, t) & np.tril(np.ones((6, 6), bool)))
    np.testing.assert_array_equal(m.cross[0], same(t, s))
    assert m.cross.shape == (1, 6, 6)
