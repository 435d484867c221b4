"""Model properties: padding and causality, positions, parameter counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.models.transformer import Transformer, shift_right
from flaxformer_lite.nn.layers import Dense, Embed, project, sinusoidal_positions

jax.config.update("jax_default_matmul_precision", "highest")

TINY = TransformerConfig(
    vocab_size=23,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dropout_rate=0.0,
)
SRC = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])  # row 0: 2 pad positions
TGT = jnp.array([[2, 4, 5, 0, 0], [2, 7, 8, 9, 10]])  # row 0: 2 pad positions


def _init(cfg):
    return nn.meta.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), SRC, TGT)["params"])


def _with_pad_row(params, cfg, value):
    """Changes the embedding vector of PAD_ID: the content at every padded position."""
    params = jax.tree.map(lambda x: x, params)
    names = (
        ["shared_embedding"] if cfg.share_embeddings else ["source_embedding", "target_embedding"]
    )
    for name in names:
        table = params[name]["embedding"]
        params[name] = {"embedding": table.at[0].set(value)}
    return params


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("share", [True, False])
def test_content_at_padded_positions_changes_no_real_output(norm, share):
    cfg = TINY.replace(norm=norm, share_embeddings=share, tie_output_embedding=not share)
    params = _init(cfg)
    model = Transformer(cfg)
    other = _with_pad_row(params, cfg, 7.5)
    enc_a = model.apply({"params": params}, SRC, method=Transformer.encode)
    enc_b = model.apply({"params": other}, SRC, method=Transformer.encode)
    assert not np.allclose(enc_a[0, 4:], enc_b[0, 4:])  # the padded positions did change
    np.testing.assert_array_equal(enc_a[0, :4], enc_b[0, :4])
    np.testing.assert_array_equal(enc_a[1], enc_b[1])
    logits_a = np.asarray(model.apply({"params": params}, SRC, TGT))
    logits_b = np.asarray(model.apply({"params": other}, SRC, TGT))
    # Real decoder positions: row 0's first 3, all of row 1. With a tied softmax the PAD
    # row is also the weight of logit 0, so compare the other logits there.
    cols = slice(1, None) if cfg.tie_output_embedding else slice(None)
    np.testing.assert_array_equal(logits_a[0, :3, cols], logits_b[0, :3, cols])
    np.testing.assert_array_equal(logits_a[1, :, cols], logits_b[1, :, cols])


def test_trailing_padding_changes_nothing():
    params = _init(TINY)
    model = Transformer(TINY)
    short = model.apply({"params": params}, SRC[:1, :4], TGT[:1, :3])
    long = model.apply({"params": params}, SRC[:1], TGT[:1])
    np.testing.assert_allclose(short[0], long[0, :3], atol=1e-5)


def test_decoder_is_causal_by_gradient():
    """d logits[t] / d (decoder input embedding at t') == 0 for every t' > t."""
    params = _init(TINY)
    model = Transformer(TINY)
    encoded = model.apply({"params": params}, SRC, method=Transformer.encode)
    table = params["shared_embedding"]["embedding"]
    embedded = jnp.take(table, TGT, axis=0) * math.sqrt(TINY.d_model)  # [B, T, D]

    def per_step_logit_sums(x):
        # Replace the decoder's token embedding by `x`, so the gradient flows to it.
        def intercept(next_fun, args, kwargs, context):
            if context.method_name == "__call__" and isinstance(context.module, Embed):
                return x
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(intercept):
            logits = model.apply({"params": params}, encoded, SRC, TGT, method=Transformer.decode)
        return logits.sum(axis=(0, 2))  # [T]

    jac = np.asarray(jax.jit(jax.jacrev(per_step_logit_sums))(embedded))  # [T, B, T, D]
    for t in range(TGT.shape[1]):
        assert np.all(jac[t, :, t + 1 :] == 0.0), f"step {t} sees the future"
        assert np.any(jac[t, 1, : t + 1] != 0.0)


def _encode_perm(cfg, perm):
    params = _init(cfg)
    model = Transformer(cfg)
    src = SRC[1:]  # no padding
    a = model.apply({"params": params}, src, method=Transformer.encode)
    b = model.apply({"params": params}, src[:, perm], method=Transformer.encode)
    return np.asarray(a[0, perm]), np.asarray(b[0])


def test_encoder_without_positions_is_permutation_equivariant():
    perm = np.array([3, 0, 5, 1, 4, 2])
    a, b = _encode_perm(TINY.replace(positions="none"), perm)
    np.testing.assert_allclose(a, b, atol=1e-5)
    a, b = _encode_perm(TINY, perm)
    assert not np.allclose(a, b, atol=1e-3)


def test_sinusoid_table_is_the_paper_formula():
    d = 10
    table = np.asarray(sinusoidal_positions(jnp.arange(50), d))
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)
    # Any length: a position far past training lengths is still the formula.
    far = np.asarray(sinusoidal_positions(jnp.array([1000]), d))[0]
    assert far[0] == pytest.approx(math.sin(1000.0), abs=1e-3)


def test_shift_right_is_teacher_forcing():
    targets = jnp.array([[7, 8, 3, 0], [9, 3, 0, 0]])
    np.testing.assert_array_equal(shift_right(targets, 2), [[2, 7, 8, 3], [2, 9, 3, 0]])


def test_learned_positions_and_gelu_run():
    cfg = TINY.replace(positions="learned", activation="gelu", max_len=16, norm="pre")
    params = _init(cfg)
    assert params["encoder"]["positions"]["pos_embedding"].shape == (16, 16)
    out = Transformer(cfg).apply({"params": params}, SRC, TGT)
    assert out.shape == (2, 5, 23) and np.all(np.isfinite(out))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"d_model": 30, "num_heads": 4}, "not divisible"),
        ({"norm": "middle"}, "model.norm"),
        ({"dropout_rate": 1.5}, "dropout_rate"),
        ({"num_heads": 0}, "positive integer"),
        ({"target_vocab_size": 9}, "share_embeddings"),
    ],
)
def test_bad_model_config_names_the_field(changes, words):
    with pytest.raises(ConfigError, match=words):
        TINY.replace(**changes)


def test_packed_rows_equal_separate_rows():
    """Two examples packed into one row give the logits (and loss) of two padded rows."""
    from flaxformer_lite.objectives import cross_entropy

    src_a, src_b = [5, 6, 7, 3], [9, 10, 3]
    tgt_a, tgt_b = [11, 12, 3], [13, 14, 15, 3]
    sep_src = jnp.array([src_a + [0] * 3, src_b + [0] * 4])
    sep_tgt = jnp.array([tgt_a + [0] * 4, tgt_b + [0] * 3])
    packed_src = jnp.array([src_a + src_b])
    packed_tgt = jnp.array([tgt_a + tgt_b])
    packing = {
        "inputs_segments": jnp.array([[1] * 4 + [2] * 3]),
        "inputs_positions": jnp.array([list(range(4)) + list(range(3))]),
        "targets_segments": jnp.array([[1] * 3 + [2] * 4]),
        "targets_positions": jnp.array([list(range(3)) + list(range(4))]),
    }
    for norm in ("post", "pre"):
        cfg = TINY.replace(norm=norm)
        params = _init(cfg)
        model = Transformer(cfg)
        sep = model.apply({"params": params}, sep_src, shift_right(sep_tgt, 2))
        dec_in = shift_right(packed_tgt, 2, packing["targets_segments"])
        np.testing.assert_array_equal(dec_in, [[2, 11, 12, 2, 13, 14, 15]])
        packed = model.apply({"params": params}, packed_src, dec_in, packing=packing)
        np.testing.assert_allclose(packed[0, :3], sep[0, :3], atol=1e-5)
        np.testing.assert_allclose(packed[0, 3:], sep[1, :4], atol=1e-5)
        loss_sep = cross_entropy.cross_entropy(sep, sep_tgt, 0.1)[0].sum()
        loss_packed = cross_entropy.cross_entropy(packed, packed_tgt, 0.1)[0].sum()
        assert float(loss_packed) == pytest.approx(float(loss_sep), rel=1e-5)


def test_packed_examples_never_see_each_other():
    """Changing the second packed example (source and target) leaves the first unchanged."""
    packing = {
        "inputs_segments": jnp.array([[1, 1, 1, 2, 2, 2]]),
        "inputs_positions": jnp.array([[0, 1, 2, 0, 1, 2]]),
        "targets_segments": jnp.array([[1, 1, 2, 2, 2]]),
        "targets_positions": jnp.array([[0, 1, 0, 1, 2]]),
    }
    params = _init(TINY)
    model = Transformer(TINY)
    src = jnp.array([[5, 6, 3, 9, 10, 3]])
    dec = jnp.array([[2, 11, 2, 13, 14]])
    a = model.apply({"params": params}, src, dec, packing=packing)
    b = model.apply(
        {"params": params}, src.at[0, 3:5].set(17), dec.at[0, 3:].set(19), packing=packing
    )
    np.testing.assert_array_equal(a[0, :2], b[0, :2])
    assert not np.allclose(a[0, 3:], b[0, 3:])


@pytest.mark.parametrize("remat", [False, True])
def test_scan_over_layers_equals_unrolled(remat):
    """Same parameters, same logits and gradients, with the layers as one lax.scan."""
    params = _init(TINY)
    scanned = TINY.replace(scan_layers=True, remat=remat)

    def loss(cfg, p):
        return jnp.sum(Transformer(cfg).apply({"params": p}, SRC, TGT) ** 2)

    np.testing.assert_allclose(
        Transformer(scanned).apply({"params": params}, SRC, TGT),
        Transformer(TINY).apply({"params": params}, SRC, TGT),
        atol=1e-5,
    )
    g_scan = jax.grad(lambda p: loss(scanned, p))(params)
    g_unrolled = jax.grad(lambda p: loss(TINY, p))(params)
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_unrolled), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "x_shape, kernel_shape, in_dims, spec",
    [
        ((2, 5, 8), (8, 3, 4, 2), 1, "btd,dcnh->btcnh"),  # stacked Q/K/V
        ((2, 5, 4, 2), (4, 2, 8), 2, "btnh,nhd->btd"),  # W_O over heads
        ((7, 8), (8, 16), 1, "md,df->mf"),
    ],
)
def test_project_is_the_einsum_with_its_gradients(x_shape, kernel_shape, in_dims, spec):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=kernel_shape), jnp.float32)
    got = project(x, w, in_dims)
    np.testing.assert_allclose(got, jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-5)
    ct = jnp.asarray(rng.normal(size=got.shape), jnp.float32)
    ours = jax.grad(lambda x, w: jnp.sum(project(x, w, in_dims) * ct), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.einsum(spec, x, w) * ct), argnums=(0, 1))(x, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dense_has_flax_dense_parameters_and_output():
    cfg = TransformerConfig(vocab_size=11, d_model=8, d_ff=16, num_heads=2)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 8)), jnp.float32)
    ours = Dense(16, cfg, ("embed", "mlp"))
    params = nn.meta.unbox(ours.init(jax.random.PRNGKey(0), x))
    theirs = nn.DenseGeneral(16, kernel_init=nn.initializers.xavier_uniform())
    ref_params = theirs.init(jax.random.PRNGKey(0), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, ref_params)
    np.testing.assert_allclose(params["params"]["kernel"], ref_params["params"]["kernel"])
    np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), rtol=1e-5)
