"""Guided attention (objectives/guided_attention.py): the guide, its lengths, the loss wiring."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from flaxformer_lite.config import ConfigError, TransformerConfig, variants
from flaxformer_lite.config.variants import (
    GuidedAttention,
    check_guided_attention,
    guided_attention_of,
)
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.objectives import guided_attention as ga

SIGMA = 0.2
N_LEN, T_LEN = (12, 7), (16, 9)  # per-example target and encoder lengths
TT, SS = 14, 18  # padded sizes


def valid(lengths, size):
    return jnp.arange(size)[None, :] < jnp.asarray(lengths)[:, None]


def grid(n, t, anti=False):
    """One-hot float32[n, t] attention on the (anti-)diagonal of an n x t grid."""
    rows = np.arange(n)
    cols = np.minimum(np.round(rows / n * t), t - 1).astype(int)
    if anti:
        cols = t - 1 - cols
    a = np.zeros((n, t), np.float32)
    a[rows, cols] = 1.0
    return a


def batch_weights(anti=False, heads=2, garbage=0.0):
    """float32[B, N, TT, SS]: each example's grid, padded cells filled with `garbage`."""
    out = np.full((len(N_LEN), heads, TT, SS), garbage, np.float32)
    for i, (n, t) in enumerate(zip(N_LEN, T_LEN, strict=True)):
        out[i, :, :n, :t] = grid(n, t, anti)
    return jnp.asarray(out)


def mean(weights, n_len=N_LEN, t_len=T_LEN, tt=TT, ss=SS):
    total, cells = ga.guided_attention_loss(weights, valid(n_len, tt), valid(t_len, ss), SIGMA)
    return float(total / cells)


def test_diagonal_is_near_zero_and_anti_diagonal_large():
    diagonal, anti = mean(batch_weights()), mean(batch_weights(anti=True))
    assert diagonal < 1e-3  # each row's mass sits where W ~ 0
    assert anti > 50 * diagonal
    # Per row (the cell mean times the row's cells) the anti-diagonal mass meets W near 1.
    assert anti * min(T_LEN) > 0.4


def test_padded_cells_never_count_and_examples_are_independent():
    padded = batch_weights(garbage=0.0)
    dirty = batch_weights(garbage=50.0)
    w = ga.guide_weights(valid(N_LEN, TT), valid(T_LEN, SS), SIGMA)
    t_clean, c_clean = ga.guided_attention_loss(padded, valid(N_LEN, TT), valid(T_LEN, SS), SIGMA)
    t_dirty, c_dirty = ga.guided_attention_loss(dirty, valid(N_LEN, TT), valid(T_LEN, SS), SIGMA)
    assert float(t_clean) == float(t_dirty) and float(c_clean) == float(c_dirty)
    totals = 0.0
    for i, (n, t) in enumerate(zip(N_LEN, T_LEN, strict=True)):
        alone = padded[i : i + 1, :, :n, :t]
        total, cells = ga.guided_attention_loss(
            alone, jnp.ones((1, n), bool), jnp.ones((1, t), bool), SIGMA
        )
        assert float(cells) == n * t * 2
        # Each example's own guide, whatever the batch's padded sizes.
        np.testing.assert_allclose(
            w[i, :n, :t], ga.guide_weights(jnp.ones((1, n), bool), jnp.ones((1, t), bool), SIGMA)[0]
        )
        totals += float(total)
    np.testing.assert_allclose(float(t_clean), totals, rtol=1e-6)


CFG = TransformerConfig(
    vocab_size=16,
    input_features=4,
    share_embeddings=False,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=2,
    dropout_rate=0.0,
    subsampling_layers=1,
    subsampling_channels=8,
)
ON = GuidedAttention(weight=1.0, sigma=0.4, layers=(-1,), heads=())


@pytest.fixture(scope="module")
def setup():
    plain = AutoregressiveModel(CFG)
    params = plain.init(jax.random.PRNGKey(0), {"inputs": (2, 10, 4), "targets": (2, 5)})
    b = {
        "inputs": jax.random.normal(jax.random.PRNGKey(1), (2, 10, 4)),
        "inputs_valid": valid((10, 6), 10),
        "targets": jnp.array([[5, 6, 7, 8, 2], [9, 4, 2, 0, 0]], jnp.int32),
    }
    return plain, params, b


