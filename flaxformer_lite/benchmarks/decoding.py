"""Decoding benchmark: whole-search tokens/s and the cost of one cached step by prefix length.

Parameters are random (speed does not depend on their values), and EOS is forbidden so every
search runs all its steps. Next to the autoregressive searches, the non-autoregressive model
of the same size (`models/non_autoregressive.py`) decodes the same number of positions with
Mask-Predict at each of `nat_iterations`: its decoder width is fixed by `max_len`, so its
cost does not depend on the lengths its random length classifier predicts. Timings are as
in :mod:`flaxformer_lite.benchmarks.timing`.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.benchmarks.timing import _compile_seconds, _timed
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.constants import BOS_ID
from flaxformer_lite.models import predict
from flaxformer_lite.models.autoregressive import AutoregressiveModel

BOS = BOS_ID


def decoder_step_bytes(params, config: TransformerConfig) -> int:
    """Bytes of parameters one cached decode step reads.

    Every decoder-layer weight except the cross-attention K/V projection
    (applied once per source, not per step), plus the output projection.
    """
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["decoder"])[0]:
        keys = [getattr(k, "key", "") for k in path]
        if "kv_kernel" in keys or "kv_bias" in keys:
            continue
        total += leaf.size * leaf.dtype.itemsize
    if config.tie_output_embedding:
        table = params["shared_embedding" if config.share_embeddings else "target_embedding"]
        total += table["embedding"].size * table["embedding"].dtype.itemsize
    return total


def decode_benchmark(
    config: TransformerConfig,
    *,
    batch: int = 16,
    source_len: int = 64,
    new_tokens: int = 64,
    beam_size: int = 4,
    repeats: int = 3,
    prefix_lens: tuple[int, ...] = (16, 256),
    uncached: bool = True,
    nat_iterations: tuple[int, ...] = (),
    nat_length_beam: int = 1,
    ctc_ratios: tuple[float, ...] = (),
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Greedy and beam tokens/s, cached vs uncached, per-step time vs prefix length,
    non-autoregressive decoding at each of `nat_iterations` (with `nat_length_beam`), and
    the CTC decoder's one pass at each upsampling ratio of `ctc_ratios`."""
    model = AutoregressiveModel(config)
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(4, config.vocab_size, (batch, source_len)), jnp.int32)
    shapes = {"inputs": (1, source_len), "targets": (1, 8)}
    params = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), shapes)))()
    results = _search_timings(
        model, params, inputs, new_tokens=new_tokens, beam_size=beam_size, repeats=repeats,
        uncached=uncached, log=log,
    )  # fmt: skip
    timed = dict(new_tokens=new_tokens, repeats=repeats, log=log)
    if nat_iterations:
        results |= nat_timings(
            config, inputs, iterations=nat_iterations, length_beam=nat_length_beam, **timed
        )
        names = [f"nat_T{t}_l{nat_length_beam}" for t in nat_iterations]
        _speedups(results, names, beam_size, log)
    if ctc_ratios:
        results |= ctc_timings(config, inputs, ratios=ctc_ratios, **timed)
        _speedups(results, [f"ctc_r{r:g}" for r in ctc_ratios], beam_size, log)
    step_bytes = decoder_step_bytes(params, config)
    results.update(
        _prefix_step_timings(
            model,
            params,
            inputs,
            step_bytes,
            new_tokens=new_tokens,
            repeats=repeats,
            prefix_lens=prefix_lens,
            log=log,
        )  # fmt: skip
    )
    results["step_weight_bytes"] = float(step_bytes)
    # The search's own per-step cost, from the greedy run.
    greedy_step = results["greedy_s"] / new_tokens
    results["greedy_weights_gb_per_s"] = step_bytes / greedy_step / 1e9
    log(
        f"greedy search: {greedy_step * 1e3:.2f} ms/step -> "
        f"{results['greedy_weights_gb_per_s']:.2f} GB/s of weights"
    )
    return results


def _speedups(
    results: dict[str, float], names: list[str], beam_size: int, log: Callable[[str], None]
) -> None:
    """Adds each named NAT run's speed-up over greedy and beam search to `results`, logged."""
    for name in names:
        for base in ("greedy", f"beam{beam_size}"):
            results[f"{name}_speedup_over_{base}"] = results[f"{base}_s"] / results[f"{name}_s"]
        log(
            f"{name}: {results[f'{name}_speedup_over_greedy']:.2f}x greedy, "
            f"{results[f'{name}_speedup_over_beam{beam_size}']:.2f}x beam {beam_size}"
        )


def _search_timings(
    model: AutoregressiveModel,
    params,
    inputs: jax.Array,
    *,
    new_tokens: int,
    beam_size: int,
    repeats: int,
    uncached: bool,
    log: Callable[[str], None],
) -> dict[str, float]:
    """Compile seconds, seconds and tokens/s of whole greedy, beam (and uncached) searches."""
    batch = inputs.shape[0]
    results: dict[str, float] = {}

    def search(method: str, **kw):
        cfg = predict.SearchConfig(method, new_tokens, min_len=new_tokens, **kw)
        return jax.jit(lambda params, inputs: model.predict(params, {"inputs": inputs}, cfg))

    runs = [("greedy", search("greedy")), (f"beam{beam_size}", search("beam", beam_size=beam_size))]
    if uncached:
        runs.append(("greedy_uncached", search("greedy", cached=False)))
    for name, fn in runs:
        results[f"{name}_compile_s"] = _compile_seconds(fn, params, inputs)
        seconds, _ = _timed(
            lambda fn=fn: fn(params, inputs), 1 if name.endswith("uncached") else repeats
        )
        results[f"{name}_s"] = seconds
        results[f"{name}_tokens_per_s"] = batch * new_tokens / seconds
        log(
            f"{name:>16}: {seconds:8.3f} s  {batch * new_tokens / seconds:9.1f} tokens/s  "
            f"(compile {results[f'{name}_compile_s']:.1f} s)"
        )
    if uncached:
        results["cached_speedup"] = results["greedy_uncached_s"] / results["greedy_s"]
    results[f"beam{beam_size}_over_greedy"] = results[f"beam{beam_size}_s"] / results["greedy_s"]
    return results


