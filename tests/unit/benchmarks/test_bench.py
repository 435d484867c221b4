"""The decoding benchmark on a tiny model: it runs, and its byte count is the analytic one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_model_config

from flaxformer_lite.benchmarks import decoding, train_speed
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.models.transformer import Transformer

TINY = tiny_model_config(vocab_size=40, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1)


def test_decode_benchmark_reports_every_figure():
    results = decoding.decode_benchmark(
        TINY,
        batch=2,
        source_len=5,
        new_tokens=4,
        beam_size=2,
        repeats=1,
        prefix_lens=(1, 3),
        nat_iterations=(2,),
        log=lambda s: None,
    )
    for key in (
        "nat_T2_l1_tokens_per_s",
        "nat_T2_l1_speedup_over_beam2",
        "greedy_tokens_per_s",
        "beam2_tokens_per_s",
        "greedy_uncached_s",
        "cached_speedup",
        "beam2_over_greedy",
        "step_ms_prefix1",
        "step_ms_prefix3",
        "greedy_compile_s",
        "weights_gb_per_s_prefix3",
    ):
        assert results[key] > 0, key
    # Each derived figure is the ratio of the measured seconds it names (batch 2 x 4 tokens).
    r = results
    for name in ("greedy", "beam2", "greedy_uncached", "nat_T2_l1"):
        assert r[f"{name}_tokens_per_s"] == pytest.approx(2 * 4 / r[f"{name}_s"]), name
    assert r["cached_speedup"] == pytest.approx(r["greedy_uncached_s"] / r["greedy_s"])
    assert r["beam2_over_greedy"] == pytest.approx(r["beam2_s"] / r["greedy_s"])
    assert r["nat_T2_l1_speedup_over_greedy"] == pytest.approx(r["greedy_s"] / r["nat_T2_l1_s"])
    assert r["nat_T2_l1_speedup_over_beam2"] == pytest.approx(r["beam2_s"] / r["nat_T2_l1_s"])
    for p in (1, 3):
        seconds = r[f"step_ms_prefix{p}"] / 1e3
        assert r[f"weights_gb_per_s_prefix{p}"] == pytest.approx(
            r["step_weight_bytes"] / seconds / 1e9
        )
    assert r["greedy_weights_gb_per_s"] == pytest.approx(
        r["step_weight_bytes"] / (r["greedy_s"] / 4) / 1e9
    )
    # Per step: each decoder layer's self-attention (qkv + out), cross-attention query and
    # output (its K/V projection runs once per source), FFN and 3 LayerNorms, plus the
    # tied output embedding (its 40 entries padded to 128 rows, `nn/vocab.py`), all float32.
    d, f, v = 16, 24, 128
    attn_self = d * 3 * d + 3 * d + d * d + d
    attn_cross_step = d * d + d + d * d + d
    ffn = d * f + f + f * d + d
    layer = attn_self + attn_cross_step + ffn + 3 * 2 * d
    assert results["step_weight_bytes"] == 4 * (2 * layer + v * d)


def test_ctc_timings_report_each_ratio():
    inputs = jnp.full((2, 5), 7, jnp.int32)
    r = decoding.ctc_timings(
        TINY, inputs, new_tokens=4, ratios=(1.5, 2.0), repeats=1, log=lambda s: None
    )
    for name in ("ctc_r1.5", "ctc_r2"):
        assert r[f"{name}_compile_s"] > 0
        assert r[f"{name}_tokens_per_s"] == pytest.approx(2 * 4 / r[f"{name}_s"]), name


def _dot_flops(jaxpr) -> int:
    """2 * output size * contracted size, summed over every dot_general (sub-jaxprs too)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2 * int(np.prod(out)) * int(np.prod([lhs[d] for d in lhs_contract]))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            total += _dot_flops(sub)
    return total


def test_flops_formula_counts_every_matmul_of_the_forward_pass():
    cfg = TransformerConfig(
        vocab_size=37,
        d_model=24,
        num_heads=3,
        d_kv=6,
        d_ff=40,
        num_encoder_layers=2,
        num_decoder_layers=3,
        dropout_rate=0.0,
    )
    model = Transformer(cfg)
    src, tgt = jnp.ones((2, 7), jnp.int32), jnp.ones((2, 5), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), src, tgt))
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, src, tgt))(params).jaxpr
    assert train_speed.train_flops_per_step(cfg, 2, 7, 5) == 3 * _dot_flops(jaxpr)


