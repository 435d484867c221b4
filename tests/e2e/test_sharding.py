"""Training on several devices equals training on one (same code path): data parallel,
and with parameters sharded over fsdp and model axes."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, assert_params_close

SCRIPT = """
import sys
import jax
import numpy as np
sys.path.insert(0, {root!r})
sys.path.insert(0, {root!r} + "/tests")
from conftest import tiny_config
from flaxformer_lite.config.run import parse
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training import load_state, loop, optim, state as state_lib
assert jax.device_count() == {devices}, jax.devices()
config = tiny_config({tfds!r}, num_steps=8, checkpoint_every=8)
config.mesh.fsdp, config.mesh.model = {fsdp}, {model}
loop.train_and_evaluate(parse(config), {workdir!r}, log=lambda s: None)
# The layout training used: a feed-forward kernel [D, F] is split as declared.
model, _, _, _ = load_state.restore_trained({workdir!r})
run = parse(config)
abstract = state_lib.abstract_state(model, optim.of_run(run)[1], 0, 10, 16)
shardings = partitioning.logical_shardings(abstract, partitioning.mesh_from_config(run.mesh))
kernel = shardings.params["encoder"]["layer_0"]["ffn"]["wi"]["kernel"]
assert kernel.shard_shape((32, 64)) == (32 // {fsdp}, 64 // {model}), kernel
_, state, _, _ = load_state.restore_trained({workdir!r})
leaves = {{jax.tree_util.keystr(p): np.asarray(x) for p, x in
          jax.tree_util.tree_flatten_with_path(state.params)[0]}}
np.savez({out!r}, **leaves)
"""


def _train(devices: int, tfds_dir: str, tmp_path, fsdp: int = 1, model: int = 1) -> dict:
    name = f"{devices}_{fsdp}_{model}"
    out = str(tmp_path / f"params_{name}.npz")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    code = SCRIPT.format(
        root=ROOT,
        devices=devices,
        tfds=tfds_dir,
        workdir=str(tmp_path / f"run_{name}"),
        out=out,
        fsdp=fsdp,
        model=model,
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def one_device(tfds_dir, tmp_path_factory):
    return _train(1, tfds_dir, tmp_path_factory.mktemp("one"))


def test_four_device_data_parallel_equals_one_device(one_device, tfds_dir, tmp_path):
    assert_params_close(_train(4, tfds_dir, tmp_path), one_device)


def test_fsdp_and_model_sharding_equal_one_device(one_device, tfds_dir, tmp_path):
    """data=1 x fsdp=2 x model=2: every parameter and its Adam moments split 2 or 4 ways."""
    assert_params_close(_train(4, tfds_dir, tmp_path, fsdp=2, model=2), one_device)


TENSOR_PARALLEL_SCRIPT = """
import re, sys
import jax, numpy as np, optax
sys.path.insert(0, {root!r})
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training import loop
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.training.state import create_state
from flaxformer_lite.training.step import jit_train_step
GATHER = re.compile(r"= \\w+\\[([\\d,]*)\\]\\S* all-gather(?:-start)?\\(")
ANY_GATHER = re.compile(r" all-gather(?:-start)?\\(")
REDUCE = re.compile(r" all-reduce(?:-start)?\\(")

def gathered_shapes(hlo):
    shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in GATHER.findall(hlo)]
    assert len(shapes) == len(ANY_GATHER.findall(hlo)), "an all-gather the regex cannot read"
    return shapes

# An odd vocabulary: model=2 splits it only as the padded 128 rows (`nn/vocab.py`).
config = TransformerConfig(vocab_size=61, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
                           num_decoder_layers=1, max_len=16, dropout_rate=0.1)
model, tx = AutoregressiveModel(config, label_smoothing=0.1), optax.adam(1e-3)
mesh = partitioning.make_mesh(model=2)
state, shardings = create_state(model, tx, mesh, seed=0, source_len=6, target_len=6)
kernels = {{jax.tree_util.keystr(p): x for p, x in
           jax.tree_util.tree_flatten_with_path(state.params)[0] if x.ndim >= 2}}
# Every kernel is really split over model (else "nothing gathered" would be vacuous).
unsplit = [k for k, x in kernels.items() if x.sharding.shard_shape(x.shape) == x.shape]
assert not unsplit, unsplit
# The regex reads this jax's HLO: replicating one split kernel is one all-gather of its shape.
wi = kernels["['encoder']['layer_0']['ffn']['wi']['kernel']"]
control = jax.jit(lambda w: w + 1, out_shardings=partitioning.replicated(mesh))
assert gathered_shapes(control.lower(wi).compile().as_text()) == [wi.shape]

tokens = np.ones((2, 6), np.int32)
batch = partitioning.put_batch({{"inputs": tokens, "targets": tokens}}, mesh)
step = jit_train_step(model, tx, mesh, shardings)
hlo = step.lower(state, batch).compile().as_text()
gathered = gathered_shapes(hlo)
shapes = {{x.shape for x in kernels.values()}}
sizes = {{int(np.prod(x.shape)) for x in kernels.values()}}  # also kernels seen reshaped
print("all-gathered", gathered, "kernel shapes", sorted(shapes))
hit = [g for g in gathered if g in shapes or int(np.prod(g)) in sizes]
assert not hit, ("a kernel is all-gathered", hit)
# Megatron-style splitting costs O(sublayers) collectives, not O(parameters): at
# least one all-reduce per sublayer's row-split output projection (forward), a
# few more for the backward pass, the vocabulary split and the loss.
sublayers = 2 * config.num_encoder_layers + 3 * config.num_decoder_layers
reduces = len(REDUCE.findall(hlo))
print("all-reduces", reduces, "sublayers", sublayers)
assert sublayers <= reduces <= 4 * sublayers < len(jax.tree.leaves(state.params)), reduces
assert len(gathered) <= sublayers, gathered
print("checked")
"""


def test_tensor_parallel_step_gathers_no_kernel():
    """model=2 alone (no fsdp): the heads/mlp/vocab splits carry through every matmul,
    including the merged [D, N*3*H] Q/K/V projection, so no weight is ever gathered."""
    result = subprocess.run(
        [sys.executable, "-c", TENSOR_PARALLEL_SCRIPT.format(root=ROOT)],
        env=dict(
            os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("checked"), result.stdout[-2000:]


ACTIVATION_SCRIPT = """
import sys
import jax, numpy as np, optax
sys.path.insert(0, {root!r})
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.benchmarks import hlo_report
from flaxformer_lite.training.state import create_state
from flaxformer_lite.training.step import jit_train_step

