"""The parts of fault handling that need no training run: the train step's non-finite
guard, the loop's reading of it, early stopping, and the stop-signal handler."""

import functools
import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite.training import preemption
from flaxformer_lite.training.early_stopping import EarlyStopping
from flaxformer_lite.training.nonfinite import NonFiniteError, NonFiniteGuard
from flaxformer_lite.training.state import TrainState
from flaxformer_lite.training.step import train_step


class LinearModel:
    """The model protocol's `loss` for a linear score: loss = sum(w * x) per token."""

    def loss(self, params, batch, rng, step):
        loss = jnp.sum(params["w"] * batch["x"])
        return loss, {"loss": loss, "tokens": jnp.float32(1.0)}


def _state(tx):
    params = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}
    return TrainState(
        step=jnp.int32(0),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.PRNGKey(0),
    )


def _run(tx, x):
    step = jax.jit(functools.partial(train_step, model=LinearModel(), tx=tx))
    return step(_state(tx), {"x": jnp.asarray(x, jnp.float32)})


@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_a_finite_step_is_the_plain_optax_update(tx):
    x = np.array([1.0, 2.0, -3.0], np.float32)
    state, sums = _run(tx, x)
    start = _state(tx)
    updates, opt_state = tx.update({"w": jnp.asarray(x)}, start.opt_state, start.params)
    want = optax.apply_updates(start.params, updates)
    np.testing.assert_array_equal(state.params["w"], want["w"])
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(opt_state)):
        np.testing.assert_array_equal(a, b)
    assert float(sums["nonfinite"]) == 0.0 and int(state.step) == 1


@pytest.mark.parametrize(
    "x, tx, code",
    [
        ([1.0, np.inf, 0.0], optax.sgd(0.1), 2),  # the loss
        ([0.0, 0.0, 0.0], None, 1),  # finite loss, but the gradient overflows
        ([10.0, 10.0, 10.0], optax.sgd(3e38), 3),  # finite gradient, the update overflows
    ],
    ids=["loss", "gradient", "update"],
)
def test_a_nonfinite_step_leaves_the_state_unchanged(x, tx, code):
    if tx is None:  # loss = w . x with w = 0 on the huge entries: gradient x, norm inf
        tx = optax.sgd(0.1)
        x = [3e38, 3e38, 0.0]
        model = LinearModel()
        start = _state(tx).replace(params={"w": jnp.zeros(3, jnp.float32)})
        state, sums = jax.jit(functools.partial(train_step, model=model, tx=tx))(
            start, {"x": jnp.asarray(x, jnp.float32)}
        )
    else:
        start = _state(tx)
        state, sums = _run(tx, x)
    assert float(sums["nonfinite"]) == code
    np.testing.assert_array_equal(state.params["w"], start.params["w"])
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(start.opt_state)):
        np.testing.assert_array_equal(a, b)
    assert int(state.step) == 1  # the step counts: the data sequence is unchanged
    assert float(sums["loss"]) == float(sums["tokens"]) == float(sums["grad_norm"]) == 0.0


def _flags(codes):
    return [{"nonfinite": jnp.float32(c)} for c in codes]


def test_guard_stop_names_the_step_and_what():
    guard = NonFiniteGuard("stop", 10, log=lambda s: None)
    for done, sums in enumerate(_flags([0, 0, 1, 0]), start=1):
        guard.add(done, sums)
    guard.check(2)  # steps 1 and 2 read, 3 and 4 still pending
    assert guard.last_finite == 2
    with pytest.raises(NonFiniteError, match="gradient norm was not finite at step 3"):
        guard.check(0)


def test_guard_skip_counts_and_stops_after_n_in_a_row():
    logged = []
    guard = NonFiniteGuard("skip", 3, log=logged.append)
    for done, sums in enumerate(_flags([2, 2, 0, 2, 2]), start=1):
        guard.add(done, sums)
    guard.check(0)  # two in a row, then a finite step resets the count
    assert guard.skipped == 4 and len(logged) == 4
    assert "step 5: the loss was not finite; update skipped (2 in a row, 4 in this run)" in logged
    guard.add(6, {"nonfinite": jnp.float32(3)})
    with pytest.raises(NonFiniteError, match="3 steps in a row .*update, at step 6"):
        guard.check(0)


