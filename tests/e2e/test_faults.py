"""Faults injected into real training runs: a preemption signal, a corrupted latest
checkpoint, non-finite losses, a full disk, early stopping, and a hung step.

Each test makes the fault happen for real (a signal to a running train.py, bytes
flipped on disk, a learning rate that overflows, a filesystem that fills up, a
step that sleeps) and checks what the run does and what it leaves on disk.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import ROOT, TRAINED_TINY_STEPS, tiny_config

from flaxformer_lite.config.run import parse
from flaxformer_lite.training import checkpoint_format, checkpoints, load_state, loop, restore
from flaxformer_lite.training.nonfinite import NonFiniteError
from flaxformer_lite.training.workdir import CHECKPOINT_DIR

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
quiet = lambda s: None  # noqa: E731
LAST = TRAINED_TINY_STEPS  # the shared tiny run's last step, checkpointed every 10 steps


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _steps(workdir):
    return checkpoint_format.list_steps(workdir)


@pytest.fixture(scope="module")
def trained(trained_tiny):
    """The shared tiny run, trained to step LAST with a checkpoint every 10 steps; tests copy
    it (training on from it with the same config gives the batches it would have seen)."""
    return trained_tiny


def _copy(trained, tmp_path, name="run"):
    path = str(tmp_path / name)
    shutil.copytree(trained, path)
    return path


def _flip_bytes(workdir, step, count=8):
    """Flips `count` bytes in the middle of the largest array file of a checkpoint."""
    state_dir = os.path.join(workdir, CHECKPOINT_DIR, str(step), "state")
    files = [os.path.join(d, f) for d, _, fs in os.walk(state_dir) for f in fs]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        data = bytearray(f.read())
        middle = len(data) // 2
        for i in range(middle, middle + count):
            data[i] ^= 0xFF
        f.seek(0)
        f.write(data)


def test_corrupted_latest_checkpoint_falls_back_to_the_newest_good_one(trained, tfds_dir, tmp_path):
    workdir = _copy(trained, tmp_path)
    _flip_bytes(workdir, LAST)
    messages = []
    results = loop.train_and_evaluate(
        parse(tiny_config(tfds_dir, num_steps=LAST)), workdir, messages.append
    )
    assert any(f"checkpoint {LAST}" in m and "unusable" in m for m in messages), messages
    assert any(f"resumed from step {LAST - 10}" in m for m in messages), messages
    assert results["step"] == LAST and _steps(workdir)[-1] == LAST  # step LAST trained again
    # The corrupted step was set aside whole, not deleted.
    aside = os.path.join(workdir, CHECKPOINT_DIR + checkpoint_format.CORRUPT_SUFFIX, str(LAST))
    assert os.path.isdir(os.path.join(aside, "state")), os.listdir(os.path.dirname(aside))
    # Training from the good step LAST - 10 gave the same step LAST as the original run.
    _, again, _, _ = load_state.restore_trained(workdir, LAST)
    _, original, _, _ = load_state.restore_trained(trained, LAST)
    for a, b in zip(_leaves(again), _leaves(original)):
        np.testing.assert_array_equal(a, b)


def test_nonfinite_loss_stops_without_a_nonfinite_checkpoint(trained, tfds_dir, tmp_path):
    workdir = _copy(trained, tmp_path)
    config = tiny_config(tfds_dir, num_steps=LAST + 20, checkpoint_every=2)
    config.optim.learning_rate = 1e9
    with pytest.raises(NonFiniteError, match=r"not finite at step (\d+); training stopped") as e:
        loop.train_and_evaluate(parse(config), workdir, log=quiet)
    assert "\n" not in str(e.value)
    bad = int(str(e.value).split("at step ")[1].split(";")[0])
    steps = _steps(workdir)
    assert LAST < bad <= LAST + 20 and steps[-1] < bad, (bad, steps)
    for step in steps:  # every checkpoint that exists is finite
        params, _ = restore.restore_params(workdir, step)
        assert all(np.isfinite(x).all() for x in _leaves(params)), step

    config.train.nonfinite, config.train.nonfinite_max_skips = "skip", 3
    messages = []
    with pytest.raises(NonFiniteError, match="3 steps in a row were not finite"):
        loop.train_and_evaluate(parse(config), workdir, log=messages.append)
    assert sum("update skipped" in m for m in messages) == 3, messages


def test_sigterm_during_the_final_evaluation_stops_it_between_batches(
    trained, tfds_dir, tmp_path, monkeypatch
):
    """A preemption notice leaves ~30 s: the evaluation stops at its next batch, the
    checkpoint of the last step is kept (verified), and the run says how to resume."""
    from flaxformer_lite.training import evaluate
    from flaxformer_lite.training.preemption import Preempted

    workdir = _copy(trained, tmp_path)
    batches = []
    rows = evaluate.partitioning.process_rows

    def signalled_rows(*args):
        if not batches:  # the signal arrives while the first batch is evaluated
            os.kill(os.getpid(), signal.SIGTERM)
        batches.append(args)
        return rows(*args)

    monkeypatch.setattr(evaluate.partitioning, "process_rows", signalled_rows)
    messages = []
    config = tiny_config(tfds_dir, num_steps=LAST + 2, eval_batch_size=4)
    with pytest.raises(Preempted) as e:
        loop.train_and_evaluate(parse(config), workdir, log=messages.append)
    assert str(e.value) == (
        f"preempted at step {LAST + 2}; checkpoint saved; rerun the same command to resume"
    )
    assert len(batches) == 1  # of many: 4 examples per batch
    stopped = f"step {LAST + 2} validation evaluation: stopped after 1 of "
    assert any(m.startswith(stopped) for m in messages)
    assert _steps(workdir)[-1] == LAST + 2
    _, state, _, _ = load_state.restore_trained(workdir)
    assert int(state.step) == LAST + 2


def test_early_stopping_keeps_the_best_checkpoint(tfds_dir, tmp_path):
    workdir = str(tmp_path / "run")
    config = tiny_config(
        tfds_dir,
        num_steps=40,
        eval_every=2,
        checkpoint_every=0,
        keep_checkpoints=1,
        keep_best_checkpoints=1,
        best_metric="exact_match",
        early_stop_patience=2,
    )
    # The first evaluations, still in the warm-up, get no sentence right: after the first
    # one (the best so far) two more without a better score end the run.
    messages = []
    results = loop.train_and_evaluate(parse(config), workdir, log=messages.append)
    matches = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if r["split"] == "validation":
                assert r["step"] not in matches  # not evaluated twice at the stop
                matches[r["step"]] = r["exact_match"]
    assert matches == {2: 0.0, 4: 0.0, 6: 0.0}, matches
    stops = [m for m in messages if m.startswith("early stop at step")]
    assert stops == [
        "early stop at step 6: validation exact_match has not improved for 2 evaluations "
        "(train.early_stop_patience=2); the best, 0.0000, was at step 2 (decode it with "
        "--step best)"
    ], messages
    assert results["step"] == 6
    assert _steps(workdir) == [2, 6]  # the last one and the best one
    assert restore.resolve_step(workdir, "best") == 2
    # A rerun has nothing left to train: it stops again at once and evaluates.
    messages = []
    again = loop.train_and_evaluate(parse(config), workdir, log=messages.append)
    assert again["step"] == 6 and any(m.startswith("early stop at step 6") for m in messages)


def _tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")


def _fill(path) -> None:
    """Writes zeros to `path` until the filesystem is full (unbuffered: nothing left to flush)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_full_disk_mid_run_keeps_the_previous_checkpoint(
    trained, tfds_dir, tmp_path, monkeypatch
):
    disk = tmp_path / "disk"
    _tmpfs(disk, "8m")
    try:
        workdir = _copy(trained, disk)
        save = checkpoints.Checkpointer.save

        def fill_then_save(self, step, *args, **kwargs):
            if step == LAST + 10:  # the disk fills up between two checkpoints
                self.wait()  # (once step LAST + 5, written in the background, is complete)
                _fill(disk / "filler")
            return save(self, step, *args, **kwargs)

        monkeypatch.setattr(checkpoints.Checkpointer, "save", fill_then_save)
        # No metrics record between the two saves: the save is what meets the full disk.
        config = tiny_config(tfds_dir, num_steps=LAST + 10, checkpoint_every=5, log_every=100)
        with pytest.raises(checkpoint_format.CheckpointWriteError) as e:
            loop.train_and_evaluate(parse(config), workdir, log=quiet)
        assert "\n" not in str(e.value), str(e.value)
        assert f"checkpoint {LAST + 10}" in str(e.value)
        assert f"(step {LAST + 5}) is kept" in str(e.value)
        assert "No space left on device" in str(e.value)
        # The last 5 (train.keep_checkpoints); nothing half-written that a resume would pick.
        assert _steps(workdir) == [LAST - 30, LAST - 20, LAST - 10, LAST, LAST + 5]
        os.remove(disk / "filler")
        _, state, _, _ = load_state.restore_trained(workdir)
        assert int(state.step) == LAST + 5
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _train_cli(workdir, tfds_dir, *flags):
    return [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.py",
        "--workdir",
        str(workdir),
        f"--config.data.tfds_dir={tfds_dir}",
        *flags,
    ]


