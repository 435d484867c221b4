"""Training-step benchmarks: step time, tokens/s and MFU of what `bench.py --mode train` runs.

`compare_train_benchmark` also times a PyTorch `nn.Transformer` of the same
sizes on the same batch (`torch_baseline.py`; PyTorch is optional and only
imported there).

All timings are wall-clock medians of repeated calls after a warm-up call,
each ended by `block_until_ready`. Parameters are random (speed does not
depend on their values), and EOS is forbidden so every search runs all its
steps.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.benchmarks.timing import _timed
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.constants import BOS_ID, EOS_ID
from flaxformer_lite.models.autoregressive import AutoregressiveModel

__all__ = [
    "BASELINES",
    "compare_train_benchmark",
    "matmul_peak",
    "train_benchmark",
    "train_flops_per_step",
]

BOS, EOS = BOS_ID, EOS_ID


def matmul_peak(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Achieved FLOP/s of one large [n, n] x [n, n] matmul on the default device."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    seconds, _ = _timed(lambda: f(a), repeats)
    return 2 * n**3 / seconds


def train_flops_per_step(
    config: TransformerConfig, batch: int, source_len: int, target_len: int
) -> float:
    """Model FLOPs of one training step on padded shapes: 3x the forward pass.

    Forward, per example (multiply-adds count 2): encoder layers
    2*S*(4*D*I + 2*D*F) + 4*S^2*I; decoder layers 2*T*(6*D*I + 2*D*F) + 4*S*D*I
    (cross-attention K/V of the source) + 4*T^2*I + 4*T*S*I; output projection
    2*T*D*V; where I = heads * head_dim and V the padded vocabulary the matmul runs
    (`nn/vocab.py`). Backward is twice the forward.
    """
    d, f, v = config.d_model, config.d_ff, config.padded(config.output_vocab_size)
    i = config.num_heads * config.head_dim
    s, t = source_len, target_len
    enc = 2 * s * (4 * d * i + 2 * d * f) + 4 * s * s * i
    dec = 2 * t * (6 * d * i + 2 * d * f) + 4 * s * d * i + 4 * t * t * i + 4 * t * s * i
    forward = config.num_encoder_layers * enc + config.num_decoder_layers * dec + 2 * t * d * v
    return 3.0 * batch * forward


def _random_batch(
    config: TransformerConfig, batch: int, source_len: int, target_len: int
) -> dict[str, np.ndarray]:
    """Random tokens without padding: "inputs" int32[B, S], "targets" int32[B, T]."""
    rng = np.random.default_rng(0)
    return {
        "inputs": rng.integers(4, config.vocab_size, (batch, source_len)).astype(np.int32),
        "targets": rng.integers(4, config.output_vocab_size, (batch, target_len)).astype(np.int32),
    }


def _library_train_step(
    config: TransformerConfig, arrays: dict[str, np.ndarray], scheduled_sampling=None
) -> tuple[Callable[[], dict[str, jax.Array]], dict[str, float]]:
    """Our jitted train step on one fixed batch.

    The step is the library's own (`training.step.train_step`, Adam(0.9, 0.98,
    1e-9), label smoothing 0.1), jitted as in training (`training.step.jit_train_step`).

    Args:
      arrays: `_random_batch` output.
      scheduled_sampling: the model's `ScheduledSampling` (None: teacher forcing).
    Returns:
      (run: one step -> its metric sums, {trace_s, lower_s, compile_s, params}).
    """
    import optax

    from flaxformer_lite.parallel import partitioning
    from flaxformer_lite.training.state import create_state
    from flaxformer_lite.training.step import jit_train_step

    model = AutoregressiveModel(config, label_smoothing=0.1)
    if scheduled_sampling is not None:
        model = dataclasses.replace(model, scheduled_sampling=scheduled_sampling)
    tx = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)
    mesh = partitioning.make_mesh()
    source_len, target_len = arrays["inputs"].shape[1], arrays["targets"].shape[1]
    state, shardings = create_state(
        model, tx, mesh, seed=0, source_len=source_len, target_len=target_len
    )
    batch_arrays = partitioning.put_batch(arrays, mesh)
    step = jit_train_step(model, tx, mesh, shardings)
    t0 = time.perf_counter()
    traced = step.trace(state, batch_arrays)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    results = {
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "params": float(sum(x.size for x in jax.tree.leaves(state.params))),
    }
    memory = compiled.memory_analysis()  # the compiler's buffer assignment (None: not known)
    if memory is not None:
        results["temp_bytes"] = float(memory.temp_size_in_bytes)  # activations, workspace
        results["peak_bytes"] = float(memory.peak_memory_in_bytes)  # with the live arguments

    holder = {"state": state}

    def run():
        holder["state"], sums = compiled(holder["state"], batch_arrays)
        return sums

    return run, results


def _throughput(
    seconds: float, flops: float, peak: float, batch: int, source_len: int, target_len: int
) -> dict[str, float]:
    """tokens/s (source + target), target tokens/s, FLOP/s and MFU of a step time."""
    return {
        "tokens_per_s": batch * (source_len + target_len) / seconds,
        "target_tokens_per_s": batch * target_len / seconds,
        "flops_per_s": flops / seconds,
        "mfu": flops / seconds / peak,
    }


def train_benchmark(
    config: TransformerConfig,
    *,
    batch: int = 16,
    source_len: int = 64,
    target_len: int = 64,
    steps: int = 5,
    peak_flops: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Trace/lower/compile seconds, median step time, tokens/s, FLOP/s and MFU of training.

    The step is the library's own (`training.step.train_step`, Adam, label
    smoothing 0.1, jitted by `training.step.jit_train_step`), on random tokens without padding.
    """
    run, results = _library_train_step(config, _random_batch(config, batch, source_len, target_len))
    seconds, _ = _timed(run, steps)
    flops = train_flops_per_step(config, batch, source_len, target_len)
    peak = peak_flops or matmul_peak()
    results.update(
        step_s=seconds,
        flops_per_step=flops,
        matmul_peak_flops_per_s=peak,
        **_throughput(seconds, flops, peak, batch, source_len, target_len),
    )
    log(
        f"train step: {seconds:.3f} s median of {steps}  "
        f"{results['tokens_per_s']:.0f} tokens/s  {flops / 1e9:.1f} GFLOP/step  "
        f"{flops / seconds / 1e9:.1f} GFLOP/s  MFU {results['mfu']:.1%} "
        f"(matmul peak {peak / 1e9:.1f} GFLOP/s)"
    )
    log(
        f"trace {results['trace_s']:.2f} s, lower {results['lower_s']:.2f} s, "
        f"compile {results['compile_s']:.2f} s"
        + (
            f"; temp memory {results['temp_bytes'] / 2**20:.1f} MiB, peak "
            f"{results['peak_bytes'] / 2**20:.1f} MiB (compiler's estimate)"
            if "temp_bytes" in results
            else ""
        )
    )
    return results