B, T = 16, 10  # B*T = 160 and its shards 20: no parameter has such a dimension
# 100 entries padded to 128 rows (`nn/vocab.py`): the padded logits keep even model shards.
config = TransformerConfig(vocab_size=100, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
                           num_decoder_layers=1, max_len=16, dropout_rate=0.1)
model, tx = AutoregressiveModel(config, label_smoothing=0.1), optax.adam(1e-3)
tokens = np.random.RandomState(0).randint(1, 100, (B, T)).astype(np.int32)

def compile_step(fsdp, model_axis):
    mesh = partitioning.make_mesh(fsdp=fsdp, model=model_axis)
    state, shardings = create_state(model, tx, mesh, seed=0, source_len=T, target_len=T)
    batch = partitioning.put_batch({{"inputs": tokens, "targets": tokens}}, mesh)
    with hlo_report.capture_compile_log() as log:
        compiled = jit_train_step(model, tx, mesh, shardings).lower(state, batch).compile()
    params = [x.shape for x in jax.tree.leaves(state.params)]
    return hlo_report.collectives(compiled.as_text()), hlo_report.remat_warnings(log[0]), params

def moves_activations(c, shards):
    rows = {{B * T, B * T // shards}}
    return bool(c.shape) and (c.shape[0] in rows or c.shape[:2] in {{(B, T), (B // shards, T)}})

found, remat, params = compile_step(fsdp=8, model_axis=1)
print("fsdp=8", hlo_report.summary(found))
assert not remat, remat
moved = [c for c in found if moves_activations(c, 8)]
assert not moved, moved
# Non-vacuous: FSDP gathers the weights, and nothing else big moves.
gathered = [c.shape for c in found if c.kind == "all-gather"]
assert ({{s for s in params if len(s) == 2}} & set(gathered)), gathered
# (weights may travel reshaped: a [D, 3, N, H] kernel as [D, 3*N*H]; compare sizes)
sizes = {{int(np.prod(s)) for s in params}}
other = [c for c in found if int(np.prod(c.shape)) not in sizes and c.nbytes > 16]
assert not other, other

found, remat, _ = compile_step(fsdp=2, model_axis=2)  # data=2 x fsdp=2 x model=2
print("2x2x2", hlo_report.summary(found))
assert not remat, remat
assert not [c for c in found if c.kind in ("all-to-all", "collective-permute")], found
print("checked")
"""


def test_activations_stay_in_the_batch_layout():
    """fsdp=8: only weights (and scalars) cross devices, no [B*T, ...] activation; on a
    2x2x2 mesh XLA never falls back to replicating an array to change its layout."""
    result = subprocess.run(
        [sys.executable, "-c", ACTIVATION_SCRIPT.format(root=ROOT)],
        env=dict(
            os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("checked"), result.stdout[-2000:]


MESH_SCRIPT = """
import sys
import jax, optax
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from conftest import tiny_model_config
from flaxformer_lite.config import ConfigError
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training.state import abstract_state

mesh = partitioning.make_mesh(model=4)
assert dict(mesh.shape) == {{"data": 2, "fsdp": 1, "model": 4}}, mesh
assert partitioning.process_rows(8, mesh) == slice(0, 8)

def shardings(**fields):
    model = AutoregressiveModel(tiny_model_config(**({{"vocab_size": 32}} | fields)))
    return partitioning.logical_shardings(abstract_state(model, optax.adam(1e-3), 0, 6, 6), mesh)

kernel = shardings(d_ff=48).params["decoder"]["layer_0"]["ffn"]["wi"]["kernel"]
assert kernel.shard_shape((32, 48)) == (32, 12), kernel
try:
    shardings(d_ff=50)
except ConfigError as e:
    print(e)
    assert "params/decoder/layer_0/ffn/wi/" in str(e) and "model.d_ff" in str(e), e
    assert "50" in str(e) and "mesh.model=4" in str(e), e
else:
    raise AssertionError("d_ff=50 over mesh.model=4 was accepted")
# A vocabulary of 29 splits 4 ways as its padded 128 rows; unpadded it cannot.
table = shardings(vocab_size=29).params["shared_embedding"]["embedding"]
assert table.shard_shape((128, 32)) == (32, 32), table
try:
    shardings(vocab_size=29, vocab_multiple=1)
except ConfigError as e:
    print(e)
    assert "shared_embedding" in str(e) and "model.vocab_multiple" in str(e), e
else:
    raise AssertionError("an unpadded vocabulary of 29 over mesh.model=4 was accepted")
print("checked")
"""


def test_a_dimension_the_mesh_cannot_split_is_a_config_error():
    """Not silently replicated: the error names the parameter, the field and the mesh axis."""
    result = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT.format(root=ROOT)],
        env=dict(
            os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("checked"), result.stdout[-2000:]