def _wait_for_training(proc, workdir, timeout=120):
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while not (os.path.exists(metrics) and os.path.getsize(metrics)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)


SIGTERM_FLAGS = (
    "--config.train.num_steps=400",
    "--config.train.checkpoint_every=0",
    "--config.train.log_every=1",
)


def _preempt(workdir, tfds_dir, *flags) -> int:
    """Runs train.py until it has trained a step, sends SIGTERM; returns the step it saved."""
    proc = subprocess.Popen(
        _train_cli(workdir, tfds_dir, *SIGTERM_FLAGS, *flags),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_training(proc, workdir)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received: finishing the current step, then saving a checkpoint" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("preempted at step ") and last.endswith(
        "; checkpoint saved; rerun the same command to resume"
    ), err[-3000:]
    step = int(last.split()[3].rstrip(";"))
    assert 0 < step < 400 and _steps(workdir) == [step]
    return step


def test_sigterm_saves_a_checkpoint_and_exits_0(tfds_dir, tmp_path):
    workdir = tmp_path / "run"
    step = _preempt(workdir, tfds_dir)
    meta = checkpoint_format.read_meta(str(workdir), step)
    assert meta["step"] == step and meta["data"]["next_batch"] == step  # resumes at step + 1
    _, state, _, _ = load_state.restore_trained(str(workdir))
    assert int(state.step) == step


