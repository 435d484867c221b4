"""training/restore.py on a tiny trained workdir: exact params, averaging, integrity, no moments."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_config

from flaxformer_lite.config.run import parse
from flaxformer_lite.training import checkpoint_format, load_state, loop, restore
from flaxformer_lite.training.workdir import CHECKPOINT_DIR, load_run_config


@pytest.fixture(scope="module")
def workdir(tfds_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("restore") / "run")
    # Checkpoints at steps 10 and 20.
    loop.train_and_evaluate(parse(tiny_config(tfds_dir, num_steps=20)), path, log=lambda s: None)
    return path


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def rewrite_state(workdir: str, step: int, edit) -> None:
    """Replaces the checkpoint's state item by `edit(state as saved)`, keeping its meta item
    (and so the checksums saved with the original state)."""
    import orbax.checkpoint as ocp

    path = os.path.join(workdir, CHECKPOINT_DIR, str(step), restore.STATE_ITEM)
    checkpointer = ocp.PyTreeCheckpointer()
    state = jax.tree.map(np.array, checkpointer.restore(path))  # writable host copies
    checkpointer.save(path, edit(state), force=True)


def copy_of(workdir, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    return copy


def test_restored_params_equal_the_train_states(workdir):
    for step in (10, 20, None):
        params, run_config = restore.restore_params(workdir, step)
        _, state, _, _ = load_state.restore_trained(workdir, step)
        assert jax.tree.structure(params) == jax.tree.structure(state.params)
        for a, b in zip(leaves(params), leaves(state.params)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    assert run_config == load_run_config(workdir)


def test_averaging_is_the_mean_of_the_checkpoints(workdir):
    averaged, _ = restore.restore_params(workdir, average=2)
    first, _ = restore.restore_params(workdir, 10)
    last, _ = restore.restore_params(workdir, 20)
    for mean, a, b in zip(leaves(averaged), leaves(first), leaves(last)):
        np.testing.assert_allclose(mean, (a.astype(np.float32) + b) / 2, rtol=1e-6)
    # Averaging up to step 10 has only one checkpoint to average.
    with pytest.raises(FileNotFoundError, match="averaging 2 checkpoints needs 2 up to step 10"):
        restore.restore_params(workdir, 10, average=2)
    with pytest.raises(FileNotFoundError, match="available steps: 10, 20"):
        restore.restore_params(workdir, 15)


def test_a_flipped_params_byte_raises(workdir, tmp_path):
    copy = copy_of(workdir, tmp_path)

    def flip(state):
        kernel = state["params"]["encoder"]["layer_0"]["self_attention"]["out_kernel"]
        kernel.view(np.uint8).reshape(-1)[7] ^= 0x10  # one byte of one float
        return state

    rewrite_state(copy, 20, flip)
    with pytest.raises(checkpoint_format.CheckpointIntegrityError, match="out_kernel"):
        restore.restore_params(copy)
    restore.restore_params(copy, 10)  # the other checkpoint is intact
    with pytest.raises(checkpoint_format.CheckpointIntegrityError):
        restore.restore_params(copy, average=2)


def test_no_optimizer_moments_are_read(workdir, tmp_path):
    copy = copy_of(workdir, tmp_path)
    rewrite_state(copy, 20, lambda state: {k: v for k, v in state.items() if k != "opt_state"})
    # The full train state cannot come back any more; the parameters still do, unchanged.
    with pytest.raises((ValueError, KeyError)):
        load_state.restore_trained(copy)
    params, _ = restore.restore_params(copy)
    want, _ = restore.restore_params(workdir)
    for a, b in zip(leaves(params), leaves(want)):
        np.testing.assert_array_equal(a, b)
    # And no optimiser library is even imported.
    code = (
        "import sys; from flaxformer_lite.training import restore; "
        f"restore.restore_params({copy!r}); assert 'optax' not in sys.modules, 'optax imported'"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def _set_scan_layers(workdir: str, scanned: bool) -> None:
    """Rewrites the workdir's run config as a run with `model.scan_layers=scanned` saves it."""
    import json

    path = os.path.join(workdir, "run_config.json")
    with open(path) as f:
        saved = json.load(f)
    saved["model"]["scan_layers"] = scanned
    with open(path, "w") as f:
        json.dump(saved, f)


def test_checkpoints_restore_across_the_layer_layouts(workdir, tmp_path, tfds_dir):
    """A per-layer checkpoint (an unrolled run's, or a scanned run's written before scanned
    parameters were stored stacked) restores into a model that stores them stacked, and a
    stacked one into an unrolled model: the same numbers, parameters and Adam's moments,
    and a resume may flip `model.scan_layers`."""
    from flaxformer_lite.models import layer_layout

    _, state, _, _ = load_state.restore_trained(workdir, 20)
    old = copy_of(workdir, tmp_path)
    _set_scan_layers(old, True)
    params, _ = restore.restore_params(old, 20)
    assert "layers" in params["decoder"] and "layer_0" not in params["decoder"]
    assert jax.tree.structure(params) == jax.tree.structure(layer_layout.stack(state.params))
    for a, b in zip(leaves(params), leaves(layer_layout.stack(state.params)), strict=True):
        np.testing.assert_array_equal(a, b)
    _, scanned, _, _ = load_state.restore_trained(old, 20)
    want = layer_layout.stack(state)
    assert jax.tree.structure(scanned) == jax.tree.structure(want)
    for a, b in zip(leaves(scanned), leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)

    stacked = str(tmp_path / "stacked")
    shutil.copytree(workdir, stacked)
    rewrite_state(stacked, 20, layer_layout.stack)  # as a scanned run writes it
    params, _ = restore.restore_params(stacked, 20)  # its run config reads them unrolled
    for a, b in zip(leaves(params), leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    _, unrolled, _, _ = load_state.restore_trained(stacked, 20)
    for a, b in zip(leaves(unrolled), leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)

    config = tiny_config(tfds_dir, num_steps=21)
    config.model.scan_layers = True
    lines = []
    loop.train_and_evaluate(parse(config), old, log=lines.append)
    assert any("resumed from step 20" in line for line in lines), lines
