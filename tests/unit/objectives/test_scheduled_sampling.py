"""Scheduled sampling: schedules, the mixing of inputs, and the two-pass loss against a
direct computation."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model_config

from configs import tiny
from flaxformer_lite.config import ConfigError, variants
from flaxformer_lite.config import run as run_config
from flaxformer_lite.constants import BOS_ID, PAD_ID
from flaxformer_lite.models.autoregressive import AutoregressiveModel, shift_right
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.objectives import scheduled_sampling as ss
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training.state import create_state
from flaxformer_lite.training.step import train_step

CFG = tiny_model_config(vocab_size=50, d_ff=64, dropout_rate=0.0)
KEY = jax.random.key(0)


def _batch(seed=0, rows=8):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(4, 50, (rows, 9)).astype(np.int32)
    targets = rng.integers(4, 50, (rows, 7)).astype(np.int32)
    for r in range(rows):  # ragged lengths
        inputs[r, 3 + r % 6 :] = PAD_ID
        targets[r, 2 + r % 5] = 3
        targets[r, 3 + r % 5 :] = PAD_ID
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


@functools.cache
def _params():
    # Jitted: one compile where an eager init dispatches each op.
    init = jax.jit(
        lambda key: AutoregressiveModel(CFG).init(key, {"inputs": (2, 9), "targets": (2, 7)})
    )
    return init(KEY)


def _loss(model, batch, step=0, rng=KEY):
    return jax.jit(model.loss)(_params(), batch, rng, jnp.asarray(step))


@pytest.mark.parametrize(
    "fields, step, expected",
    [
        (dict(schedule="linear", k=1.0, c=1e-3), 300, 0.7),
        (dict(schedule="linear", k=1.0, c=1e-3, eps_min=0.8), 300, 0.8),
        (dict(schedule="linear", k=0.9, c=1e-3, warmup_steps=100), 50, 1.0),
        (dict(schedule="linear", k=0.9, c=1e-3, warmup_steps=100), 300, 0.9 - 0.2),
        (dict(schedule="exponential", k=0.99), 0, 1.0),
        (dict(schedule="exponential", k=0.99), 250, 0.99**250),
        (dict(schedule="inverse_sigmoid", k=100.0), 0, 100 / 101),
        (dict(schedule="inverse_sigmoid", k=100.0), 460, 100 / (100 + math.exp(4.6))),
        (dict(schedule="inverse_sigmoid", k=10.0), 10**6, 0.0),  # exp overflows: no NaN
        (dict(schedule="constant", k=0.25), 12345, 0.25),
    ],
)
def test_schedules_equal_their_formulas(fields, step, expected):
    eps = ss.gold_probability(
        variants.ScheduledSampling(mode="argmax", **fields), jnp.asarray(step)
    )
    np.testing.assert_allclose(float(eps), expected, rtol=1e-5, atol=1e-7)


def test_mixing_replaces_the_expected_share_and_never_bos_or_padding():
    b, t, v = 64, 40, 11
    inputs = np.full((b, t), 5, np.int32)
    inputs[:, 0] = BOS_ID
    inputs[:, 30:] = PAD_ID
    inputs[::2, 15] = BOS_ID  # packed rows: a second example starts here
    logits = jax.random.normal(jax.random.key(1), (b, t, v))
    cfg = variants.ScheduledSampling(mode="argmax")
    use, _ = ss.mix_inputs(cfg, logits, jnp.asarray(inputs), jnp.float32(0.3), KEY, BOS_ID)
    use = np.asarray(use)
    allowed = (inputs != BOS_ID) & (inputs != PAD_ID)
    assert not use[~allowed].any()
    n = allowed.sum()
    share = use[allowed].mean()
    assert abs(share - 0.7) < 4 * math.sqrt(0.7 * 0.3 / n)  # 4 standard deviations
    for eps, expected in ((1.0, 0.0), (0.0, 1.0)):
        use, _ = ss.mix_inputs(cfg, logits, jnp.asarray(inputs), jnp.float32(eps), KEY, BOS_ID)
        assert np.asarray(use)[allowed].mean() == expected


@pytest.mark.parametrize("mode", ["argmax", "sample", "soft"])
def test_replacements_come_from_the_previous_position(mode):
    """Position t's prediction is token 10 + t (sharply): input t must get 10 + t - 1."""
    b, t, v = 3, 6, 20
    logits = jnp.full((b, t, v), -30.0).at[:, jnp.arange(t), 10 + jnp.arange(t)].set(30.0)
    inputs = jnp.full((b, t), 5).at[:, 0].set(BOS_ID)
    cfg = variants.ScheduledSampling(mode=mode)
    use, new = ss.mix_inputs(cfg, logits, inputs, jnp.float32(0.0), KEY, BOS_ID)
    assert np.asarray(use)[:, 1:].all() and not np.asarray(use)[:, 0].any()
    tokens = np.asarray(new.argmax(-1) if mode == "soft" else new)
    np.testing.assert_array_equal(tokens[:, 1:], np.broadcast_to(10 + np.arange(t - 1), (b, t - 1)))