BASELINES = ("torch", "torch_compile")


def scheduled_sampling_benchmark(
    config: TransformerConfig,
    scheduled_sampling,
    *,
    batch: int = 16,
    source_len: int = 64,
    target_len: int = 64,
    repeats: int = 5,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """The train step with scheduled sampling against the teacher-forced one, on one batch.

    Both steps are compiled first, then timed alternately (one of each per
    repeat), so that both see the same machine; medians and their ratio.
    """
    arrays = _random_batch(config, batch, source_len, target_len)
    runs = {
        "teacher_forced": _library_train_step(config, arrays)[0],
        "scheduled_sampling": _library_train_step(config, arrays, scheduled_sampling)[0],
    }
    for run in runs.values():
        jax.block_until_ready(run())  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - t0)
    tf_s, ss_s = (statistics.median(times[name]) for name in runs)
    results = {"teacher_forced_step_s": tf_s, "scheduled_sampling_step_s": ss_s}
    results["ratio"] = ss_s / tf_s
    s = scheduled_sampling
    log(
        f"train step, teacher forcing: {tf_s:.4f} s; scheduled sampling ({s.mode}, {s.passes} "
        f"passes, gradient {s.gradient}): {ss_s:.4f} s, x{ss_s / tf_s:.2f} "
        f"(medians of {repeats}, alternating)"
    )
    return results


