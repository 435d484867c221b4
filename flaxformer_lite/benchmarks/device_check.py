"""The accelerator check: what runs on this device, and how fast, in one command.

    tools/device_check.sh [--profile auto|gpu|cpu] [--json results.json]

On one H200 it finishes in under 8 minutes and prints, each figure measured in this run:

  kernel       the attention kernel chosen for a bf16 causal layer, and why;
  difference   the fused kernel's output and gradient against XLA's (max |delta|);
  memory       compiled temp memory of one causal layer, forward and backward, at T=8192
               (B=1, 8 heads of 64, bf16), with the kernel and with XLA;
  peak         a bf16 [n, n] x [n, n] matmul's rate (MFU's denominator), beside the
               datasheet's 989 TFLOP/s (H200 SXM, dense bf16);
  train        base and big (Vaswani et al. Table 3) train step in bf16: seconds, tokens/s,
               MFU against both peaks, and torch `nn.Transformer` under bf16 autocast on
               the same shapes, steps alternating;
  decode       greedy and beam-4 tokens/s at batch 1, 64 and 256 on the base model.

The "cpu" profile runs every stage on small shapes, to show the check works end to end
where no accelerator is. It needs jax, flax, optax, numpy and (for the comparison)
torch: nothing of the data stack. Each stage reports its own failure and the next runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DATASHEET_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
GOALS = {"base_mfu": 0.30, "big_mfu": 0.40, "torch_over_ours": 1.5, "memory_mib": 256.0}
GREEDY_GOAL = (64, 20_000.0)  # greedy tokens/s at batch 64 on the base model


@dataclasses.dataclass(frozen=True)
class Profile:
    """Shapes of each stage."""

    train: tuple[int, int, int]  # batch, source length, target length
    train_repeats: int
    decode_batches: tuple[int, ...]
    decode_source_len: int
    new_tokens: int
    decode_repeats: int
    difference: tuple[int, int, int, int]  # B, T, N, H of the kernel-vs-XLA check
    memory_len: int  # T of the memory check (compiled only, never run)
    matmul_n: int
    compare_torch: bool = True


PROFILES = {
    "gpu": Profile((256, 128, 128), 10, (1, 64, 256), 64, 64, 3, (4, 1024, 8, 64), 8192, 8192),
    "tpu": Profile((256, 128, 128), 10, (1, 64, 256), 64, 64, 3, (4, 1024, 8, 64), 8192, 8192),
    "cpu": Profile((4, 32, 32), 2, (1, 4), 16, 8, 1, (2, 256, 4, 32), 1024, 1024),
}


def model_configs() -> dict[str, Any]:
    """The paper's base and big models (Table 3), vocabulary 37000 (WMT14 EN-DE), in the
    platform's compute dtype."""
    from flaxformer_lite.config import TransformerConfig
    from flaxformer_lite.config.model import parse_dtype

    dtype = parse_dtype("dtype", "auto")  # bf16 on GPUs and TPUs, float32 on CPUs
    base = TransformerConfig(vocab_size=37000, dropout_rate=0.1, dtype=dtype, max_len=1024)
    big = base.replace(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
    return {"base": base, "big": big}


def _stage(name: str, results: dict, log: Callable[[str], None], fn: Callable[[], dict]):
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # report and go on: one failing stage must not hide the others
        out = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        log(f"[{name}] FAILED: {out['error']}")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    results[name] = out
    log(f"[{name}] done in {out['seconds']:.1f} s")


def environment(log) -> dict:
    from flaxformer_lite.nn import precision

    d = jax.devices()[0]
    out = {
        "jax": jax.__version__,
        "platform": jax.default_backend(),
        "devices": jax.device_count(),
        "device_kind": getattr(d, "device_kind", str(d)),
    }
    kind = out["device_kind"]
    log(f"[environment] jax {out['jax']} on {out['platform']}: {out['devices']} x {kind}")
    log(f"[environment] {precision.describe(model_configs()['base'])}")
    return out


def _attention_inputs(shape, dtype, seed=0):
    from flaxformer_lite.nn import masks

    b, t, n, h = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), dtype) for key in keys)
    lengths = jnp.maximum(t - 37 * jnp.arange(b), 1)  # ragged rows: padding differs per row
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    return q, k, v, masks.self_attention(valid, causal=True)


