"""Data-parallel training on several devices equals training on one (same code path)."""

import os
import subprocess
import sys

import numpy as np
from conftest import ROOT, assert_params_close

SCRIPT = """
import sys
import jax
import numpy as np
sys.path.insert(0, {root!r})
sys.path.insert(0, {root!r} + "/tests")
from conftest import tiny_config
from flaxformer_lite import train_lib
assert jax.device_count() == {devices}, jax.devices()
config = tiny_config({tfds!r}, num_steps=8, checkpoint_every=8)
train_lib.train_and_evaluate(config, {workdir!r}, log=lambda s: None)
_, state, _, _ = train_lib.restore_trained({workdir!r})
leaves = {{jax.tree_util.keystr(p): np.asarray(x) for p, x in
          jax.tree_util.tree_flatten_with_path(state.params)[0]}}
np.savez({out!r}, **leaves)
"""


def _train(devices: int, tfds_dir: str, tmp_path) -> dict:
    out = str(tmp_path / f"params_{devices}.npz")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    code = SCRIPT.format(
        root=ROOT, devices=devices, tfds=tfds_dir, workdir=str(tmp_path / f"run_{devices}"), out=out
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(np.load(out))


def test_four_device_data_parallel_equals_one_device(tfds_dir, tmp_path):
    one = _train(1, tfds_dir, tmp_path)
    four = _train(4, tfds_dir, tmp_path)
    assert_params_close(four, one)
