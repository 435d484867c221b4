"""Step time and peak memory against sequence length, full vs local encoder self-attention.

What is measured: the encoder alone (feature inputs through the linear front
end, positions, the self-attention layers), forward and backward, i.e. the
gradient of a scalar of its output w.r.t. its parameters. That is where
windowed attention changes the cost: O(n^2) scores become O(n * r).

Memory is XLA's own account of the compiled executable
(`compiled.memory_analysis()`: arguments + outputs + temporaries), so it is
known for every length without running anything, also where the full
program would not fit. Time is the median of `repeats` runs after a warm-up
call, and runs only where that estimate is under `max_run_mib`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.benchmarks.timing import _timed
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models.transformer import Transformer

FIELDS = ("length", "full_ms", "local_ms", "full_mib", "local_mib", "full_growth", "local_growth")


def sweep_config(**overrides) -> TransformerConfig:
    """The encoder slice's model: 80 features, d_model 256, 4 heads, 2 layers, no dropout."""
    values = dict(
        vocab_size=8,
        input_features=80,
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=2,
        num_decoder_layers=1,
        dropout_rate=0.0,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def _encoder_step(config: TransformerConfig) -> Callable:
    """jit(params, features float[B, n, F], valid bool[B, n]) -> gradients of the encoder's
    parameters of mean(encoded^2)."""
    model = Transformer(config)

    def loss(params, features, valid):
        encoded = model.apply({"params": params}, features, valid, method="encode")
        return jnp.mean(jnp.square(encoded.astype(jnp.float32)))

    return jax.jit(jax.grad(loss))


def _encoder_params(config: TransformerConfig) -> dict:
    """Random parameters of the encoder alone ({"encoder": ...}); they do not depend on n."""
    feats = jnp.zeros((1, 4, config.input_features), jnp.float32)
    params = Transformer(config).init(
        jax.random.PRNGKey(0), feats, jnp.ones((1, 2), jnp.int32), source_valid=feats[..., 0] == 0
    )["params"]
    return {"encoder": params["encoder"]}


def measure(
    config: TransformerConfig,
    params: dict,
    length: int,
    *,
    batch: int = 1,
    repeats: int = 3,
    max_run_mib: float = 2048.0,
) -> dict:
    """One point: {"mib": XLA's peak estimate in MiB, "ms": median step ms or None when
    skipped (estimate over `max_run_mib`)}."""
    step = _encoder_step(config)
    rng = np.random.default_rng(length)
    features = jnp.asarray(rng.normal(size=(batch, length, config.input_features)), jnp.float32)
    valid = jnp.ones((batch, length), jnp.bool_)
    compiled = step.lower(params, features, valid).compile()
    stats = compiled.memory_analysis()
    used = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    mib = used / 2**20
    if mib > max_run_mib:
        return {"mib": mib, "ms": None}
    seconds, _ = _timed(lambda: compiled(params, features, valid), repeats)
    return {"mib": mib, "ms": 1e3 * seconds}


def length_sweep(
    lengths: Sequence[int],
    window: int,
    *,
    config: TransformerConfig | None = None,
    batch: int = 1,
    repeats: int = 3,
    max_run_mib: float = 2048.0,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict]:
    """Full vs local (`encoder_window=window`) encoder step at each length.

    Returns:
      one row per length with the keys of `FIELDS` (ms None where not run; growth =
      this length's MiB over the previous length's, None on the first row).
    """
    config = config or sweep_config()
    if not config.input_features:
        raise ValueError("the length sweep reads float features: set input_features > 0")
    full_cfg = config.replace(encoder_window=0)
    local_cfg = config.replace(encoder_window=window)
    params = _encoder_params(full_cfg)
    rows: list[dict] = []
    for length in sorted(lengths):
        full = measure(
            full_cfg, params, length, batch=batch, repeats=repeats, max_run_mib=max_run_mib
        )
        local = measure(
            local_cfg, params, length, batch=batch, repeats=repeats, max_run_mib=max_run_mib
        )
        prev = rows[-1] if rows else None
        rows.append(
            {
                "length": length,
                "full_ms": full["ms"],
                "local_ms": local["ms"],
                "full_mib": full["mib"],
                "local_mib": local["mib"],
                "full_growth": prev and full["mib"] / prev["full_mib"],
                "local_growth": prev and local["mib"] / prev["local_mib"],
            }
        )
        log(format_row(rows[-1]))
    return rows


def _cell(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


HEADER = (
    f"{'length':>7} {'full ms':>10} {'local ms':>10} {'full MiB':>10} {'local MiB':>10} "
    f"{'full x':>7} {'local x':>7}"
)


def format_row(row: dict) -> str:
    """One table line; "skipped" where the full program's estimate was over the run limit."""
    return (
        f"{row['length']:>7} {_cell(row['full_ms'], '10.1f', '   skipped'):>10} "
        f"{_cell(row['local_ms'], '10.1f', '   skipped'):>10} {row['full_mib']:>10.1f} "
        f"{row['local_mib']:>10.1f} {_cell(row['full_growth'], '7.2f'):>7} "
        f"{_cell(row['local_growth'], '7.2f'):>7}"
    )


def format_table(rows: list[dict]) -> str:
    """The sweep as text: a header, one line per length ("x": MiB growth per step of the sweep,
    per doubling when the lengths double)."""
    return "\n".join([HEADER, *(format_row(r) for r in rows)])
