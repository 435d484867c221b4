"""Attention kernels: which one runs where, and that the fused ones compute what XLA does.

Splash attention (the TPU kernel) runs here in Pallas interpret mode, on the masks the
model builds (padding, causal, packed rows, windows, cross-attention), forward and
backward, against the XLA core. cuDNN cannot run without a GPU; its lowering for CUDA is
checked from this host (JAX's cuDNN version probe stubbed), and the choice logic is
tested on its own.
"""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.nn import attention, kernels, masks

T = 128  # splash tiles in 128-row blocks


def _cfg(**kw):
    base = dict(vocab_size=10, d_model=32, num_heads=2, d_ff=8, dropout_rate=0.0)
    return TransformerConfig(**(base | kw))


def _module_outputs(cfg, self_attention, x, y, mask, rows, *, platform, seed=0):
    """(output, d output / d (params, x)) of one MultiHeadAttention under `platform`; the
    loss reads the output at `rows` bool[B, T] only (a padded query's output is unused)."""
    mha = attention.MultiHeadAttention(cfg, self_attention=self_attention)
    params = nn.meta.unbox(
        mha.init(jax.random.PRNGKey(seed), x, masks.dense(mask), deterministic=True, inputs_kv=y)
    )["params"]
    cot = jax.random.normal(jax.random.PRNGKey(seed + 1), x.shape) * rows[..., None]

    def loss(params, x):
        out, _ = mha.apply({"params": params}, x, mask, deterministic=True, inputs_kv=y)
        return jnp.sum(out * cot), out

    # Jitted (traced under the target): one compile where an eager pass dispatches each op.
    with kernels.target(platform, interpret=platform == "tpu"):
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, out), grads = grad(params, x)
    return out, grads


def _valid(lengths, width):
    return jnp.arange(width)[None, :] < jnp.asarray(lengths)[:, None]


def _packed_segments():
    # Row 0: examples of 50 and 60 tokens then padding; row 1: one example of 128.
    row0 = np.zeros(T, np.int32)
    row0[:50], row0[50:110] = 1, 2
    return jnp.asarray(np.stack([row0, np.ones(T, np.int32)]))


CASES = {
    "encoder padding": dict(mask=lambda: masks.self_attention(_valid([100, T], T), causal=False)),
    "decoder causal": dict(mask=lambda: masks.self_attention(_valid([77, T], T), causal=True)),
    "packed causal": dict(
        mask=lambda: masks.self_attention(_packed_segments() != 0, _packed_segments(), causal=True)
    ),
    "decoder window": dict(
        mask=lambda: masks.self_attention(_valid([90, T], T), causal=True, window=16)
    ),
    "encoder window": dict(
        mask=lambda: masks.self_attention(_valid([90, T], T), causal=False, window=16)
    ),
    "cross": dict(mask=lambda: masks.cross_attention(_valid([200, 2 * T], 2 * T), T), cross=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_equals_xla_forward_and_backward(case):
    """The model's attention on splash (interpret mode) equals the XLA core: outputs at
    every valid query, and gradients w.r.t. every parameter and the input."""
    spec = CASES[case]
    mask = spec["mask"]()
    cross = spec.get("cross", False)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, T, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(2, 2 * T, 32)), jnp.float32) if cross else None
    rows = mask.key_valid if not cross else _valid([T, T], T)  # the queries whose output counts
    if mask.packed:
        rows = mask.query_segments != 0
    with kernels.target("tpu"):  # the kernel runs, not a fallback
        q = jnp.zeros((2, T, 2, 16))
        k = jnp.zeros((2, 2 * T if cross else T, 2, 16))
        assert kernels.choose("auto", q, k, mask, dropout=False).kernel == "splash"
    cfgs = _cfg(attention_impl="vmap"), _cfg(attention_impl="auto")
    want, want_g = _module_outputs(cfgs[0], not cross, x, y, mask, rows, platform="cpu")
    got, got_g = _module_outputs(cfgs[1], not cross, x, y, mask, rows, platform="tpu")
    rows = np.asarray(rows)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=2e-5)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=2e-4)


