"""The padded vocabulary (`nn/vocab.py`) changes shapes only: a model storing 128 rows for a
vocabulary of 29 computes what the same model storing 29 computes, from the same seed."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model_config

from flaxformer_lite.config.variants import CopyHead
from flaxformer_lite.constants import EOS_ID
from flaxformer_lite.export import layout
from flaxformer_lite.models import predict
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.models.non_autoregressive import NonAutoregressiveModel
from flaxformer_lite.nn import vocab
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.training import workdir as workdir_lib
from flaxformer_lite.training.state import TrainState
from flaxformer_lite.training.step import train_step

SOURCES = jnp.array([[5, 6, 7, 8, EOS_ID, 0], [9, 10, 28, EOS_ID, 0, 0]], jnp.int32)
TARGETS = jnp.array([[11, 12, 13, 27, EOS_ID, 0], [14, EOS_ID, 0, 0, 0, 0]], jnp.int32)
BATCH = {"inputs": SOURCES, "targets": TARGETS}
SHAPES = {"inputs": SOURCES.shape, "targets": TARGETS.shape}
UNTIED = dict(share_embeddings=False, tie_output_embedding=False, target_vocab_size=37)


def _pair(make, **fields):
    """(unpadded model, its params, padded model, its params), both from PRNGKey(0)."""
    out = []
    for multiple in (1, 128):
        layers = dict(num_encoder_layers=1, num_decoder_layers=1)
        model = make(tiny_model_config(vocab_multiple=multiple, **(layers | fields)))
        out += [model, nn.meta.unbox(model.init(jax.random.PRNGKey(0), SHAPES))]
    return tuple(out)


def _tables(params):
    """{path: array} of the vocabulary-sized leaves, rows along axis 0 (kernels transposed)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out = {}
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        if name.endswith("['embedding']") or "['logits']" in name:
            out[name] = x.T if name.endswith("['kernel']") else x
    return out


@functools.cache
def _autoregressive(untied: bool):
    make = lambda cfg: AutoregressiveModel(cfg, label_smoothing=0.1)  # noqa: E731
    return _pair(make, **(UNTIED if untied else {}))


@pytest.mark.parametrize("untied", [False, True])
def test_padded_rows_start_at_zero_and_real_rows_as_unpadded(untied):
    _, small, _, padded = _autoregressive(untied)
    small_tables, padded_tables = _tables(small), _tables(padded)
    assert small_tables.keys() == padded_tables.keys() and small_tables
    for name, table in padded_tables.items():
        real = small_tables[name].shape[0]
        assert table.shape[0] == 128, name
        np.testing.assert_array_equal(table[:real], small_tables[name], err_msg=name)
        assert not np.any(table[real:]), name
    rest = lambda p: {k: v for k, v in p.items() if "embedding" not in k}  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, rest(small["encoder"]), rest(padded["encoder"]))


@pytest.mark.parametrize("untied", [False, True])
def test_loss_gradients_and_an_adam_step_equal_the_unpadded_model(untied):
    small_model, small, padded_model, padded = _autoregressive(untied)
    rng = jax.random.PRNGKey(1)

    def loss_and_grads(model, params):
        return jax.jit(jax.value_and_grad(lambda p: model.loss(p, BATCH, rng, 0), has_aux=True))(
            params
        )

    (loss_a, sums_a), grads_a = loss_and_grads(small_model, small)
    (loss_b, sums_b), grads_b = loss_and_grads(padded_model, padded)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    for key in ("nll", "correct", "tokens"):
        np.testing.assert_allclose(sums_b[key], sums_a[key], rtol=1e-6)
    grad_a, grad_b = _tables(grads_a), _tables(grads_b)
    for name, g in grad_b.items():
        real = grad_a[name].shape[0]
        np.testing.assert_allclose(g[:real], grad_a[name], rtol=1e-4, atol=2e-6, err_msg=name)
        assert not np.any(g[real:]), f"{name}: a padded row has a gradient"

    # One Adam step through the library's step: the padding stays exactly zero.
    tx = optax.adam(1e-2)
    state = TrainState(jnp.int32(0), padded, tx.init(padded), jax.random.PRNGKey(2))
    state, _ = jax.jit(functools.partial(train_step, model=padded_model, tx=tx))(state, BATCH)
    for name, table in _tables(state.params).items():
        real = grad_a[name].shape[0]
        assert not np.any(np.asarray(table)[real:]), name
        assert np.any(np.asarray(table)[:real] != _tables(padded)[name][:real]), name


