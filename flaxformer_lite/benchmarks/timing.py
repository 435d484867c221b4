"""Wall-clock timing shared by the benchmarks: medians of repeated calls after a warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """(median seconds, all samples) of `fn()` after one warm-up call."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def _compile_seconds(jitted, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    jitted.lower(*args, **kwargs).compile()
    return time.perf_counter() - t0