def test_choice_follows_platform_and_constraints():
    q32 = jnp.zeros((1, T, 2, 64), jnp.float32)
    q16 = q32.astype(jnp.bfloat16)
    mask = masks.self_attention(jnp.ones((1, T), bool), causal=True)
    with kernels.target("gpu"):
        assert kernels.choose("auto", q16, q16, mask, dropout=False).kernel == "cudnn"
        fp32 = kernels.choose("auto", q32, q32, mask, dropout=False)
        assert (fp32.kernel, fp32.fused) == ("vmap", False)
        assert "bf16/fp16" in fp32.why
        odd = jnp.zeros((1, T, 2, 20), jnp.bfloat16)
        assert "head size 20" in kernels.choose("auto", odd, odd, mask, dropout=False).why
        encoder_window = masks.self_attention(jnp.ones((1, T), bool), causal=False, window=8)
        assert "causal only" in kernels.choose("cudnn", q16, q16, encoder_window, dropout=False).why
        assert "dropout" in kernels.choose("auto", q16, q16, mask, dropout=True).why
        dense = kernels.choose("auto", q16, q16, mask.dense(), dropout=False)
        assert not dense.fused and "dense" in dense.why
    with kernels.target("tpu"):
        assert kernels.choose("auto", q32, q32, mask, dropout=False).kernel == "splash"
        short = jnp.zeros((1, 50, 2, 64), jnp.float32)
        m50 = masks.self_attention(jnp.ones((1, 50), bool), causal=True)
        assert "multiples of 128" in kernels.choose("auto", short, short, m50, dropout=False).why
        assert kernels.choose("vmap", q32, q32, mask, dropout=False).kernel == "vmap"
    with kernels.target("cpu"):
        assert kernels.choose("auto", q16, q16, mask, dropout=False).kernel == "vmap"
        for forced, need in (("cudnn", "GPU"), ("splash", "TPU")):
            with pytest.raises(ConfigError, match=f"needs a {need}.*attention_impl='auto'"):
                kernels.choose(forced, q16, q16, mask, dropout=False)


def test_one_line_per_path(capsys):
    choice = kernels.Choice("vmap", "a reason seen only in this test")
    kernels.report(choice, "self-attention")
    kernels.report(choice, "self-attention")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["attention (self-attention): XLA (a reason seen only in this test)"]


def _lowered_text(cfg, platform, **target):
    """The StableHLO of one train-step-like program of a MultiHeadAttention layer stack."""
    mha = attention.MultiHeadAttention(cfg, self_attention=True)
    x = jax.ShapeDtypeStruct((2, 256, cfg.d_model), jnp.bfloat16)
    valid = jnp.ones((2, 256), bool)
    mask = masks.self_attention(valid, causal=True)
    params = jax.eval_shape(
        lambda: mha.init(
            jax.random.PRNGKey(0), jnp.zeros(x.shape, x.dtype), mask.dense(), deterministic=True
        )
    )

    def step(params, x):
        loss = lambda p: jnp.sum(mha.apply(p, x, mask, deterministic=True)[0].astype(jnp.float32))
        return jax.grad(loss)(params)

    with kernels.target(platform, **target):
        lowered = (
            jax.jit(step).trace(params, x).lower(lowering_platforms=(platform_name(platform),))
        )
    return lowered.as_text()


def platform_name(platform):
    return {"gpu": "cuda"}.get(platform, platform)


def test_tpu_lowering_holds_the_splash_kernel_forward_and_backward():
    cfg = _cfg(d_model=256, num_heads=2, dtype=jnp.bfloat16)  # head size 128
    text = _lowered_text(cfg, "tpu")
    names = set(re.findall(r'kernel_name = "(\w+)"', text))
    # the forward kernel (keeping its residuals), and the backward pass's dq and dk/dv
    for part in ("fwd", "dq", "dkv"):
        assert any(n.startswith(f"splash_mha_{part}_segmented") for n in names), names


def test_cuda_lowering_holds_cudnn_flash_attention(monkeypatch):
    """cuDNN's attention lowers for CUDA from a CPU host once JAX's probes of the local
    cuDNN and GPU are answered (as on an H100/H200 with cuDNN 9)."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    for name, value in (
        ("check_cudnn_version", lambda: 91000),
        ("check_compute_capability", lambda capability: True),
        ("is_cuda_compute_capability_equal", lambda capability: False),
    ):
        if not hasattr(fused, name):
            pytest.skip(f"this JAX has no {name} to stub")
        monkeypatch.setattr(fused, name, value)
    cfg = _cfg(d_model=128, num_heads=2, dtype=jnp.bfloat16)
    text = _lowered_text(cfg, "gpu")
    targets = set(re.findall(r"custom_call @(__cudnn\$\w+)", text))
    assert any("Backward" in t for t in targets) and any("Backward" not in t for t in targets)


def test_config_checked_before_a_job_is_joined_leaves_the_backends_alone():
    """train.py checks a config before `jax.distributed.initialize`, which refuses to run
    once JAX has created its backends: the check must not create them, even for
    model.dtype='auto' and a forced kernel (those are checked after joining)."""
    code = (
        "from configs import default\n"
        "from jax._src import xla_bridge\n"
        "from flaxformer_lite.config import run as run_config\n"
        "c = default.get_config()\n"
        "c.model.dtype = 'auto'\n"
        "c.model.attention_impl = 'splash'\n"
        "run_config.validate(c, platform=False)\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "try:\n"
        "    run_config.validate(c)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    root = pathlib.Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ConfigError" in out.stdout and "needs a TPU" in out.stdout, out.stdout