@pytest.mark.slow
def test_sigterm_then_rerun_ends_like_an_uninterrupted_run(tfds_dir, tmp_path):
    workdir = tmp_path / "run"
    step = _preempt(workdir, tfds_dir, "--config.model.dropout_rate=0.1")
    # Finish the run in-process with the same config, and compare with an uninterrupted run.
    config = tiny_config(tfds_dir, num_steps=step + 4, checkpoint_every=0, log_every=1)
    config.model.dropout_rate = 0.1
    messages = []
    loop.train_and_evaluate(parse(config), str(workdir), log=messages.append)
    assert any(f"resumed from step {step}" in m for m in messages), messages
    straight = str(tmp_path / "straight")
    loop.train_and_evaluate(parse(config), straight, log=quiet)
    _, a, _, _ = load_state.restore_trained(straight)
    _, b, _, _ = load_state.restore_trained(str(workdir))
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)


HANG = """
import sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/tests")
from conftest import tiny_config
from flaxformer_lite.config.run import parse
from flaxformer_lite.training import load_state, loop, step as step_lib

put = step_lib.device_batch
calls = []

def stuck_in_a_collective(seconds):
    time.sleep(seconds)

def device_batch(batch, mesh):
    calls.append(1)
    if len(calls) == 12:
        stuck_in_a_collective(120)
    return put(batch, mesh)

step_lib.device_batch = device_batch
config = tiny_config({tfds!r}, num_steps=40, checkpoint_every=0, log_every=1)
config.train.hang_factor, config.train.hang_min_seconds = 5.0, 3.0
loop.train_and_evaluate(parse(config), {workdir!r}, log=print)
"""


def test_a_hung_step_dumps_the_stacks_and_exits(tfds_dir, tmp_path):
    code = HANG.format(root=ROOT, tfds=tfds_dir, workdir=str(tmp_path / "run"))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - started
    assert result.returncode == 3, result.stderr[-3000:]
    # The 12th batch goes to the devices while step 11 runs (one batch ahead).
    assert "error: step 11 has run for" in result.stderr, result.stderr[-3000:]
    assert "stuck_in_a_collective" in result.stderr, result.stderr[-3000:]
    assert took < 100, took
