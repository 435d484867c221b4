"""Decoding with parameters sharded over fsdp x model equals decoding on one device.

Both tests read one process with 8 simulated CPU devices (the device count is fixed at
jax start-up): one JAX start-up for the file, each check on a mesh over its first n
devices (`make_mesh(n)`).
"""

import numpy as np
import pytest
from conftest import assert_checked, run_checks

# argv: repository root, output directory. Each check is a function; the script records
# "checked" or the traceback of each in checks.json.
SCRIPT = """
import json, sys, traceback
root, out = sys.argv[1], sys.argv[2]
sys.path[:0] = [root, root + "/tests"]
import jax, jax.numpy as jnp, numpy as np
from flax import linen as nn
from conftest import tiny_model_config
from flaxformer_lite.benchmarks import hlo_report
from flaxformer_lite.models import predict
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.parallel import partitioning

jax.config.update("jax_default_matmul_precision", "highest")
assert jax.device_count() == 8, jax.devices()


def fsdp_and_model():
    cfg = tiny_model_config(vocab_size=32, num_encoder_layers=1, num_decoder_layers=1)
    model = AutoregressiveModel(cfg)
    src = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14], [16, 0, 0, 0, 0, 0],
                     [20, 21, 22, 0, 0, 0]])
    boxed = model.init(jax.random.PRNGKey(1), {"inputs": (1, 6), "targets": (1, 5)})
    params = nn.meta.unbox(boxed)
    mesh = partitioning.make_mesh(4, fsdp=2, model=2)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "model": 2}, mesh
    shardings = partitioning.logical_shardings(boxed, mesh)
    sharded = jax.device_put(params, shardings)
    inputs = jax.device_put(src, partitioning.batch_sharding(mesh))
    # The layout is really split both ways: some kernel is split over fsdp and model.
    full = [x.shape for x in jax.tree.leaves(params)]
    splits = [s.shard_shape(shape) for s, shape in zip(jax.tree.leaves(shardings), full)]
    assert any(len(a) == 2 and a[0] * 2 == b[0] and a[1] * 2 == b[1]
               for a, b in zip(splits, full))
    results = {}
    for method in ("greedy", "beam"):
        search = predict.SearchConfig(method, 6, beam_size=2, min_len=2)
        for name, p, x in (("one", params, src), ("mesh", sharded, inputs)):
            tokens, scores = model.predict(p, {"inputs": x}, search)
            results[f"{method}_{name}_tokens"] = np.asarray(tokens)
            results[f"{method}_{name}_scores"] = np.asarray(scores)
    np.savez(f"{out}/decoded.npz", **results)


# 8 devices, the batch split 8 ways (data=8): the beam loop reorders each device's own
# rows of the cache and takes each row's top-k on its own device.
def beam_loop():
    model = AutoregressiveModel(tiny_model_config(vocab_size=32, num_decoder_layers=1))
    boxed = model.init(jax.random.PRNGKey(1), {"inputs": (1, 6), "targets": (1, 5)})
    params = nn.meta.unbox(boxed)
    src = np.random.RandomState(0).randint(4, 32, (16, 6)).astype(np.int32)
    src[::3, 3:] = 0
    search = predict.SearchConfig("beam", 16, beam_size=3, min_len=1)
    decode = lambda p, x: predict.decode(model.module, p, x, search=search, bos_id=1, eos_id=3)
    want = jax.device_get(decode(params, src))

    mesh = partitioning.make_mesh()
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "model": 1}
    sharded = jax.device_put(params, partitioning.logical_shardings(boxed, mesh))
    inputs = jax.device_put(src, partitioning.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        compiled = jax.jit(decode).lower(sharded, inputs).compile()
        got = jax.device_get(compiled(sharded, inputs))
    found = hlo_report.collectives(compiled.as_text())
    print(hlo_report.format_report(found))
    looped = [c for c in found if c.in_loop]
    assert looped, "no collective in the loop: the done flags' all-reduce should be there"
    assert all(c.kind == "all-reduce" and c.nbytes <= 16 for c in looped), looped
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
    assert (want[0][:, :, 0] != 3).all() and want[0].shape == (16, 3, 16)


outcome = {}
for check in (fsdp_and_model, beam_loop):
    try:
        check()
        outcome[check.__name__] = "checked"
    except Exception:
        outcome[check.__name__] = traceback.format_exc()
with open(f"{out}/checks.json", "w") as f:
    json.dump(outcome, f)
"""


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """(outcome of each check, output directory, the process's output)."""
    return run_checks(SCRIPT, 8, tmp_path_factory.mktemp("sharded_decoding"))


def test_fsdp_and_model_sharded_decoding_equals_one_device(checked):
    assert_checked(checked, "fsdp_and_model")
    got = dict(np.load(checked[1] / "decoded.npz"))
    for method in ("greedy", "beam"):
        one, mesh = got[f"{method}_one_tokens"], got[f"{method}_mesh_tokens"]
        assert np.all((one[..., :2] != 3) & (one[..., :2] != 0)), one  # not EOS/PAD at once
        np.testing.assert_array_equal(mesh, one, err_msg=method)
        np.testing.assert_allclose(
            got[f"{method}_mesh_scores"], got[f"{method}_one_scores"], atol=1e-5
        )
    assert got["beam_one_tokens"].shape == (4, 2, 6)


def test_beam_loop_moves_no_cache_between_devices(checked):
    """With the batch split 8 ways, the beam loop's only collective is the done flags'
    all-reduce (no all-gather of the cache or the log-probs), and results are unchanged."""
    assert_checked(checked, "beam_loop")