def test_early_stopping_counts_evaluations_without_a_new_best_and_resumes():
    stop = EarlyStopping("exact_match", "max", patience=2)
    assert stop.update(10, {"exact_match": 0.2})
    assert not stop.update(20, {"exact_match": 0.2})  # equal is not better
    assert stop.update(30, {"exact_match": 0.5}) and stop.bad_evals == 0
    assert not stop.update(40, {"exact_match": 0.4}) and not stop.exhausted
    resumed = EarlyStopping("exact_match", "max", patience=2)
    resumed.restore(stop.state())
    assert not resumed.update(50, {"exact_match": 0.1}) and resumed.exhausted
    assert "the best, 0.5000, was at step 30" in resumed.message(50)
    lower = EarlyStopping("loss", "min")
    assert lower.update(1, {"loss": 2.0}) and lower.update(2, {"loss": 1.0})
    assert not lower.exhausted  # patience 0: never stops
    other = EarlyStopping("loss", "min")
    other.restore(stop.state())  # another metric's history does not carry over
    assert other.best is None


def test_first_signal_requests_a_stop_and_the_second_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    logged = []
    with preemption.StopSignals(log=logged.append) as signals:
        assert not signals.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested() and signals.received == "SIGTERM"
        assert logged == ["SIGTERM received: finishing the current step, then saving a checkpoint"]
        assert not exits
        os.kill(os.getpid(), signal.SIGINT)
        assert exits == [128 + signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    assert "rerun the same command to resume" in str(preemption.Preempted(7, saved=True))


def test_several_processes_agree_on_a_stop_only_at_every_nth_poll(monkeypatch):
    """The agreement is a collective (a barrier): polled between steps and evaluation
    batches, it runs at every `check_every`-th poll; `requested()` agrees at once."""
    collectives = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(
        preemption.multihost_utils,
        "process_allgather",
        lambda flag: collectives.append(int(flag)) or np.array([flag, 0]),
    )
    with preemption.StopSignals(log=lambda s: None, check_every=3) as signals:
        assert [signals.poll() for _ in range(6)] == [False] * 6
        assert collectives == [0, 0]  # at polls 3 and 6 only
        os.kill(os.getpid(), signal.SIGTERM)  # the signal reaches this process
        assert [signals.poll() for _ in range(3)] == [False, False, True]
        assert signals.requested() and collectives == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="check_every"):
        preemption.StopSignals(check_every=0)


def test_a_failed_metrics_append_leaves_no_torn_line(tmp_path, monkeypatch):
    import errno

    from flaxformer_lite.training.metric_writer import MetricWriter
    from flaxformer_lite.training.workdir import WorkdirError

    writer = MetricWriter(str(tmp_path), tensorboard=False)
    writer.write(1, "train", {"loss": 2.5})
    write = os.write

    def half_then_full(fd, data):  # the disk fills up in the middle of a record
        write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(WorkdirError, match="No space left on device"):
        writer.write(2, "train", {"loss": 2.0})
    monkeypatch.setattr(os, "write", write)
    writer.write(3, "train", {"loss": 1.5})
    writer.close()
    import json

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 3]


def test_the_guard_adds_no_copy_of_the_state():
    """The guard's selection fuses into the optimiser's update: the compiled step holds no
    conditional and no copy of a parameter-shaped array (a lax.cond over the state made
    XLA copy every parameter and moment at every step)."""
    tx = optax.adam(1e-2)
    params = {"w": jnp.ones((256, 384), jnp.float32)}
    state = TrainState(jnp.int32(0), params, tx.init(params), jax.random.PRNGKey(0))
    step = jax.jit(functools.partial(train_step, model=LinearModel(), tx=tx))
    hlo = step.lower(state, {"x": jnp.ones((256, 384), jnp.float32)}).compile().as_text()
    assert " conditional(" not in hlo
    assert not re.findall(r"= f32\[256,384\]\S* copy\(", hlo)


def test_device_prefetch_sends_the_next_batch_before_yielding_this_one():
    from flaxformer_lite.training.train_data import device_prefetch

    sent = []

    def put(batch):
        sent.append(batch)
        return {"on_device": batch}

    it = device_prefetch(iter(range(4)), put, size=2)
    assert next(it) == {"on_device": 0} and sent == [0, 1]  # batch 1 already on its way
    assert next(it) == {"on_device": 1} and sent == [0, 1, 2]
    assert list(it) == [{"on_device": 2}, {"on_device": 3}] and sent == [0, 1, 2, 3]
    assert list(device_prefetch(iter([7]), put, size=3)) == [{"on_device": 7}]
