"""Training on several devices equals training on one (same code path): data parallel,
and with parameters sharded over fsdp and model axes; and what XLA makes of the layouts.

Every check runs in one process with 8 simulated CPU devices (the device count is fixed
when JAX starts), each on a mesh over the first n of them (`make_mesh(n)`), the 1-device
reference included: one JAX start-up for the file. The training runs are the tiny run's
model and optimiser stepped on fixed batches through the calls the training loop makes
(create_state, jit_train_step, device_batch); `train_and_evaluate` on 4 devices against
1 device, end to end, is test_multihost.py's two-process test.
"""

import json

import numpy as np
import pytest
from conftest import assert_checked, assert_params_close, run_checks

DEVICES = 8

# argv: repository root, data directory of the tiny config, output directory. Each check
# is a function; the script records "checked" or the traceback of each in checks.json.
SCRIPT = r"""
import json, re, sys, traceback
root, tfds, out = sys.argv[1:4]
sys.path[:0] = [root, root + "/tests"]
import jax
import numpy as np
import optax
from conftest import tiny_config, tiny_model_config
from flaxformer_lite.benchmarks import hlo_report
from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.config.run import parse
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.models.from_config import build_model
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training import checkpoints, optim
from flaxformer_lite.training import step as step_lib
from flaxformer_lite.training.state import abstract_state, create_state

assert jax.device_count() == 8, jax.devices()
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def split(x):
    return x.sharding.shard_shape(x.shape) != x.shape


STEPS = 8


@check
def train_steps():
    # The tiny run's model and optimiser (its warm-up, label smoothing and seed).
    run = parse(tiny_config(tfds)).with_vocab(64, None)
    model, (_, tx) = build_model(run), optim.of_run(run)
    S, T = run.data.max_source_len, run.data.max_target_len
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(STEPS):
        inputs = rng.integers(4, 64, (16, S)).astype(np.int32)
        targets = rng.integers(4, 64, (16, T)).astype(np.int32)
        for r in range(16):  # ragged rows: padding differs per row and per device
            inputs[r, 2 + r % (S - 2):] = 0
            targets[r, 1 + r % (T - 2)] = 3
            targets[r, 2 + r % (T - 2):] = 0
        batches.append({"inputs": inputs, "targets": targets})
    meshes = {
        "one": partitioning.make_mesh(1),
        "data4": partitioning.make_mesh(4),
        # data=1 x fsdp=2 x model=2: every parameter and its Adam moments split 2 or 4 ways
        "fsdp2_model2": partitioning.make_mesh(4, fsdp=2, model=2),
    }
    losses = {}
    for name, mesh in meshes.items():
        state, shardings = create_state(
            model, tx, mesh, seed=run.train.seed, source_len=S, target_len=T
        )
        if name == "one":
            np.savez(f"{out}/params_init.npz", **leaves(state.params))
        train_step = step_lib.jit_train_step(model, tx, mesh, shardings)
        losses[name] = []
        for batch in batches:
            state, sums = train_step(state, step_lib.device_batch(batch, mesh))
            losses[name].append(float(sums["loss"]))
        if name == "fsdp2_model2":
            # The layout training used: a feed-forward kernel [D, F] is split as declared,
            # and no parameter or moment is left whole on a device.
            kernel = state.params["encoder"]["layer_0"]["ffn"]["wi"]["kernel"]
            assert kernel.sharding.shard_shape(kernel.shape) == (32 // 2, 64 // 2), kernel
            whole = [k for k, x in leaves_of(state.params, state.opt_state) if not split(x)]
            assert not whole, whole
            # The sharded state checkpoints and restores into its layout.
            ckpt = checkpoints.Checkpointer(f"{out}/run_{name}", keep=1, save_every=0)
            ckpt.save(STEPS, state, {}, force=True)
            like = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
            )
            restored, _ = ckpt.restore(like)
            ckpt.close()
            for k, x in leaves(restored.params).items():
                np.testing.assert_array_equal(x, np.asarray(leaves(state.params)[k]), err_msg=k)
            state = restored
        np.savez(f"{out}/params_{name}.npz", **leaves(state.params))
    with open(f"{out}/losses.json", "w") as f:
        json.dump(losses, f)


def leaves_of(*trees):
    return [(jax.tree_util.keystr(p), x) for tree in trees
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if x.ndim]


GATHER = re.compile(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(")
ANY_GATHER = re.compile(r" all-gather(?:-start)?\(")
REDUCE = re.compile(r" all-reduce(?:-start)?\(")


def gathered_shapes(hlo):
    shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in GATHER.findall(hlo)]
    assert len(shapes) == len(ANY_GATHER.findall(hlo)), "an all-gather the regex cannot read"
    return shapes


@check
def tensor_parallel():
    # An odd vocabulary: model=2 splits it only as the padded 128 rows (`nn/vocab.py`).
    config = TransformerConfig(vocab_size=61, d_model=32, d_ff=64, num_heads=4,
                               num_encoder_layers=1, num_decoder_layers=1, max_len=16,
                               dropout_rate=0.1)
    model, tx = AutoregressiveModel(config, label_smoothing=0.1), optax.adam(1e-3)
    mesh = partitioning.make_mesh(2, model=2)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "model": 2}, mesh
    state, shardings = create_state(model, tx, mesh, seed=0, source_len=6, target_len=6)
    kernels = {k: x for k, x in leaves_of(state.params) if x.ndim >= 2}
    # Every kernel is really split over model (else "nothing gathered" would be vacuous).
    unsplit = [k for k, x in kernels.items() if not split(x)]
    assert not unsplit, unsplit
    # The regex reads this jax's HLO: replicating one split kernel is one all-gather of its shape.
    wi = kernels["['encoder']['layer_0']['ffn']['wi']['kernel']"]
    control = jax.jit(lambda w: w + 1, out_shardings=partitioning.replicated(mesh))
    assert gathered_shapes(control.lower(wi).compile().as_text()) == [wi.shape]

    tokens = np.ones((2, 6), np.int32)
    batch = partitioning.put_batch({"inputs": tokens, "targets": tokens}, mesh)
    step = step_lib.jit_train_step(model, tx, mesh, shardings)
    hlo = step.lower(state, batch).compile().as_text()
    gathered = gathered_shapes(hlo)
    shapes = {x.shape for x in kernels.values()}
    sizes = {int(np.prod(x.shape)) for x in kernels.values()}  # also kernels seen reshaped
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


@check
def activation_layout():
    B, T = 16, 10  # B*T = 160 and its shards 20: no parameter has such a dimension
    # 100 entries padded to 128 rows (`nn/vocab.py`): the padded logits keep even model shards.
    config = TransformerConfig(vocab_size=100, d_model=32, d_ff=64, num_heads=4,
                               num_encoder_layers=1, num_decoder_layers=1, max_len=16,
                               dropout_rate=0.1)
    model, tx = AutoregressiveModel(config, label_smoothing=0.1), optax.adam(1e-3)
    tokens = np.random.RandomState(0).randint(1, 100, (B, T)).astype(np.int32)

    def compile_step(fsdp, model_axis):
        mesh = partitioning.make_mesh(fsdp=fsdp, model=model_axis)
        state, shardings = create_state(model, tx, mesh, seed=0, source_len=T, target_len=T)
        batch = partitioning.put_batch({"inputs": tokens, "targets": tokens}, mesh)
        with hlo_report.capture_compile_log() as log:
            compiled = step_lib.jit_train_step(model, tx, mesh, shardings).lower(
                state, batch).compile()
        params = [x.shape for x in jax.tree.leaves(state.params)]
        return hlo_report.collectives(compiled.as_text()), hlo_report.remat_warnings(log[0]), params

    def moves_activations(c, shards):
        rows = {B * T, B * T // shards}
        return bool(c.shape) and (c.shape[0] in rows or c.shape[:2] in {(B, T), (B // shards, T)})

    found, remat, params = compile_step(fsdp=8, model_axis=1)
    print("fsdp=8", hlo_report.summary(found))
    assert not remat, remat
    moved = [c for c in found if moves_activations(c, 8)]
    assert not moved, moved
    # Non-vacuous: FSDP gathers the weights, and nothing else big moves.
    gathered = [c.shape for c in found if c.kind == "all-gather"]
    assert ({s for s in params if len(s) == 2} & set(gathered)), gathered
    # (weights may travel reshaped: a [D, 3, N, H] kernel as [D, 3*N*H]; compare sizes)
    sizes = {int(np.prod(s)) for s in params}
    other = [c for c in found if int(np.prod(c.shape)) not in sizes and c.nbytes > 16]
    assert not other, other

    found, remat, _ = compile_step(fsdp=2, model_axis=2)  # data=2 x fsdp=2 x model=2
    print("2x2x2", hlo_report.summary(found))
    assert not remat, remat
    assert not [c for c in found if c.kind in ("all-to-all", "collective-permute")], found


@check
def mesh_errors():
    mesh = partitioning.make_mesh(model=4)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "model": 4}, mesh
    assert partitioning.process_rows(8, mesh) == slice(0, 8)

    def shardings(**fields):
        model = AutoregressiveModel(tiny_model_config(**({"vocab_size": 32} | fields)))
        return partitioning.logical_shardings(
            abstract_state(model, optax.adam(1e-3), 0, 6, 6), mesh
        )

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


outcome = {}
for name, fn in CHECKS.items():
    print(f"--- {name}", flush=True)
    try:
        fn()
        outcome[name] = "checked"
    except Exception:
        outcome[name] = traceback.format_exc()
        print(outcome[name], flush=True)
with open(f"{out}/checks.json", "w") as f:
    json.dump(outcome, f)
"""