def nat_timings(
    config: TransformerConfig,
    inputs: jax.Array,
    *,
    new_tokens: int,
    iterations: tuple[int, ...],
    length_beam: int,
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, float]:
    """Seconds and tokens/s of non-autoregressive decoding of `new_tokens` positions."""
    from flaxformer_lite.models.non_autoregressive import NATSearch, NonAutoregressiveModel

    model = NonAutoregressiveModel(config)
    shapes = {"inputs": (1, inputs.shape[1]), "targets": (1, 8)}
    params = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), shapes)))()
    results = {}
    for t in iterations:
        name = f"nat_T{t}_l{length_beam}"
        # max_len counts the appended EOS: the decoder fills new_tokens positions.
        cfg = NATSearch(max_len=new_tokens + 1, iterations=t, length_beam=length_beam)
        fn = jax.jit(lambda params, inputs, cfg=cfg: model.predict(params, {"inputs": inputs}, cfg))
        results.update(_time_one_pass(name, fn, params, inputs, new_tokens, repeats, log))
    return results


def _time_one_pass(name, fn, params, inputs, new_tokens: int, repeats: int, log) -> dict:
    """Compile seconds, seconds and tokens/s of a non-autoregressive decoder `fn(params,
    inputs)` (tokens/s counts `new_tokens` per sentence), logged on one line."""
    compile_s = _compile_seconds(fn, params, inputs)
    seconds, _ = _timed(lambda: fn(params, inputs), repeats)
    tokens_per_s = inputs.shape[0] * new_tokens / seconds
    log(f"{name:>16}: {seconds:8.3f} s  {tokens_per_s:9.1f} tokens/s  (compile {compile_s:.1f} s)")
    return {
        f"{name}_compile_s": compile_s,
        f"{name}_s": seconds,
        f"{name}_tokens_per_s": tokens_per_s,
    }


def ctc_timings(
    config: TransformerConfig,
    inputs: jax.Array,
    *,
    new_tokens: int,
    ratios: tuple[float, ...],
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, float]:
    """Seconds and tokens/s of the CTC decoder (`models/ctc_nat.py`): one decoder call over
    ceil(ratio * source) positions, argmax and collapse, at most `new_tokens` tokens out
    (tokens/s counts `new_tokens` per sentence, as the other runs do)."""
    from flaxformer_lite.models.ctc_nat import CTCModel
    from flaxformer_lite.models.non_autoregressive import NATSearch

    shapes = {"inputs": (1, inputs.shape[1]), "targets": (1, 8)}
    model = CTCModel(config)  # the parameters do not depend on the ratio
    params = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), shapes)))()
    results, search = {}, NATSearch(max_len=new_tokens + 1)
    for ratio in ratios:
        name, model = f"ctc_r{ratio:g}", CTCModel(config, upsample_ratio=ratio)
        fn = jax.jit(lambda p, x, model=model: model.predict(p, {"inputs": x}, search))
        results.update(_time_one_pass(name, fn, params, inputs, new_tokens, repeats, log))
    return results


def _prefix_step_timings(
    model: AutoregressiveModel,
    params,
    inputs: jax.Array,
    step_bytes: int,
    *,
    new_tokens: int,
    repeats: int,
    prefix_lens: tuple[int, ...],
    log: Callable[[str], None],
) -> dict[str, float]:
    """One decode step at each prefix length, in one cache of fixed capacity: ms and the
    GB/s of the `step_bytes` of weights it reads."""
    capacity = max(prefix_lens) + new_tokens
    tokens_to_logits, empty_cache, _ = predict.cached_step(
        model.module, params, inputs, max_len=capacity, bos_id=BOS
    )
    # The cache is donated, as in the search loop, so a step writes it in place
    # instead of copying every layer's keys and values.
    one_step = jax.jit(tokens_to_logits, donate_argnums=1)
    tokens = jnp.full((inputs.shape[0], 1), 5, jnp.int32)
    results: dict[str, float] = {}
    for p in prefix_lens:
        state = {"cache": jax.tree.map(jnp.copy, empty_cache)}

        def run(p=p, state=state):
            cache = dict(state["cache"], index=jnp.int32(p))  # always at prefix length p
            logits, state["cache"] = one_step(tokens, cache)
            return logits

        seconds, _ = _timed(run, max(repeats, 10))
        results[f"step_ms_prefix{p}"] = seconds * 1e3
        results[f"weights_gb_per_s_prefix{p}"] = step_bytes / seconds / 1e9
        log(
            f"step at prefix {p:>4}: {seconds * 1e3:7.2f} ms   weights {step_bytes / 1e6:.1f} MB "
            f"-> {step_bytes / seconds / 1e9:.2f} GB/s"
        )
    return results
