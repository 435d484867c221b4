"""The programs as a GPU or a TPU would run them, exported from this CPU host.

`benchmarks/lowering.py` exports each program for "cuda" and "tpu" under the kernel target
of that platform; these tests read the exported modules: the fused attention kernels
are there, and a bf16 run has no float32 x float32 model matmul except the named ones.
"""

import pytest

from flaxformer_lite.benchmarks import lowering, lowering_programs

# Programs with no encoder pass and no training: one-query decoder steps only.
DECODE_STEPS_ONLY = ("engine_run",)
TRAIN = ("train_full", "train_local", "train_packed", "train_scan_remat", "train_grad_accum")


@pytest.fixture(scope="module")
def tpu_results():
    return {name: lowering.lower(name, "tpu") for name in lowering_programs.PROGRAMS}


def test_every_program_lowers_for_tpu_with_the_splash_kernel(tpu_results):
    for name, result in tpu_results.items():
        assert result.ok, (name, result.error)
        if name in DECODE_STEPS_ONLY:  # one query per row: XLA attention, no kernel
            continue
        kernels = " ".join(result.kernels)
        assert "pallas:splash_mha_fwd" in kernels, (name, result.kernels)
        if name.startswith("train"):  # the backward pass's kernels too
            assert "pallas:splash_mha_dq" in kernels and "pallas:splash_mha_dkv" in kernels


def test_bf16_programs_have_no_fp32_matmuls_but_the_named_ones(tpu_results):
    for name, result in tpu_results.items():
        assert result.matmuls, name
        assert not result.fp32_matmuls, (name, [m.where for m in result.fp32_matmuls])
    named = {m.by_design() for r in tpu_results.values() for m in r.fp32_by_design}
    assert named == set(lowering.FP32_BY_DESIGN.values())  # every exception still occurs


def test_the_check_finds_a_float32_matmul():
    """The same reading on a float32 model: every model matmul is float32 x float32."""
    text = lowering.export_text(*_float32_score(), "tpu")
    _, matmuls = lowering.parse(text)
    assert matmuls and all(m.fp32 for m in matmuls)
    assert any("decoder/layer_0" in m.where for m in matmuls)


def _float32_score():
    """The score program of a float32 model: (fn, abstract args)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from flaxformer_lite.models.autoregressive import AutoregressiveModel

    model = AutoregressiveModel(lowering_programs.small_config(dtype=jnp.float32))
    shapes = {"inputs": (1, 16), "targets": (1, 16)}
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), shapes)))
    batch = {key: jax.ShapeDtypeStruct((2, 16), jnp.int32) for key in shapes}
    return model.score, (params, batch)


def test_cuda_train_step_holds_cudnn_flash_attention():
    result = lowering.lower("train_full", "cuda")
    if not result.ok and "cudnn" in result.error.lower():
        pytest.skip(f"this JAX cannot lower cuDNN attention without a GPU: {result.error}")
    assert result.ok, result.error
    assert "__cudnn$fmhaSoftmax" in result.kernels
    assert "__cudnn$fmhaSoftmaxBackward" in result.kernels
    assert not result.fp32_matmuls


def test_report_names_what_failed():
    bad = lowering.Lowered("train_full", "tpu", False, error="ValueError: no")
    assert lowering.report_lines(bad) == ["train_full         tpu   NOT LOWERED  ValueError: no"]


SHARDED_SCRIPT = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
from flaxformer_lite.benchmarks import lowering
# (one device: tpu_results above)
for mesh in ({"fsdp": 8}, {"fsdp": 2, "model": 2}):
    r = lowering.lower("train_full", "tpu", mesh)
    assert r.ok, (mesh, r.error)
    assert "pallas:splash_mha_dq_segmented_no_residuals" in r.kernels, r.kernels
    heads = 2 // mesh.get("model", 1)
    # one device's q: [heads, T, H] per example (vmapped), never the whole batch
    for ops in r.kernel_operands:
        assert f"tensor<{heads}x256x128xbf16>" in ops or f"x{heads}x256x128xbf16>" in ops, ops
        assert "tensor<8x2x256x128xbf16>" not in ops, ops
print("checked")
"""


def test_the_tpu_step_lowers_on_a_mesh_with_splash_per_device():
    """Mosaic kernels cannot be partitioned by XLA: on a mesh, splash runs in shard_map on
    each device's rows and heads (without it the sharded TPU step does not lower)."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "checked" in out.stdout