def test_weight_zero_is_the_plain_loss(setup):
    plain, params, b = setup
    off = AutoregressiveModel(CFG, guided_attention=GuidedAttention(weight=0.0))
    key = jax.random.PRNGKey(2)
    a, sums_a = plain.loss(params, b, key, 0)
    c, sums_c = off.loss(params, b, key, 0)
    assert float(a) == float(c) and "guided_attention" not in sums_c


def test_loss_adds_weight_times_mean_and_gradient_reaches_attention(setup):
    _, params, b = setup
    model = AutoregressiveModel(CFG, guided_attention=ON)
    loss, sums = model.loss(params, b, jax.random.PRNGKey(2), 0)
    term = float(sums["guided_attention"] / sums["guided_attention_cells"])
    np.testing.assert_allclose(
        (float(loss) - float(sums["nll"])) / float(sums["tokens"]), term, rtol=1e-5
    )
    # 5 and 3 targets (EOS included), encoder lengths 5 and 3 after one stride-2 conv, 2 heads.
    assert float(sums["guided_attention_cells"]) == (5 * 5 + 3 * 3) * 2

    def guided_only(p):
        return model.loss(p, b, jax.random.PRNGKey(2), 0)[1]["guided_attention"]

    grads = jax.grad(guided_only)(params)
    cross = grads["decoder"]["layer_1"]["cross_attention"]
    assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(cross))


def test_training_lowers_the_guided_term(setup):
    """Six Adam steps from the same start, with the guided loss at weight 20 and at weight 0
    (the plain loss), the term measured at weight 1 before each: only the guided run pulls
    the attention onto the diagonal (measured: 0.079 -> 0.051, and 0.079 -> 0.075 without)."""
    _, params0, b = setup
    probe = AutoregressiveModel(CFG, guided_attention=ON)

    @jax.jit
    def term(p):
        _, sums = probe.loss(p, b, None, 0)
        return sums["guided_attention"] / sums["guided_attention_cells"]

    def train(weight):
        model = AutoregressiveModel(CFG, guided_attention=dataclasses.replace(ON, weight=weight))
        tx = optax.adam(1e-2)

        @jax.jit
        def step(p, opt):
            grads, sums = jax.grad(lambda q: model.loss(q, b, None, 0), has_aux=True)(p)
            grads = jax.tree.map(lambda g: g / sums["tokens"], grads)
            updates, opt = tx.update(grads, opt, p)
            return optax.apply_updates(p, updates), opt

        params, opt = params0, tx.init(params0)
        for _ in range(6):
            params, opt = step(params, opt)
        return float(term(params))

    start, guided, plain = float(term(params0)), train(20.0), train(0.0)
    assert guided < 0.8 * start and guided < 0.8 * plain, (start, guided, plain)


def test_section_refuses_bad_values():
    for values, field in (
        ({"weight": -1.0}, "weight"),
        ({"sigma": 0.0}, "sigma"),
        ({"layers": ()}, "layers"),
        ({"heads": (-1,)}, "heads"),
        ({"bogus": 1}, "bogus"),
    ):
        with pytest.raises(ConfigError, match=field):
            guided_attention_of(ml_collections.ConfigDict({"guided_attention": values}))
    assert not guided_attention_of(ml_collections.ConfigDict({})).enabled
    off = variants.scheduled_sampling_section(ml_collections.ConfigDict({}))
    on = guided_attention_of({"guided_attention": {"weight": 1.0, "layers": (2,)}})
    with pytest.raises(ConfigError, match="guided_attention.layers"):
        check_guided_attention(on, CFG, off, None, None)
    on = guided_attention_of({"guided_attention": {"weight": 1.0, "heads": (2,)}})
    with pytest.raises(ConfigError, match="guided_attention.heads"):
        check_guided_attention(on, CFG, off, None, None)
    on = guided_attention_of({"guided_attention": {"weight": 1.0}})
    with pytest.raises(ConfigError, match="nat"):
        check_guided_attention(on, CFG, off, object(), None)
    with pytest.raises(ConfigError, match="copy"):
        check_guided_attention(on, CFG, off, None, object())
    check_guided_attention(on, CFG, off, None, None)  # defaults fit a 2-layer, 2-head model