def test_train_benchmark_reports_mfu():
    r = train_speed.train_benchmark(
        TINY, batch=2, source_len=6, target_len=5, steps=2, peak_flops=1e9, log=lambda s: None
    )
    assert r["flops_per_step"] == train_speed.train_flops_per_step(TINY, 2, 6, 5)
    assert r["flops_per_s"] == pytest.approx(r["flops_per_step"] / r["step_s"])
    assert r["mfu"] == pytest.approx(r["flops_per_s"] / 1e9)
    assert r["tokens_per_s"] == pytest.approx(2 * (6 + 5) / r["step_s"])
    assert r["target_tokens_per_s"] == pytest.approx(2 * 5 / r["step_s"])
    # The benchmarked step trains the model the config describes: its parameter count is the
    # model's own, counted from abstract shapes.
    model = AutoregressiveModel(TINY)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), {"inputs": (1, 6), "targets": (1, 5)})
    )
    assert r["params"] == sum(np.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert r["compile_s"] > 0 and r["step_s"] > 0


def test_cli_flags_reach_the_benchmarked_model():
    """bench.py times --config's model, with the size flags given overriding it."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    args = "--mode train --repeats 1 --batch 2 --source_len 8 --target_len 8"
    args += " --config configs/tiny.py --config.model.d_ff=48 --num_layers 2 --scan_layers"
    args += " --remat dots_saveable"
    result = subprocess.run(
        [sys.executable, "bench.py", *args.split(), "--json=/dev/stdout"],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout[result.stdout.index("{") :])
    model = out["config"]
    assert (
        model["scan_layers"]
        and model["remat"] == "dots_saveable"
        and model["num_encoder_layers"] == 2
    )
    assert (model["d_model"], model["d_ff"], model["vocab_size"]) == (32, 48, 64)  # tiny's
    assert out["train"]["step_s"] > 0
    assert "layers scanned, remat dots_saveable" in result.stderr
    from flaxformer_lite.cli import host_memory

    # JAX_PLATFORMS=cpu: --host_malloc=auto keeps freed memory wherever glibc is the C library.
    assert out["host_malloc_reuse"] == host_memory.has_glibc()


@pytest.mark.slow  # two more train-step compiles; test_scheduled_sampling runs the jitted step
def test_scheduled_sampling_benchmark_times_both_steps():
    from flaxformer_lite.config.variants import ScheduledSampling

    config = tiny_model_config(vocab_size=40, d_ff=64)
    sampling = ScheduledSampling(mode="argmax")
    r = train_speed.scheduled_sampling_benchmark(
        config, sampling, batch=2, source_len=6, target_len=5, repeats=2, log=lambda s: None
    )
    assert r["teacher_forced_step_s"] > 0 and r["scheduled_sampling_step_s"] > 0
    assert r["ratio"] == r["scheduled_sampling_step_s"] / r["teacher_forced_step_s"]


def test_input_benchmark_counts_every_example_it_times(tfds_dir):
    from flaxformer_lite.benchmarks.input_pipeline import examples_in, input_benchmark
    from flaxformer_lite.config.run import parse

    lines = []
    config = parse(tiny_config(tfds_dir, batch_size=8))
    results = input_benchmark(config, batches=6, log=lines.append)
    assert results["batches"] == 6 and results["examples"] == 6 * 8  # fixed batches, all valid
    assert results["examples_per_s"] > 0 and results["batches_per_s"] > 0
    assert lines[0].startswith("input: ") and " examples/s (" in lines[0]
    packed = {  # two rows: three examples, then one
        "targets_segments": np.array([[1, 1, 2, 3, 0], [1, 1, 1, 0, 0]]),
        "targets_positions": np.array([[0, 1, 0, 0, 0], [0, 1, 2, 0, 0]]),
    }
    assert examples_in(packed) == 4
    assert examples_in({"valid": np.array([True, False, True])}) == 2
