"""Windowed self-attention: the blocked kernel against the dense core with a band mask, and the
model with windows against the model without (equal when the window covers the sequence)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_config

from flaxformer_lite.config import ConfigError
from flaxformer_lite.constants import BOS_ID, EOS_ID
from flaxformer_lite.models import layer_layout, predict
from flaxformer_lite.models.capture import captured_attention
from flaxformer_lite.models.transformer import Transformer
from flaxformer_lite.nn import attention, local_attention, masks

S, T = 13, 11  # not multiples of the windows used


def _band(length: int, window: int, causal: bool) -> jax.Array:
    """bool[n, n] dense reference band."""
    i = jnp.arange(length)
    offset = i[:, None] - i[None, :]
    if causal:
        return (offset >= 0) & (offset <= window)
    return jnp.abs(offset) <= window


def _dense_reference(q, k, v, valid, segments, window, causal):
    mask = _band(q.shape[1], window, causal)[None] & valid[:, None, :]
    if segments is not None:
        mask = mask & masks.segment_mask(segments, segments)
    out, weights = attention.batched_attention(q, k, v, mask)
    return out, weights, mask  # mask bool[B, n, n]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "length,window",
    # Window within the length, beyond it, and several blocks with a ragged tail run by
    # default; two more shapes of the same cases are slow.
    [
        (10, 4),
        (5, 16),
        (17, 5),
        pytest.param(7, 3, marks=pytest.mark.slow),
        pytest.param(9, 1, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_blocked_equals_dense_band_reference(causal, length, window, packed):
    rng = np.random.default_rng(length * 7 + window)
    q, k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 4)), jnp.float32) for _ in range(3))
    # Padded keys inside every window: interior positions invalid as well as a tail.
    valid = np.ones((2, length), bool)
    valid[0, 1::3] = False
    valid[1, length - 3 :] = False
    segments = None
    if packed:
        segments = np.ones((2, length), np.int32)
        segments[:, length // 2 :] = 2
        segments[~valid] = 0
        segments = jnp.asarray(segments)
    valid = jnp.asarray(valid)
    out, weights = local_attention.local_attention(q, k, v, valid, segments, window, causal)
    ref_out, ref_weights, mask = _dense_reference(q, k, v, valid, segments, window, causal)
    rows = np.asarray(mask.any(-1))  # queries with a visible key (the others are never read)
    np.testing.assert_allclose(
        np.where(rows[:, :, None, None], out, 0),
        np.where(rows[:, :, None, None], ref_out, 0),
        atol=1e-6,
    )
    dense = local_attention.to_dense(weights, length, window, causal)  # [B, N, n, n]
    dense, ref_weights = (np.where(rows[:, None, :, None], w, 0) for w in (dense, ref_weights))
    np.testing.assert_allclose(dense, ref_weights, atol=1e-6)
    # Masked weights are exactly zero: padded keys, other segments, outside the band.
    assert np.all(dense[np.broadcast_to(~np.asarray(mask)[:, None], dense.shape)] == 0)
    assert weights.shape[:3] == (2, 2, -(-length // min(window, length)))


def test_blocked_scores_are_linear_in_length():
    """The largest array of the blocked kernel grows with n * r, never n^2."""
    window, sizes = 4, []
    for length in (64, 128):
        x = jax.ShapeDtypeStruct((1, length, 1, 2), jnp.float32)
        valid = jax.ShapeDtypeStruct((1, length), jnp.bool_)
        fn = lambda q, k, v, m: local_attention.local_attention(q, k, v, m, None, window, False)
        jaxpr = jax.make_jaxpr(fn)(x, x, x, valid)
        sizes.append(max(np.prod(var.aval.shape) for e in jaxpr.eqns for var in e.outvars))
    assert sizes[1] == 2 * sizes[0]


def test_window_fields_are_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="encoder_window"):
            tiny_model_config(encoder_window=bad)
    with pytest.raises(ConfigError, match="decoder_window"):
        tiny_model_config(decoder_window=-2)


# ----------------------------------------------------------------------------
# The model.
# ----------------------------------------------------------------------------

FULL = tiny_model_config(vocab_size=29, d_model=16, num_heads=2, d_ff=24, max_len=64)


def _batch(source_len=S, target_len=T):
    rng = np.random.default_rng(0)
    inputs = rng.integers(4, 29, (2, source_len)).astype(np.int32)
    inputs[1, source_len - 4 :] = 0  # padding
    targets = rng.integers(4, 29, (2, target_len)).astype(np.int32)
    targets[0, target_len - 3 :] = 0
    return jnp.asarray(inputs), jnp.asarray(targets)


@pytest.fixture(scope="module")
def params():
    inputs, targets = _batch()
    # Jitted here and below: one compile where an eager call dispatches each op.
    return jax.jit(Transformer(FULL).init)(jax.random.PRNGKey(0), inputs, targets)["params"]


def _logits(config, params, inputs, targets, **kw):
    return jax.jit(lambda p: Transformer(config, **kw).apply({"params": p}, inputs, targets))(
        params
    )


def test_window_zero_is_the_dense_program(params):
    """Windows 0 build the dense masks: the logits are those of the encoder and decoder run
    on hand-built dense masks, bit for bit."""
    inputs, targets = _batch()
    assert not isinstance(masks.encoder_mask(inputs != 0), masks.LocalMask)

    def by_hand(m, inputs, targets):
        valid, tvalid = inputs != 0, targets != 0
        enc_mask = masks.padding_mask(valid, S)
        dec_mask = masks.padding_mask(tvalid, T) & masks.causal_mask(T)
        encoded = m.encoder(inputs, enc_mask, deterministic=True)
        return m.decoder(
            encoded, targets, dec_mask, masks.padding_mask(valid, T), deterministic=True
        )

    model = Transformer(FULL)
    hand = jax.jit(lambda p: model.apply({"params": p}, inputs, targets, method=by_hand))
    explicit = FULL.replace(encoder_window=0, decoder_window=0)
    np.testing.assert_array_equal(_logits(explicit, params, inputs, targets), hand(params))


@pytest.mark.parametrize("scan", [False, True])
def test_window_covering_the_sequence_equals_full_attention(params, scan):
    params = layer_layout.to_layout(params, scan)
    inputs, targets = _batch()
    full = _logits(FULL.replace(scan_layers=scan), params, inputs, targets)
    for enc, dec in ((S, 0), (0, T), (S + 5, T + 2)):
        local = FULL.replace(encoder_window=enc, decoder_window=dec, scan_layers=scan)
        np.testing.assert_allclose(_logits(local, params, inputs, targets), full, atol=2e-5)


def test_window_one_and_thirty_two_differ(params):
    inputs, targets = _batch(source_len=40)
    narrow = _logits(FULL.replace(encoder_window=1), params, inputs, targets)
    wide = _logits(FULL.replace(encoder_window=32), params, inputs, targets)
    assert np.abs(np.asarray(narrow) - np.asarray(wide)).max() > 1e-3


def _receptive_field(grad_rows: np.ndarray) -> list[int]:
    """grad_rows [n_out, n_in] of |d out_i / d in_j| -> every i's set of j with a nonzero."""
    return [set(np.flatnonzero(row).tolist()) for row in grad_rows]


