"""The decoding benchmark on a tiny model: it runs, and its byte count is the analytic one."""

import pytest

from flaxformer_lite import benchmark
from flaxformer_lite.config import TransformerConfig

TINY = TransformerConfig(
    vocab_size=40,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=2,
    dropout_rate=0.0,
)


def test_decode_benchmark_reports_every_figure():
    results = benchmark.decode_benchmark(
        TINY,
        batch=2,
        source_len=5,
        new_tokens=4,
        beam_size=2,
        repeats=1,
        prefix_lens=(1, 3),
        log=lambda s: None,
    )
    for key in (
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
    assert results["greedy_tokens_per_s"] == pytest.approx(2 * 4 / results["greedy_s"])
    # Per step: each decoder layer's self-attention (qkv + out), cross-attention query and
    # output (its K/V projection runs once per source), FFN and 3 LayerNorms, plus the
    # tied output embedding, all float32.
    d, f, v = 16, 24, 40
    attn_self = d * 3 * d + 3 * d + d * d + d
    attn_cross_step = d * d + d + d * d + d
    ffn = d * f + f + f * d + d
    layer = attn_self + attn_cross_step + ffn + 3 * 2 * d
    assert results["step_weight_bytes"] == 4 * (2 * layer + v * d)