def kernel_and_difference(profile: Profile, log) -> dict:
    """The kernel chosen for a bf16 causal layer, and its output/gradient against XLA's."""
    from flaxformer_lite.nn import attention, kernels

    q, k, v, mask = _attention_inputs(profile.difference, jnp.bfloat16)
    choice = kernels.choose("auto", q, k, mask, dropout=False)
    out = {"kernel": choice.kernel, "why": choice.why, "shape": list(profile.difference)}
    log(f"[kernel] bf16 causal self-attention {profile.difference}: {choice.kernel} ({choice.why})")
    if not choice.fused:
        log("[difference] no fused kernel here: nothing to compare with XLA")
        return out
    rows = mask.key_valid[..., None, None]  # padded queries' outputs are never read

    def fused(q, k, v):
        return kernels.run(choice, q, k, v, mask) * rows

    def xla(q, k, v):
        return attention.batched_attention(q, k, v, mask.dense())[0] * rows

    cot = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.bfloat16)
    for name, f in (("fused", fused), ("xla", xla)):
        y, pullback = jax.vjp(jax.jit(f), q, k, v)
        out[name] = (y, pullback(cot))
    (y1, g1), (y2, g2) = out.pop("fused"), out.pop("xla")
    delta = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    out["max_abs_output_difference"] = delta(y1, y2)
    out["max_abs_grad_difference"] = max(delta(a, b) for a, b in zip(g1, g2, strict=True))
    log(
        f"[difference] {choice.kernel} vs XLA: output max |delta| "
        f"{out['max_abs_output_difference']:.3g}, gradient max |delta| "
        f"{out['max_abs_grad_difference']:.3g} (bf16 operands)"
    )
    return out


def attention_memory(profile: Profile, log) -> dict:
    """Compiled temp memory of one causal layer's forward and backward pass, per kernel."""
    from flax import linen as nn

    from flaxformer_lite.config import TransformerConfig
    from flaxformer_lite.nn import attention, masks

    t = profile.memory_len
    out = {"length": t}
    x = jax.ShapeDtypeStruct((1, t, 512), jnp.bfloat16)
    valid = jax.ShapeDtypeStruct((1, t), jnp.bool_)  # an input: no constant-folded mask
    for impl in ("auto", "vmap"):
        cfg = TransformerConfig(
            vocab_size=8, d_model=512, num_heads=8, dtype=jnp.bfloat16, attention_impl=impl
        )
        mha = attention.MultiHeadAttention(cfg, self_attention=True)
        small = jnp.zeros((1, 8, 512), jnp.bfloat16), jnp.ones((1, 8), bool)
        params = jax.eval_shape(
            lambda mha=mha, small=small: nn.meta.unbox(
                mha.init(
                    jax.random.PRNGKey(0),
                    small[0],
                    masks.self_attention(small[1], causal=True),
                    deterministic=True,
                )
            )
        )

        def fwd_bwd(params, x, valid, mha=mha):
            mask = masks.self_attention(valid, causal=True)
            f = lambda p, x: mha.apply(p, x, mask, deterministic=True)[0].astype(jnp.float32).sum()
            return jax.grad(f, argnums=(0, 1))(params, x)

        compiled = jax.jit(fwd_bwd).lower(params, x, valid).compile()
        mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
        name = "kernel" if impl == "auto" else "xla"
        out[f"{name}_temp_mib"] = round(mib, 1)
        log(f"[memory] causal layer T={t}, fwd+bwd, attention_impl={impl}: temp {mib:,.1f} MiB")
    return out


def matmul_peak(profile: Profile, log) -> dict:
    from flaxformer_lite.benchmarks import train_speed

    dtype = model_configs()["base"].dtype  # the compute dtype's rate: bf16 on accelerators
    flops = train_speed.matmul_peak(profile.matmul_n, repeats=10, dtype=dtype)
    kind = getattr(jax.devices()[0], "device_kind", "")
    sheet = next((v for k, v in DATASHEET_BF16_FLOPS.items() if k in kind), None)
    log(
        f"[peak] {jnp.dtype(dtype).name} {profile.matmul_n}^3 matmul: {flops / 1e12:.2f} TFLOP/s"
        + (f" (datasheet {sheet / 1e12:.0f} TFLOP/s)" if sheet else "")
    )
    return {"measured_flops": flops, "datasheet_flops": sheet}


def train(profile: Profile, name: str, peak: dict, log) -> dict:
    """Our bf16 train step, alternating with torch's bf16-autocast step on the same shapes."""
    from flaxformer_lite.benchmarks import train_speed

    config = model_configs()[name]
    batch, s, t = profile.train
    measured = peak.get("measured_flops") or train_speed.matmul_peak(dtype=config.dtype)
    shapes = dict(batch=batch, source_len=s, target_len=t, peak_flops=measured, log=log)
    if profile.compare_torch:
        r = train_speed.compare_train_benchmark(config, repeats=profile.train_repeats, **shapes)
    else:
        r = train_speed.train_benchmark(config, steps=profile.train_repeats, **shapes)
    out = {k: r[k] for k in ("step_s", "tokens_per_s", "mfu", "flops_per_step", "compile_s")}
    if peak.get("datasheet_flops"):
        out["mfu_datasheet"] = r["flops_per_s"] / peak["datasheet_flops"]
    for key in ("torch_step_s", "torch_over_ours", "torch_version"):
        if key in r:
            out[key] = r[key]
    torch_mode = "bf16 autocast" if config.dtype == jnp.bfloat16 else "float32"
    log(
        f"[train {name}] {jnp.dtype(config.dtype).name} {batch}x{s}x{t}: "
        f"{out['step_s'] * 1e3:.1f} ms/step, "
        f"{out['tokens_per_s']:,.0f} tokens/s, MFU {out['mfu']:.1%} of the measured peak"
        + (f", {out['mfu_datasheet']:.1%} of the datasheet" if "mfu_datasheet" in out else "")
        + (
            f"; torch {torch_mode} {out['torch_step_s'] * 1e3:.1f} ms/step (torch / ours = "
            f"{out['torch_over_ours']:.2f})"
            if "torch_over_ours" in out
            else ""
        )
    )
    return out


