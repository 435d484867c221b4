"""train.py killed with SIGKILL at random moments and restarted ends bit for bit where an
uninterrupted run ends: every array of the train state, and every logged training loss.

The runs are real processes, killed wherever they are (mid-step, mid-checkpoint-save),
with dropout on and bucketed batches, so the restored dropout key and data position are
checked along with the parameters. Each train.py start costs ~10 s of imports and
compilation, so this is a slow test; the default run covers resuming in process
(tests/e2e/test_resume.py: bucketed and packed batches, bit for bit).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import ROOT

from flaxformer_lite.training import checkpoint_format, load_state

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
NUM_STEPS, CHECKPOINT_EVERY = 24, 3
TIMEOUT_S = 300  # per train.py process: a hang fails the test instead of blocking it


def train_command(workdir: str, tfds_dir: str) -> list[str]:
    return [
        sys.executable,
        "train.py",
        *("--config", "configs/tiny.py", "--workdir", workdir),
        f"--config.data.tfds_dir={tfds_dir}",
        "--config.model.dropout_rate=0.1",
        # Two buckets of the tiny task, (8, 8) and (10, 16): 32 and 16 rows.
        "--config.data.batching=bucket",
        "--config.data.max_tokens=256",
        f"--config.train.num_steps={NUM_STEPS}",
        f"--config.train.checkpoint_every={CHECKPOINT_EVERY}",
        "--config.train.log_every=1",
        "--config.train.num_examples_to_print=0",
        "--config.train.tensorboard=false",
    ]


def run_to_end(command: list[str], log_path: str) -> str:
    """Runs train.py to its end; returns its stderr."""
    with open(log_path, "w") as log:
        result = subprocess.run(
            command, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S
        )
    with open(log_path) as f:
        output = f.read()
    assert result.returncode == 0, output[-3000:]
    return output


def run_and_kill(command: list[str], workdir: str, log_path: str, delay: float) -> int:
    """Starts train.py, waits until it has written a checkpoint it did not start from, and
    SIGKILLs it `delay` seconds later. Returns the last finished checkpoint at the kill."""
    start = max(checkpoint_format.list_steps(workdir), default=0)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while max(checkpoint_format.list_steps(workdir), default=0) <= start:
            assert process.poll() is None, f"train.py ended before a checkpoint: {log_path}"
            assert time.monotonic() < deadline, f"no new checkpoint in {TIMEOUT_S} s"
            time.sleep(0.02)
        time.sleep(delay)
        assert process.poll() is None, f"train.py ended before the kill: {log_path}"
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
    return max(checkpoint_format.list_steps(workdir))


def train_records(workdir: str) -> list[dict]:
    """Every train record of metrics.jsonl; each line must parse (no torn writes)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == "train"]


@pytest.mark.slow
def test_three_kills_resume_bit_identical(tfds_dir, tmp_path):
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    run_to_end(train_command(straight, tfds_dir), str(tmp_path / "straight.log"))

    rng = random.Random(0)
    command = train_command(killed, tfds_dir)
    at_kill = []
    for attempt in range(3):
        # Up to ~8 steps (and a checkpoint save) after the new checkpoint.
        delay = rng.uniform(0.0, 0.4)
        at_kill.append(run_and_kill(command, killed, str(tmp_path / f"kill{attempt}.log"), delay))
    output = run_to_end(command, str(tmp_path / "last.log"))
    assert f"resumed from step {at_kill[-1]}" in output, (at_kill, output[-3000:])
    assert output.strip().splitlines()[-1].startswith(f"step={NUM_STEPS} ")

    _, a, _, _ = load_state.restore_trained(straight)
    _, b, _, _ = load_state.restore_trained(killed)
    assert int(a.step) == int(b.step) == NUM_STEPS
    leaves_a, leaves_b = (jax.tree_util.tree_leaves_with_path(s) for s in (a, b))
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    # Steps run again after a kill log again: every record of a step, from before or
    # after a kill, has the uninterrupted run's loss.
    want = {r["step"]: (r["loss"], r["nll"]) for r in train_records(straight)}
    got = train_records(killed)
    assert {r["step"] for r in got} == set(want) == set(range(1, NUM_STEPS + 1))
    for r in got:
        assert (r["loss"], r["nll"]) == want[r["step"]], (r["step"], at_kill)
