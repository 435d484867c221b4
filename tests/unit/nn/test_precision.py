"""The precision policy: bf16 matmuls forward and backward, float32 where it matters, and
bf16 parameters that train."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model_config

from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.model import from_mapping, parse_dtype
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.nn.precision import dot_f32
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training import optim
from flaxformer_lite.training.state import create_state
from flaxformer_lite.training.step import train_step

DOT = re.compile(
    r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)"
)


def _dots(text: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) tensor types of every dot_general of a StableHLO module."""
    return DOT.findall(text)


def _batch(rows=4):
    rng = np.random.default_rng(0)
    inputs = rng.integers(4, 50, (rows, 9)).astype(np.int32)
    targets = rng.integers(4, 50, (rows, 7)).astype(np.int32)
    inputs[:, 6:] = 0
    targets[:, 5:] = 0
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


@pytest.mark.parametrize("subscripts", ["th,sh->ts", "md,vd->mv", "btnh,bsnh->bnts"])
def test_dot_f32_gradient_is_the_rounded_float32_gradient(subscripts):
    """Two ways: the bf16 custom gradient equals the float32 gradient of the same bf16
    operands to bf16 rounding; with float32 operands it is the plain einsum's exactly."""
    a_sub, b_sub = subscripts.split("->")[0].split(",")
    sizes = {c: 3 + i for i, c in enumerate(sorted(set(a_sub + b_sub)))}
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    a = jax.random.normal(k[0], [sizes[c] for c in a_sub])
    b = jax.random.normal(k[1], [sizes[c] for c in b_sub])
    out = jnp.einsum(subscripts, a, b)
    g = jax.random.normal(k[2], out.shape)

    def loss(f, a, b):
        return jnp.sum(f(a, b) * g)

    exact = functools.partial(jnp.einsum, subscripts, preferred_element_type=jnp.float32)
    ours = functools.partial(dot_f32, subscripts)
    for x, y in zip(jax.grad(loss, (1, 2))(ours, a, b), jax.grad(loss, (1, 2))(exact, a, b)):
        np.testing.assert_array_equal(x, y)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    assert ours(a16, b16).dtype == jnp.float32
    np.testing.assert_array_equal(ours(a16, b16), exact(a16, b16))
    got = jax.grad(loss, (1, 2))(ours, a16, b16)
    want = jax.grad(loss, (1, 2))(exact, a16.astype(jnp.float32), b16.astype(jnp.float32))
    for x, y in zip(got, want):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(x, np.float32), y, rtol=2e-2, atol=2e-2)
    text = jax.jit(jax.grad(functools.partial(loss, ours), (0, 1))).lower(a16, b16).as_text()
    assert all("f32" not in lhs and "f32" not in rhs for lhs, rhs, _ in _dots(text))


def _lowered_step(cfg, tx=None):
    model = AutoregressiveModel(cfg, label_smoothing=0.1)
    tx = tx or optax.adam(1e-3)
    state, _ = create_state(
        model, tx, partitioning.make_mesh(1), seed=0, source_len=9, target_len=7
    )
    step = jax.jit(functools.partial(train_step, model=model, tx=tx))
    return step, state


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_output_embedding": False, "share_embeddings": False, "target_vocab_size": 40}],
)
def test_bf16_step_has_no_float32_matmul(overrides):
    """Every matmul of a bf16-compute train step, forward and backward (attention scores,
    the vocabulary projection and their transposes included), has bf16 operands, and
    the parameters' gradients still reach float32 master weights."""
    cfg = tiny_model_config(vocab_size=50, dtype=jnp.bfloat16, **overrides)
    step, state = _lowered_step(cfg)
    dots = _dots(step.lower(state, _batch()).as_text())
    assert len(dots) > 20
    fp32 = [d for d in dots if "f32" in d[0] or "f32" in d[1]]
    assert fp32 == []
    fp32_step, _ = _lowered_step(cfg.replace(dtype=jnp.float32))
    assert all("bf16" not in d[0] for d in _dots(fp32_step.lower(state, _batch()).as_text()))


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_bf16_parameters_train_with_moments_in_the_chosen_dtype(state_dtype):
    """param_dtype=bfloat16 trains (the step once failed in lax.cond: float32 gradients made
    Adam's moments float32); the moments live in optim.state_dtype; the loss falls."""
    cfg = tiny_model_config(vocab_size=50, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    tx = optax.adam(3e-3)
    if state_dtype != "bfloat16":
        tx = optim.in_dtype(tx, jnp.dtype(state_dtype))
    step, state = _lowered_step(cfg, tx)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    batch = _batch(8)
    losses = []
    for _ in range(25):
        state, sums = step(state, batch)
        assert float(sums["nonfinite"]) == 0.0
        losses.append(float(sums["loss"] / sums["tokens"]))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(state_dtype)}
    assert losses[-1] < 0.6 * losses[0]


def test_auto_dtype_is_the_platforms_and_bad_names_are_refused():
    assert parse_dtype("dtype", "auto", "cpu") == jnp.float32
    assert parse_dtype("dtype", "auto", "gpu") == jnp.bfloat16
    assert parse_dtype("dtype", "auto", "tpu") == jnp.bfloat16
    assert from_mapping({"dtype": "auto"}).dtype == jnp.float32  # this host is a CPU
    with pytest.raises(ConfigError, match="model.dtype='bfloat61' is not a dtype name"):
        from_mapping({"dtype": "bfloat61"})
    with pytest.raises(ConfigError, match="model.param_dtype='auto'"):
        from_mapping({"param_dtype": "auto"})