def compare_train_benchmark(
    config: TransformerConfig,
    *,
    baseline: str = "torch",
    batch: int = 16,
    source_len: int = 64,
    target_len: int = 64,
    repeats: int = 5,
    warmup: int = 2,
    peak_flops: float | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Our train step against a PyTorch `nn.Transformer` of the same sizes, same batch.

    The baseline is `torch_baseline.TrainStep` (eager, or `torch.compile`d for
    "torch_compile") on the same numpy int arrays, on the GPU when JAX's
    default backend is one, else on the CPU with torch using every core. Both
    steps warm up, then `repeats` rounds each time one step of ours followed
    by one of torch's, so that other load on the machine and clock changes hit
    both alike. Model FLOPs (`train_flops_per_step`) and the matmul peak are
    the same for both.

    Returns:
      `train_benchmark`'s figures for ours, the same prefixed `torch_` for the
      baseline, `torch_over_ours` = torch_step_s / step_s (> 1: ours is
      faster), per-round samples and losses, and the torch version/threads/device.
    Raises:
      ImportError (saying how to install it) when PyTorch is missing;
      ConfigError for a config `nn.Transformer` cannot express.
    """
    from flaxformer_lite.benchmarks import torch_baseline  # imports torch; says how to install it

    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
    torch_baseline.check_config(config)
    arrays = _random_batch(config, batch, source_len, target_len)
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    results: dict[str, Any] = dict(torch_baseline.setup(threads, device), baseline=baseline)
    run, compile_times = _library_train_step(config, arrays)
    results.update(compile_times)
    theirs = torch_baseline.TrainStep(
        config, label_smoothing=0.1, bos_id=BOS, device=device, compile=baseline == "torch_compile"
    )
    results["torch_params"] = float(torch_baseline.num_params(theirs.model))
    results["torch_fused_adam"] = theirs.fused_adam
    rounds = _alternate_steps(run, theirs, theirs.to_device(arrays), repeats, warmup)
    results["torch_warmup_s"] = rounds.pop("torch_warmup_s")

    flops = train_flops_per_step(config, batch, source_len, target_len)
    peak = peak_flops or matmul_peak()
    seconds = statistics.median(rounds["step_samples_s"])
    torch_seconds = statistics.median(rounds["torch_step_samples_s"])
    results.update(
        _paired_figures(seconds, torch_seconds, flops, peak, batch, source_len, target_len),
        **rounds,
    )
    _log_comparison(results, baseline, repeats, warmup, flops, peak, device, log)
    return results


def _paired_figures(
    seconds: float,
    torch_seconds: float,
    flops: float,
    peak: float,
    batch: int,
    source_len: int,
    target_len: int,
) -> dict[str, float]:
    """Our step's figures, the same prefixed `torch_` for the baseline, and their ratio."""
    theirs = _throughput(torch_seconds, flops, peak, batch, source_len, target_len)
    return dict(
        step_s=seconds,
        flops_per_step=flops,
        matmul_peak_flops_per_s=peak,
        **_throughput(seconds, flops, peak, batch, source_len, target_len),
        torch_step_s=torch_seconds,
        **{f"torch_{k}": v for k, v in theirs.items()},
        torch_over_ours=torch_seconds / seconds,
    )


def _alternate_steps(
    run: Callable[[], dict[str, jax.Array]], theirs, torch_batch, repeats: int, warmup: int
) -> dict[str, Any]:
    """Warms both steps up, then times `repeats` rounds of one step of ours and one of torch's.

    Returns:
      {step_samples_s, torch_step_samples_s, losses, torch_losses, torch_warmup_s}.
    """

    def mean_loss(sums) -> float:
        return float(sums["loss"]) / max(float(sums["tokens"]), 1.0)

    t0 = time.perf_counter()
    torch_losses = [theirs(torch_batch) for _ in range(warmup)]
    torch_warmup_s = time.perf_counter() - t0
    losses = [mean_loss(jax.block_until_ready(run())) for _ in range(warmup)]
    ours_s, torch_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sums = jax.block_until_ready(run())
        t1 = time.perf_counter()
        torch_losses.append(theirs(torch_batch))  # `.item()` waits for the device
        t2 = time.perf_counter()
        ours_s.append(t1 - t0)
        torch_s.append(t2 - t1)
        losses.append(mean_loss(sums))
    return {
        "step_samples_s": ours_s,
        "torch_step_samples_s": torch_s,
        "losses": losses,
        "torch_losses": torch_losses,
        "torch_warmup_s": torch_warmup_s,
    }


def _log_comparison(
    results: dict[str, Any],
    baseline: str,
    repeats: int,
    warmup: int,
    flops: float,
    peak: float,
    device: str,
    log: Callable[[str], None],
) -> None:
    """Logs a table of both steps' figures, their ratio and the setup behind them."""
    name = {"torch": "torch eager", "torch_compile": "torch.compile"}[baseline]
    log(f"{'':16}{'step median':>12}{'tokens/s':>10}{'GFLOP/s':>9}{'MFU':>7}{'params':>9}")
    for label, prefix in (("flaxformer_lite", ""), (name, "torch_")):
        r = {
            k: results[prefix + k]
            for k in ("step_s", "tokens_per_s", "flops_per_s", "mfu", "params")
        }
        log(
            f"{label:16}{r['step_s']:10.4f} s{r['tokens_per_s']:10.0f}{r['flops_per_s'] / 1e9:9.1f}"
            f"{r['mfu']:7.1%}{r['params'] / 1e6:8.2f}M"
        )
    log(
        f"torch_step / our_step = {results['torch_over_ours']:.2f} (> 1: ours is faster); "
        f"{repeats} alternating rounds after {warmup} warm-up steps each"
    )
    log(
        f"{flops / 1e9:.1f} GFLOP/step, matmul peak {peak / 1e9:.1f} GFLOP/s; torch "
        f"{results['torch_version']} on {device}, {results['torch_threads']} threads; ours: "
        f"trace {results['trace_s']:.2f} s, lower {results['lower_s']:.2f} s, compile "
        f"{results['compile_s']:.2f} s; torch warm-up {results['torch_warmup_s']:.2f} s"
    )
    return results