@pytest.fixture(scope="module")
def checked(tfds_dir, tmp_path_factory):
    """(outcome of each check, output directory, the process's output)."""
    return run_checks(SCRIPT, DEVICES, tmp_path_factory.mktemp("sharding"), tfds_dir)


def _params(checked, name: str) -> dict:
    return dict(np.load(checked[1] / f"params_{name}.npz"))


def _trained_equal_to_one_device(checked, name: str) -> None:
    assert_checked(checked, "train_steps")
    one = _params(checked, "one")
    assert_params_close(_params(checked, name), one)
    losses = json.loads((checked[1] / "losses.json").read_text())
    np.testing.assert_allclose(losses[name], losses["one"], rtol=1e-5)
    # Non-vacuous: the steps moved every kernel well beyond the tolerance.
    init = _params(checked, "init")
    still = [k for k, x in init.items() if x.ndim == 2 and np.abs(one[k] - x).max() < 1e-3]
    assert not still, still


def test_four_device_data_parallel_equals_one_device(checked):
    """8 train steps of the tiny run with the batch split 4 ways, against 1 device."""
    _trained_equal_to_one_device(checked, "data4")


def test_fsdp_and_model_sharding_equal_one_device(checked):
    """data=1 x fsdp=2 x model=2: every parameter and its Adam moments split 2 or 4 ways;
    the sharded state, checkpointed and restored, equals the 1-device one."""
    _trained_equal_to_one_device(checked, "fsdp2_model2")


def test_tensor_parallel_step_gathers_no_kernel(checked):
    """model=2 alone (no fsdp): the heads/mlp/vocab splits carry through every matmul,
    including the merged [D, N*3*H] Q/K/V projection, so no weight is ever gathered."""
    assert_checked(checked, "tensor_parallel")


def test_activations_stay_in_the_batch_layout(checked):
    """fsdp=8: only weights (and scalars) cross devices, no [B*T, ...] activation; on a
    2x2x2 mesh XLA never falls back to replicating an array to change its layout."""
    assert_checked(checked, "activation_layout")


def test_a_dimension_the_mesh_cannot_split_is_a_config_error(checked):
    """Not silently replicated: the error names the parameter, the field and the mesh axis."""
    assert_checked(checked, "mesh_errors")