def test_the_loss_never_spreads_smoothing_over_padding():
    """cross_entropy over [.., V] logits equals it over the same logits padded to Vp, for
    whatever values the padded columns hold (it masks them itself)."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 29)) * 3
    garbage = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 99)) * 50
    padded = jnp.concatenate([logits, garbage], axis=-1)

    def losses(x, v):
        smoothed, nll = cross_entropy.cross_entropy(x, TARGETS, 0.1, v)
        return smoothed.sum() + nll.sum()

    np.testing.assert_allclose(losses(padded, 29), losses(logits, None), rtol=1e-6)
    g_real = jax.grad(losses)(logits, None)
    g_padded = jax.grad(losses)(padded, 29)
    np.testing.assert_allclose(g_padded[..., :29], g_real, atol=1e-6)
    assert not np.any(g_padded[..., 29:])


@pytest.mark.parametrize("method", ["greedy", "beam", "sample"])
def test_searches_and_scores_equal_the_unpadded_model(method):
    small_model, small, padded_model, padded = _autoregressive(False)
    search = predict.SearchConfig(method, max_len=7, beam_size=3, temperature=2.0)
    key = jax.random.PRNGKey(3)
    tokens_a, scores_a = small_model.predict(small, BATCH, search, rng=key)
    tokens_b, scores_b = padded_model.predict(padded, BATCH, search, rng=key)
    np.testing.assert_array_equal(tokens_b, tokens_a)
    assert int(np.max(tokens_b)) < 29
    np.testing.assert_allclose(scores_b, scores_a, rtol=1e-5, atol=1e-5)
    if method == "greedy":
        for a, b in zip(small_model.score(small, BATCH), padded_model.score(padded, BATCH)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_the_copy_head_and_the_nat_model_are_unchanged_by_padding():
    rng = jax.random.PRNGKey(1)
    copy = _pair(lambda cfg: AutoregressiveModel(cfg, label_smoothing=0.1, copy=CopyHead()))
    nat = _pair(lambda cfg: NonAutoregressiveModel(cfg, length_classes=16, label_smoothing=0.1))
    for small_model, small, padded_model, padded in (copy, nat):
        loss_a, _ = small_model.loss(small, BATCH, rng, 0)
        loss_b, _ = padded_model.loss(padded, BATCH, rng, 0)
        np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    # Label smoothing is the loss's alone: the same models search.
    copy_small, params_small, copy_padded, params_padded = copy
    search = predict.SearchConfig("beam", max_len=6, beam_size=2)
    np.testing.assert_array_equal(
        copy_padded.predict(params_padded, BATCH, search)[0],
        copy_small.predict(params_small, BATCH, search)[0],
    )


def test_exports_see_the_real_vocabulary_only():
    for untied in (False, True):  # the parameters of the tests above, initialised once
        _, small, padded_model, padded = _autoregressive(untied)
        cfg = padded_model.config
        got = layout.model_layout(padded, cfg)
        want = layout.model_layout(small, cfg.replace(vocab_multiple=1))
        assert got.decoder.embedding.shape[0] == cfg.output_vocab_size
        assert got.encoder.embedding.shape[0] == cfg.vocab_size
        np.testing.assert_array_equal(got.output.weight, want.output.weight)
        if got.output.bias is not None:
            np.testing.assert_array_equal(got.output.bias, want.output.bias)


def test_mask_logits_and_real_rows():
    x = jnp.arange(12.0).reshape(2, 6)
    masked = vocab.mask_logits(x, 4)
    np.testing.assert_array_equal(masked[:, :4], x[:, :4])
    assert np.all(np.asarray(masked[:, 4:]) == vocab.PADDED_LOGIT)
    assert vocab.mask_logits(x, 6) is x
    assert float(jax.nn.softmax(masked)[0, 5]) == 0.0
    assert vocab.real_rows(np.ones((8, 3)), 5).shape == (5, 3)
    assert vocab.real_rows(np.ones((3, 8)), 5, axis=1).shape == (3, 5)
    with pytest.raises(ValueError):
        vocab.real_rows(np.ones((4, 3)), 5)
    assert tiny_model_config().padded(29) == 128
    assert tiny_model_config(vocab_multiple=1).padded(29) == 29
    assert tiny_model_config(vocab_multiple=8).padded(32) == 32


def test_a_run_saved_before_padding_reads_as_unpadded(tmp_path):
    """Its checkpoints hold exactly V rows: decoding, export and resume build that model."""
    saved = {"model": {"vocab_size": 29}, "data": {}}
    (tmp_path / workdir_lib.RUN_CONFIG).write_text(json.dumps(saved))
    assert workdir_lib.load_run_config(str(tmp_path)).model.vocab_multiple == 1
    saved["model"]["vocab_multiple"] = 128
    (tmp_path / workdir_lib.RUN_CONFIG).write_text(json.dumps(saved))
    assert workdir_lib.load_run_config(str(tmp_path)).model.vocab_multiple == 128
