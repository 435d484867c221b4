"""Loss and schedule against hand computations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.training import optim


def test_label_smoothed_loss_equals_hand_computation():
    logits = jnp.array([[[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4]]])  # [1, 2, V=4]
    labels = jnp.array([[2, 0]])  # second position is padding
    eps = 0.1
    smoothed, nll = cross_entropy.cross_entropy(logits, labels, eps)
    row = np.array([2.0, 0.5, -1.0, 0.0])
    log_p = row - math.log(np.exp(row).sum())
    q = np.full(4, eps / 3)
    q[2] = 1 - eps
    assert float(smoothed[0, 0]) == pytest.approx(-(q * log_p).sum(), rel=1e-6)
    assert float(nll[0, 0]) == pytest.approx(-log_p[2], rel=1e-6)
    assert float(smoothed[0, 1]) == 0.0 and float(nll[0, 1]) == 0.0


def test_smoothed_loss_equals_the_explicit_target_distribution():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 7, 50)) * 3.0, jnp.float32)
    labels = jnp.asarray(rng.integers(1, 50, size=(3, 7)))
    q = cross_entropy.smoothed_targets(labels, 50, 0.2)  # [B, T, V]
    want = -jnp.sum(q * jax.nn.log_softmax(logits), axis=-1)
    smoothed, _ = cross_entropy.cross_entropy(logits, labels, 0.2)
    np.testing.assert_allclose(smoothed, want, rtol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_hand_written_gradient_equals_autodiff_of_the_definition(eps):
    # The loss has a custom VJP; autodiff of -sum_v q_v log_softmax(logits)_v
    # (and of -log p_label) is the reference. Padding and large logits included,
    # and cotangents on both outputs, as when a caller mixes them.
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(3, 6, 40)) * 8.0, jnp.float32)
    labels = jnp.asarray(rng.integers(1, 40, size=(3, 6))).at[1, 4:].set(0)
    w_s, w_n = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32), 0.3

    def reference(x):
        weights = (labels != 0).astype(jnp.float32)
        log_p = jax.nn.log_softmax(x)
        q = cross_entropy.smoothed_targets(labels, 40, eps)
        smoothed = -jnp.sum(q * log_p, axis=-1) * weights
        nll = -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0] * weights
        return jnp.sum(w_s * smoothed) + w_n * jnp.sum(nll)

    def ours(x):
        smoothed, nll = cross_entropy.cross_entropy(x, labels, eps)
        return jnp.sum(w_s * smoothed) + w_n * jnp.sum(nll)

    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-5)
    got, want = jax.grad(ours)(logits), jax.grad(reference)(logits)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.all(np.asarray(got)[1, 4:] == 0.0)  # no gradient from padding


def test_gradient_flows_back_to_bfloat16_logits():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 16)), jnp.bfloat16)
    labels = jnp.array([[1, 2, 3], [4, 5, 0]])
    grad = jax.grad(lambda x: cross_entropy.cross_entropy(x, labels, 0.1)[0].sum())(logits)
    assert grad.dtype == jnp.bfloat16 and grad.shape == logits.shape
    assert np.all(np.isfinite(np.asarray(grad, np.float32)))


def test_no_smoothing_is_plain_cross_entropy():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 11)), jnp.float32)
    labels = jnp.asarray(rng.integers(1, 11, size=(3, 5)))
    smoothed, nll = cross_entropy.cross_entropy(logits, labels, 0.0)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(smoothed, ref, rtol=1e-6)
    np.testing.assert_allclose(nll, ref, rtol=1e-6)


def test_metric_sums_count_tokens_and_sequences():
    logits = jnp.array(np.eye(4)[[[1, 2, 3], [1, 1, 0], [0, 0, 0]]] * 5.0)  # argmax = index
    labels = jnp.array([[1, 2, 3], [1, 2, 0], [0, 0, 0]])  # row 2 is a padding row
    sums = cross_entropy.metrics_sums(logits, labels, 0.0)
    assert float(sums["tokens"]) == 5.0
    assert float(sums["correct"]) == 4.0
    assert float(sums["sequences"]) == 2.0
    assert float(sums["seq_correct"]) == 1.0
    summary = cross_entropy.summarize({k: float(v) for k, v in sums.items()})
    assert summary["token_accuracy"] == pytest.approx(0.8)
    assert summary["perplexity"] == pytest.approx(math.exp(summary["nll"]))


def test_packed_sequence_accuracy_counts_each_segment():
    # Row 0 packs three examples (segments 1, 2, 3), row 1 one; argmax = index.
    labels = jnp.array([[1, 2, 3, 1, 2, 0], [3, 3, 3, 3, 0, 0]])
    predicted = jnp.array([[1, 2, 1, 1, 2, 0], [3, 3, 3, 3, 0, 0]])
    segments = jnp.array([[1, 1, 2, 3, 3, 0], [1, 1, 1, 1, 0, 0]])
    logits = jnp.array(np.eye(4)[predicted] * 5.0)
    sums = cross_entropy.metrics_sums(logits, labels, 0.0, segments)
    assert float(sums["sequences"]) == 4.0  # examples, not rows
    assert float(sums["seq_correct"]) == 3.0  # segment 2 of row 0 is wrong
    assert float(sums["tokens"]) == 9.0 and float(sums["correct"]) == 8.0
    # Without segments each row is one sequence: row 0 counts as wrong.
    assert float(cross_entropy.metrics_sums(logits, labels, 0.0)["seq_correct"]) == 1.0


@pytest.mark.parametrize("step", [1, 100, 3999, 4000, 4001, 100000])
def test_schedule_is_the_paper_formula(step):
    schedule = optim.paper_schedule(d_model=512, warmup_steps=4000)
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    # optax passes the 0-based count of updates already made.
    assert float(schedule(step - 1)) == pytest.approx(expected, rel=1e-5)


def test_other_schedules():
    const = optim.make_schedule(
        "constant", d_model=8, warmup_steps=10, learning_rate=0.1, total_steps=100
    )
    assert float(const(5)) == pytest.approx(0.05)
    assert float(const(50)) == pytest.approx(0.1)
    cos = optim.make_schedule(
        "cosine", d_model=8, warmup_steps=10, learning_rate=0.1, total_steps=100
    )
    assert float(cos(100)) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="schedule"):
        optim.make_schedule("linear", d_model=8, warmup_steps=1, learning_rate=1.0, total_steps=1)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_gradient_clipping_bounds_the_update_norm(weight_decay):
    # Our optimiser with grad_clip_norm=c fed huge gradients updates exactly as the
    # unclipped optimiser fed the same gradients rescaled to global norm c. Two
    # steps: Adam's first update barely depends on the gradient scale, so the
    # second (a small, unclipped gradient) is where missing clipping shows.
    c = 1.0
    sched = optax.constant_schedule(0.1)
    clipped = optim.make_optimizer(sched, grad_clip_norm=c, weight_decay=weight_decay)
    plain = optim.make_optimizer(sched, weight_decay=weight_decay)
    params = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([0.3])}
    huge = {"w": jnp.array([300.0, 400.0, 0.0]), "b": jnp.array([1200.0])}  # norm 1300
    small = {"w": jnp.array([0.1, -0.2, 0.05]), "b": jnp.array([0.1])}  # norm < c
    rescaled = jax.tree.map(lambda g: g * (c / 1300.0), huge)

    def run(tx, grads_seq):
        state, p, updates = tx.init(params), params, []
        for g in grads_seq:
            u, state = tx.update(g, state, p)
            p = optax.apply_updates(p, u)
            updates.append(u)
        return updates

    got = run(clipped, [huge, small])
    want = run(plain, [rescaled, small])
    unclipped = run(plain, [huge, small])
    for g, w in zip(got, want):
        for name in params:
            np.testing.assert_allclose(g[name], w[name], rtol=1e-6, atol=1e-9)
    assert not np.allclose(got[1]["w"], unclipped[1]["w"], rtol=1e-3)
