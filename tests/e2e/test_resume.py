"""Resuming with bucketed or packed batches equals an uninterrupted run."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config

from flaxformer_lite.config.run import parse
from flaxformer_lite.training import load_state, loop
from flaxformer_lite.training.workdir import CHECKPOINT_DIR

STEPS, STOP = 8, 4  # the resumed run stops after STOP steps, then continues to STEPS


def _config(tfds_dir, batching, num_steps):
    config = tiny_config(tfds_dir, num_steps=num_steps, checkpoint_every=STOP, log_every=1)
    config.data.batching = batching
    config.model.dropout_rate = 0.1  # dropout keys must follow the step across the resume
    config.train.num_examples_to_print = 0
    return config


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}


@pytest.mark.parametrize(("batching", "stopped"), [("bucket", "killed"), ("pack", "finished")])
def test_resume_equals_uninterrupted_run(tfds_dir, tmp_path, batching, stopped):
    """One uninterrupted run, checkpointed at STOP and STEPS, against one resumed from STOP:
    killed (a copy of the run with its last checkpoint removed), or finished (a run of
    num_steps=STOP, evaluated, then continued with num_steps=STEPS). The resumed run must
    reproduce the uninterrupted one exactly."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    loop.train_and_evaluate(parse(_config(tfds_dir, batching, STEPS)), straight, log=lambda s: None)
    if stopped == "killed":
        shutil.copytree(straight, resumed)
        shutil.rmtree(os.path.join(resumed, CHECKPOINT_DIR, str(STEPS)))
    else:
        loop.train_and_evaluate(
            parse(_config(tfds_dir, batching, STOP)), resumed, log=lambda s: None
        )
    with open(os.path.join(resumed, "metrics.jsonl"), "w"):
        pass  # the continuation's records alone
    messages = []
    loop.train_and_evaluate(parse(_config(tfds_dir, batching, STEPS)), resumed, log=messages.append)
    assert any(f"resumed from step {STOP}" in m for m in messages), messages
    assert any(f"train batches: {batching}" in m for m in messages), messages

    _, a, _, _ = load_state.restore_trained(straight)
    _, b, _, _ = load_state.restore_trained(resumed)
    assert int(a.step) == int(b.step) == STEPS
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Every step after the resume point saw the same batch: the same loss.
    losses_a, losses_b = _losses(straight), _losses(resumed)
    assert set(losses_b) == set(range(STOP + 1, STEPS + 1))
    assert losses_b == {s: losses_a[s] for s in losses_b}