def test_two_pass_loss_equals_teacher_forcing_on_the_fed_predictions():
    """eps = 0, argmax: the loss is the teacher-forced loss of the decoder reading BOS +
    pass 1's argmax predictions (computed here the direct way) at every real position."""
    batch = _batch()
    base = AutoregressiveModel(CFG)
    model = dataclasses.replace(
        base,
        scheduled_sampling=variants.ScheduledSampling(mode="argmax", schedule="constant", k=0.0),
    )
    params = _params()
    inputs = shift_right(batch["targets"], BOS_ID)
    forward = jax.jit(lambda p, x, y: base.module.apply({"params": p}, x, y))
    logits1 = forward(params, batch["inputs"], inputs)
    predicted = jnp.argmax(logits1, -1)
    assert not np.any(np.asarray(predicted) == PAD_ID)  # else the direct masks would differ
    fed = jnp.where(
        inputs == PAD_ID, PAD_ID, jnp.concatenate([inputs[:, :1], predicted[:, :-1]], 1)
    )
    logits2 = forward(params, batch["inputs"], fed)
    direct = cross_entropy.metrics_sums(logits2, batch["targets"], 0.0)
    loss, sums = _loss(model, batch)
    np.testing.assert_allclose(float(loss), float(direct["loss"]), rtol=1e-5)
    assert float(sums["ss_replaced"]) == float(sums["ss_replaceable"]) > 0


@pytest.mark.parametrize("passes", [2, 3])
def test_gold_probability_one_gives_the_teacher_forced_loss(passes):
    batch = _batch(1)
    base = AutoregressiveModel(CFG)
    cfg = variants.ScheduledSampling(mode="soft", schedule="constant", k=1.0, passes=passes)
    loss, sums = _loss(dataclasses.replace(base, scheduled_sampling=cfg), batch)
    np.testing.assert_allclose(float(loss), float(_loss(base, batch)[0]), rtol=1e-6)
    assert float(sums["ss_replaced"]) == 0


def test_soft_mixing_at_low_temperature_equals_argmax():
    batch = _batch(2)
    base = AutoregressiveModel(CFG)
    fields = dict(schedule="constant", k=0.0)
    argmax = dataclasses.replace(
        base, scheduled_sampling=variants.ScheduledSampling("argmax", **fields)
    )
    soft = dataclasses.replace(
        base, scheduled_sampling=variants.ScheduledSampling("soft", temperature=1e-4, **fields)
    )
    np.testing.assert_allclose(float(_loss(soft, batch)[0]), float(_loss(argmax, batch)[0]), 1e-5)
    warm = dataclasses.replace(
        base, scheduled_sampling=variants.ScheduledSampling("soft", temperature=1.0, **fields)
    )
    assert abs(float(_loss(warm, batch)[0]) - float(_loss(argmax, batch)[0])) > 1e-3


def test_gradient_all_reaches_the_first_pass_only_in_soft_mode():
    batch = _batch(3)
    base = AutoregressiveModel(CFG)

    def grads(**fields):
        model = dataclasses.replace(
            base,
            scheduled_sampling=variants.ScheduledSampling(schedule="constant", k=0.0, **fields),
        )
        return jax.jit(jax.grad(lambda p: model.loss(p, batch, KEY, jnp.asarray(0))[0]))(_params())

    last, every = grads(mode="soft", gradient="last"), grads(mode="soft", gradient="all")
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), last, every)
    assert max(jax.tree.leaves(diff)) > 1e-6


def _state(model, tx):
    state, _ = create_state(
        model, tx, partitioning.make_mesh(1), seed=0, source_len=9, target_len=7
    )
    return state


def test_off_is_bit_identical_and_on_trains_in_the_jitted_step():
    """Two SGD steps: mode off (whatever its other fields) gives the very same parameters as
    a model without scheduled sampling; argmax mixing gives other ones and reports its share."""
    tx = optax.sgd(0.5)
    off = variants.ScheduledSampling(mode="off", schedule="constant", k=0.0, passes=3)
    on = variants.ScheduledSampling(mode="argmax", schedule="constant", k=0.5)
    results = {}
    for name, sampling in (("none", None), ("off", off), ("on", on)):
        model = AutoregressiveModel(CFG, label_smoothing=0.1)
        if sampling is not None:
            model = dataclasses.replace(model, scheduled_sampling=sampling)
        step = jax.jit(functools.partial(train_step, model=model, tx=tx))
        state = _state(model, tx)
        for i in range(2):
            state, sums = step(state, _batch(i))
        results[name] = (state.params, sums)
    same = jax.tree.map(np.array_equal, results["none"][0], results["off"][0])
    assert all(jax.tree.leaves(same))
    moved = jax.tree.map(np.array_equal, results["none"][0], results["on"][0])
    assert not all(jax.tree.leaves(moved))
    sums = results["on"][1]
    assert "ss_replaced" not in results["off"][1]
    assert 0.2 < float(sums["ss_replaced"]) / float(sums["ss_replaceable"]) < 0.8


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(mode="greedy"), "scheduled_sampling.mode='greedy' is not one of"),
        (dict(schedule="exponential", k=1.0), "0 < k < 1"),
        (dict(schedule="inverse_sigmoid", k=0.5), "k >= 1"),
        (dict(mode="argmax", gradient="all"), "use mode='soft'"),
        (dict(passes=1), "scheduled_sampling.passes must be an integer >= 2"),
        (dict(eps_min=1.5), "scheduled_sampling.eps_min must be a number in [0, 1]"),
        (dict(temperatur=1.0), "scheduled_sampling.temperatur is not a scheduled_sampling field"),
    ],
)
def test_bad_settings_name_the_field(fields, words):
    config = tiny.get_config()
    for name, value in fields.items():
        config.scheduled_sampling[name] = value
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        run_config.parse(config)


def test_config_without_the_section_is_teacher_forcing():
    config = tiny.get_config()
    del config["scheduled_sampling"]
    assert variants.scheduled_sampling_section(config) == variants.ScheduledSampling()
    assert not variants.scheduled_sampling_section(config).enabled


def test_direct_settings_are_checked_too():
    for fields in (dict(mode="greedy"), dict(passes=1), dict(temperature=0.0)):
        with pytest.raises(ValueError):
            variants.ScheduledSampling(**fields)