@pytest.mark.parametrize("layers", [1, 2])
def test_encoder_gradient_is_zero_outside_the_window(layers):
    window, length = 3, 20
    cfg = FULL.replace(input_features=5, encoder_window=window, num_encoder_layers=layers)
    feats = jnp.asarray(np.random.default_rng(1).normal(size=(1, length, 5)), jnp.float32)
    valid = jnp.ones((1, length), bool)
    model = Transformer(cfg)
    init = jax.jit(functools.partial(model.init, source_valid=valid))
    p = init(jax.random.PRNGKey(1), feats, jnp.ones((1, 4), jnp.int32))

    probe = jnp.asarray(np.random.default_rng(3).normal(size=(16,)), jnp.float32)

    def out_row(x, i):  # a random direction: a post-LN row's plain sum is constant
        return model.apply(p, x, valid, method="encode")[0, i] @ probe

    grads = jax.jit(jax.vmap(jax.grad(out_row), in_axes=(None, 0)))(feats, jnp.arange(length))
    fields = _receptive_field(np.abs(np.asarray(grads[:, 0])).sum(-1))
    reach = layers * window
    for i, field in enumerate(fields):
        assert field == set(range(max(0, i - reach), min(length, i + reach + 1))), i


def test_decoder_gradient_is_zero_outside_the_causal_window(params):
    window, length = 2, 12
    cfg = FULL.replace(decoder_window=window)  # 2 layers: receptive field 2r back
    inputs, _ = _batch()
    targets = jnp.full((2, length), 5, jnp.int32)
    vectors = jnp.asarray(np.random.default_rng(2).normal(size=(2, length, 16)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(3).normal(size=(29,)), jnp.float32)

    def decode_with(m, inputs, targets, vectors):
        valid = inputs != 0
        encoded = m.encode(inputs, valid)
        self_mask = masks.decoder_mask(targets != 0, window=window)
        cross = masks.cross_mask(valid, length)
        use = jnp.ones(targets.shape, bool)
        return m.decoder(
            encoded, targets, self_mask, cross, deterministic=True, input_vectors=(use, vectors)
        )

    def out_row(x, i):
        logits = Transformer(cfg).apply({"params": params}, inputs, targets, x, method=decode_with)
        return logits[0, i, :29] @ probe  # the real vocabulary (`nn/vocab.py`)

    grads = jax.jit(jax.vmap(jax.grad(out_row), in_axes=(None, 0)))(vectors, jnp.arange(length))
    fields = _receptive_field(np.abs(np.asarray(grads[:, 0])).sum(-1))
    for i, field in enumerate(fields):
        assert field == set(range(max(0, i - 2 * window), i + 1)), i


def test_cached_greedy_equals_full_recompute_with_a_decoder_window(params):
    cfg = FULL.replace(decoder_window=3, encoder_window=2)
    inputs, _ = _batch()
    model = Transformer(cfg)
    out = {}
    for cached in (True, False):
        search = predict.SearchConfig(method="greedy", max_len=12, cached=cached)
        out[cached], _ = predict.decode(
            model, params, inputs, search=search, bos_id=BOS_ID, eos_id=EOS_ID
        )
    np.testing.assert_array_equal(out[True], out[False])
    # Step logits as well: the band in the cache mask is the kernel's band.
    _, targets = _batch()
    full = _logits(cfg, params, inputs, targets)
    step, cache, _ = predict.cached_step(model, params, inputs, max_len=T, bos_id=BOS_ID)
    step, stepped = jax.jit(step), []
    for t in range(T):
        logits, cache = step(targets[:, t : t + 1], cache)
        stepped.append(logits)
    rows = np.asarray(targets != 0)
    np.testing.assert_allclose(
        np.where(rows[..., None], jnp.stack(stepped, 1), 0),
        np.where(rows[..., None], full, 0),
        atol=2e-5,
    )


@pytest.mark.parametrize("scan", [False, True])
def test_captured_local_weights_equal_the_dense_band_reference(params, scan):
    params = layer_layout.to_layout(params, scan)
    window = 4
    cfg = FULL.replace(encoder_window=window, decoder_window=window, scan_layers=scan)
    inputs, targets = _batch()
    names = ("encoder/self/0", "decoder/self/-1")
    valid, tvalid = inputs != 0, targets != 0

    def local(m, inputs, targets):
        return m(inputs, targets)

    def dense(m, inputs, targets):
        enc_mask = masks.padding_mask(valid, S) & _band(S, window, False)
        dec_mask = masks.padding_mask(tvalid, T) & _band(T, window, True)
        encoded = m.encoder(inputs, enc_mask, deterministic=True)
        cross = masks.padding_mask(valid, T)
        return m.decoder(encoded, targets, dec_mask, cross, deterministic=True)

    got = {}
    for name, fn in (("local", local), ("dense", dense)):

        @jax.jit
        def run(params, fn=fn):
            logits, sown = Transformer(cfg, capture=names).apply(
                {"params": params}, inputs, targets, method=fn, mutable=["intermediates"]
            )
            return logits, captured_attention(sown["intermediates"], names, cfg)

        got[name] = run(params)
    np.testing.assert_allclose(got["local"][0], got["dense"][0], atol=2e-5)
    for name in names:
        assert got["local"][1][name].shape == got["dense"][1][name].shape
        np.testing.assert_allclose(got["local"][1][name], got["dense"][1][name], atol=1e-6)


def test_attention_dropout_on_blocked_weights(params):
    """Both impls route to the blocked kernel; dropout on its weights changes the output and
    is the identity when deterministic."""
    inputs, targets = _batch()
    cfg = FULL.replace(encoder_window=2, decoder_window=2, attention_dropout_rate=0.3)
    model = Transformer(cfg)
    det = _logits(cfg, params, inputs, targets)
    fast = _logits(cfg.replace(attention_impl="fast"), params, inputs, targets)
    np.testing.assert_allclose(det, fast, atol=2e-5)
    dropped = jax.jit(
        lambda p: model.apply(
            {"params": p},
            inputs,
            targets,
            deterministic=False,
            rngs={"dropout": jax.random.PRNGKey(3)},
        )
    )(params)
    assert np.abs(np.asarray(dropped) - np.asarray(det)).max() > 1e-3
