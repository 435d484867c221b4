"""The train step: micro-batch accumulation and bf16 compute against the plain fp32 step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import tiny_model_config

from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training.state import create_state
from flaxformer_lite.training.step import train_step

CFG = tiny_model_config(vocab_size=50, d_ff=64)


SGD = optax.sgd(0.5)  # a linear update exposes any difference in the gradient
ADAM = optax.adam(3e-3)


def _batch(seed=0, rows=8):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(4, 50, (rows, 9)).astype(np.int32)
    targets = rng.integers(4, 50, (rows, 7)).astype(np.int32)
    for r in range(rows):  # ragged lengths: padding differs per row
        inputs[r, 3 + r % 6 :] = 0
        targets[r, 2 + r % 5] = 3
        targets[r, 3 + r % 5 :] = 0
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


_STATES = {}


def _state(name):
    """One initial state per optimiser: parameters are float32 whatever the compute dtype."""
    if name not in _STATES:
        tx = {"sgd": SGD, "adam": ADAM}[name]
        _STATES[name], _ = create_state(
            AutoregressiveModel(CFG),
            tx,
            partitioning.make_mesh(1),
            seed=0,
            source_len=9,
            target_len=7,
        )
    return _STATES[name]


def _step(cfg, tx, accum):
    return jax.jit(
        functools.partial(
            train_step,
            model=AutoregressiveModel(cfg, label_smoothing=0.1),
            tx=tx,
            grad_accum_steps=accum,
        )
    )


def test_gradient_accumulation_equals_one_big_batch():
    batch = _batch()
    base, sums = _step(CFG, SGD, 1)(_state("sgd"), batch)
    # 4 micro-batches of 2 ragged rows, each with its own token count (one compile; the
    # lowering check exports a 2-way accumulation as well).
    acc, acc_sums = _step(CFG, SGD, 4)(_state("sgd"), batch)
    for a, b in zip(jax.tree.leaves(acc.params), jax.tree.leaves(base.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for k in ("loss", "tokens", "correct"):
        np.testing.assert_allclose(acc_sums[k], sums[k], rtol=1e-5)


def test_bf16_compute_tracks_fp32_over_a_short_run():
    losses = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        cfg = CFG.replace(dtype=dtype)
        state, step = _state("adam"), _step(cfg, ADAM, 1)
        assert jax.tree.leaves(state.params)[0].dtype == jnp.float32  # fp32 master weights
        curve = []
        for i in range(30):
            state, sums = step(state, _batch(i % 3))
            curve.append(float(sums["loss"] / sums["tokens"]))
        assert all(
            x.dtype == jnp.float32
            for x in jax.tree.leaves(state.opt_state)
            if hasattr(x, "dtype") and x.ndim > 0
        )
        losses[dtype] = np.array(curve)
    fp32, bf16 = losses[jnp.float32], losses[jnp.bfloat16]
    assert fp32[-1] < 0.7 * fp32[0]  # it learns
    np.testing.assert_allclose(bf16, fp32, rtol=0.05)
