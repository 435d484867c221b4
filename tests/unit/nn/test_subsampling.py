"""The convolutional front end (nn/subsampling.py): lengths, validity, padding never leaks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.models import predict
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.models.non_autoregressive import NonAutoregressiveModel
from flaxformer_lite.models.packed_rows import Packing
from flaxformer_lite.models.transformer import Transformer
from flaxformer_lite.nn.subsampling import (
    Conv1dSubsampler,
    subsampled_lengths,
    subsampled_validity,
)

F, S, T = 6, 13, 6
LENGTHS = (13, 8, 5)  # odd and even, one row full


def config(layers=2, **kw):
    return TransformerConfig(
        vocab_size=16,
        input_features=F,
        share_embeddings=False,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
        subsampling_layers=layers,
        subsampling_channels=8,
        **kw,
    )


def formula(length, layers, k):
    for _ in range(layers):
        length = (length + 2 * (k // 2) - k) // 2 + 1
    return length


@pytest.fixture(scope="module")
def model():
    m = AutoregressiveModel(config())
    # Jitted: one compile where an eager init dispatches each op.
    init = jax.jit(lambda key: m.init(key, {"inputs": (3, S, F), "targets": (3, T)}))
    params = init(jax.random.PRNGKey(0))
    return m, params


def batch(garbage: float = 0.0):
    valid = np.arange(S)[None, :] < np.array(LENGTHS)[:, None]  # [B, S]
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (len(LENGTHS), S, F)))
    noise = garbage * np.asarray(jax.random.normal(jax.random.PRNGKey(2), x.shape))
    x = np.where(valid[..., None], x, noise).astype(np.float32)
    targets = np.array([[5, 6, 7, 8, 2, 0], [9, 4, 2, 0, 0, 0], [3, 2, 0, 0, 0, 0]], np.int32)
    return {"inputs": jnp.asarray(x), "inputs_valid": jnp.asarray(valid), "targets": targets}


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("kernel", [3, 5])
def test_lengths_follow_the_conv_formula_and_shape(layers, kernel):
    cfg = config(layers, subsampling_kernel=kernel)
    for length in range(1, 12):
        expected = formula(length, layers, kernel)
        assert int(subsampled_lengths(length, cfg)) == expected
        x, valid = jnp.zeros((1, length, F)), jnp.ones((1, length), bool)
        out, _ = jax.eval_shape(
            lambda x, v, cfg=cfg: Conv1dSubsampler(cfg).init_with_output(
                jax.random.PRNGKey(0), x, v
            ),
            x,
            valid,
        )
        assert out.shape == (1, expected, cfg.d_model)


@pytest.mark.parametrize("layers", [1, 2])
def test_validity_is_the_subsampled_prefix(layers):
    cfg = config(layers)
    lengths = np.array([0, 1, 2, 7, 10, 13])
    valid = np.arange(S)[None, :] < lengths[:, None]
    out = np.asarray(subsampled_validity(jnp.asarray(valid), cfg))
    assert out.shape[1] == formula(S, layers, 5)
    for row, length in zip(out, lengths, strict=True):
        n = formula(length, layers, 5) if length else 0
        np.testing.assert_array_equal(row, np.arange(out.shape[1]) < n)


def test_validity_unchanged_without_subsampling():
    valid = jnp.asarray(np.arange(S)[None, :] < np.array(LENGTHS)[:, None])
    assert subsampled_validity(valid, config(0)) is valid


def encode(model, params, inputs, valid):
    m, _ = model
    return _encode(m.module, params, inputs, valid)


@functools.partial(jax.jit, static_argnums=0)  # one compile per shape, not one per op
def _encode(module, params, inputs, valid):
    return module.apply({"params": params}, inputs, valid, method="encode")


def test_garbage_padding_and_batching_do_not_change_valid_outputs(model):
    m, params = model
    clean, dirty = batch(0.0), batch(1e4)
    enc_valid = np.asarray(subsampled_validity(clean["inputs_valid"], m.config))
    out_dirty = np.asarray(encode(model, params, dirty["inputs"], dirty["inputs_valid"]))
    for i, length in enumerate(LENGTHS):
        one = clean["inputs"][i : i + 1, :length]
        alone = encode(model, params, one, jnp.ones((1, length), bool))
        n = int(enc_valid[i].sum())
        assert alone.shape[1] == n
        np.testing.assert_allclose(out_dirty[i, :n], np.asarray(alone[0]), atol=2e-5, rtol=1e-5)
    # The loss (encoder, cross-attention masks, decoder) does not see the garbage either.
    loss = jax.jit(lambda p, b: m.loss(p, b, jax.random.PRNGKey(3), 0)[0])
    loss_clean, loss_dirty = loss(params, clean), loss(params, dirty)
    np.testing.assert_allclose(loss_clean, loss_dirty, rtol=1e-5)


def test_valid_outputs_have_zero_gradient_wrt_padded_frames(model):
    m, params = model
    b = batch(3.0)
    enc_valid = subsampled_validity(b["inputs_valid"], m.config)
    probe = jax.random.normal(jax.random.PRNGKey(4), (len(LENGTHS), int(enc_valid.shape[1]), 16))

    def valid_outputs(x):
        out = encode(model, params, x, b["inputs_valid"])
        return jnp.sum(jnp.where(enc_valid[..., None], out * probe, 0.0))

    grad = np.asarray(jax.grad(valid_outputs)(b["inputs"]))
    padded = ~np.asarray(b["inputs_valid"])
    assert np.all(grad[padded] == 0.0)
    assert np.abs(grad[~padded]).sum() > 0  # the probe does reach the valid frames


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_cached_decoding_equals_full_recompute(model, method):
    m, params = model
    b = batch(1e3)
    search = predict.SearchConfig(method, max_len=5, beam_size=2)
    cached = m.predict(params, b, search)
    full = m.predict(params, b, search._replace(cached=False))
    np.testing.assert_array_equal(cached[0], full[0])
    np.testing.assert_allclose(cached[1], full[1], rtol=1e-5, atol=1e-5)


def test_without_subsampling_the_feature_model_is_unchanged():
    """subsampling_layers=0: the same parameters (no conv) and the same loss as a config
    that never names the new fields."""
    plain = TransformerConfig(
        vocab_size=16, input_features=F, share_embeddings=False, d_model=16, num_heads=2,
        d_ff=32, num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0,
    )  # fmt: skip
    explicit = plain.replace(subsampling_layers=0, subsampling_kernel=3, subsampling_channels=4)
    b = batch(0.0)
    shapes = {"inputs": (3, S, F), "targets": (3, T)}
    losses = []
    for cfg in (plain, explicit):
        m = AutoregressiveModel(cfg)
        params = jax.jit(lambda key, m=m: m.init(key, shapes))(jax.random.PRNGKey(0))
        assert set(params["encoder"]) == {"input_projection", "layer_0"}
        losses.append(jax.jit(lambda p, m=m: m.loss(p, b, jax.random.PRNGKey(3), 0)[0])(params))
    assert losses[0] == losses[1]


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="subsampling_layers"):
        TransformerConfig(subsampling_layers=2)  # token inputs
    with pytest.raises(ConfigError, match="subsampling_kernel"):
        config(2, subsampling_kernel=4)
    with pytest.raises(ConfigError, match="subsampling_channels"):
        config(2).replace(subsampling_channels=0)
    with pytest.raises(ConfigError, match="subsampling_layers"):
        NonAutoregressiveModel(config(1), length_mode="fixed")
    packing = Packing(
        inputs_segments=jnp.ones((1, S), jnp.int32),
        inputs_positions=jnp.zeros((1, S), jnp.int32),
        targets_segments=jnp.ones((1, 4), jnp.int32),
        targets_positions=jnp.zeros((1, 4), jnp.int32),
    )
    with pytest.raises(ConfigError, match="packed"):
        jax.eval_shape(
            lambda: Transformer(config(1)).init(
                jax.random.PRNGKey(0),
                jnp.zeros((1, S, F)),
                jnp.ones((1, 4), jnp.int32),
                source_valid=jnp.ones((1, S), bool),
                packing=packing,
            )
        )  # fmt: skip


def test_length_only_shapes_build_the_feature_parameters(model):
    """Train-state creation passes (B, S) shapes; the parameters are those of (B, S, F)."""
    m, params = model
    shapes = {"inputs": (1, 8), "targets": (1, 8)}
    abstract = jax.eval_shape(lambda: m.init(jax.random.PRNGKey(0), shapes))
    assert jax.tree.map(jnp.shape, abstract) == jax.tree.map(jnp.shape, params)