def decode(profile: Profile, log) -> dict:
    """Greedy and beam-4 tokens/s of the base model at each batch size."""
    from flax import linen as nn

    from flaxformer_lite.benchmarks.decoding import _search_timings
    from flaxformer_lite.models.autoregressive import AutoregressiveModel

    config = model_configs()["base"]
    model = AutoregressiveModel(config)
    shapes = {"inputs": (1, profile.decode_source_len), "targets": (1, 8)}
    params = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), shapes)))()
    rng = np.random.default_rng(0)
    out = {}
    for batch in profile.decode_batches:
        inputs = jnp.asarray(
            rng.integers(4, config.vocab_size, (batch, profile.decode_source_len)), jnp.int32
        )
        timings = _search_timings(
            model,
            params,
            inputs,
            new_tokens=profile.new_tokens,
            beam_size=4,
            repeats=profile.decode_repeats,
            uncached=False,
            log=lambda s: None,
        )
        out[batch] = {k: timings[f"{k}_tokens_per_s"] for k in ("greedy", "beam4")}
        log(
            f"[decode] batch {batch:>3}: greedy {out[batch]['greedy']:,.0f} tokens/s, "
            f"beam 4 {out[batch]['beam4']:,.0f} tokens/s ({profile.new_tokens} new tokens)"
        )
    return out


def goals(results: dict, log) -> dict:
    """Each goal with its measured figure: met, missed, or not measured (on a CPU the
    goals, set for an H200, do not apply)."""
    verdicts = {}
    applies = results.get("environment", {}).get("platform") in ("gpu", "tpu")

    def verdict(name, value, ok):
        if not applies:
            verdicts[name] = "not applicable on this platform"
        elif value is None:
            verdicts[name] = "not measured"
        else:
            verdicts[name] = "met" if ok(value) else "missed"
        shown = "-" if value is None else f"{value:.3g}"
        log(f"[goals] {name}: {shown} -> {verdicts[name]}")

    for model, goal in (("base", GOALS["base_mfu"]), ("big", GOALS["big_mfu"])):
        r = results.get(f"train_{model}", {})
        verdict(f"{model} MFU >= {goal:.0%}", r.get("mfu"), lambda v, g=goal: v >= g)
        ratio = r.get("torch_over_ours")
        verdict(f"{model} torch step / ours >= 1.5", ratio, lambda v: v >= GOALS["torch_over_ours"])
    mem = results.get("memory", {}).get("kernel_temp_mib")
    verdict("T=8192 causal layer temp <= 256 MiB", mem, lambda v: v <= GOALS["memory_mib"])
    batch, goal = GREEDY_GOAL
    greedy = results.get("decode", {}).get(batch, {}).get("greedy")
    verdict(f"greedy batch {batch} >= {goal:,.0f} tokens/s", greedy, lambda v: v >= goal)
    return verdicts


def run(profile_name: str = "auto", log: Callable[[str], None] = print) -> dict:
    """Every stage in turn; returns {stage: figures}."""
    platform = jax.default_backend()
    name = platform if profile_name == "auto" else profile_name
    profile = PROFILES[name]
    log(f"[device_check] profile {name} on {platform}")
    results: dict[str, Any] = {"profile": name}
    t0 = time.perf_counter()
    _stage("environment", results, log, lambda: environment(log))
    _stage("kernel", results, log, lambda: kernel_and_difference(profile, log))
    _stage("memory", results, log, lambda: attention_memory(profile, log))
    _stage("peak", results, log, lambda: matmul_peak(profile, log))
    for model in ("base", "big"):
        _stage(
            f"train_{model}", results, log, lambda m=model: train(profile, m, results["peak"], log)
        )
    _stage("decode", results, log, lambda: decode(profile, log))
    results["goals"] = goals(results, log)
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    log(f"[device_check] total {results['total_seconds']:.0f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="auto", choices=["auto", *PROFILES])
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = run(args.profile, log=lambda s: print(s, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
