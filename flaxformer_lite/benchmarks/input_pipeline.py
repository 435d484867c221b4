"""The training input pipeline alone: how many examples per second it hands the devices.

A train step consumes `train.batch_size` examples; if the pipeline cannot
deliver them faster than the step runs, the device waits. This times what
`train_loop` runs in front of every step (the host thread building batches,
`train_data.prefetch`, and the copy to the devices, `train_data.device_prefetch`)
with no model at all, after the one-off work (reading the splits, training the
vocabulary, tokenizing and planning the batches), which is timed apart.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

from flaxformer_lite.config.run import RunConfig


def examples_in(batch: dict[str, np.ndarray]) -> int:
    """Examples in one host batch: its valid rows, or with packing its target segments."""
    if "targets_segments" in batch:
        starts = (batch["targets_positions"] == 0) & (batch["targets_segments"] > 0)
        return int(starts.sum())
    return int(np.asarray(batch["valid"]).sum())


def input_benchmark(
    config: RunConfig, batches: int, log: Callable[[str], None] = print
) -> dict[str, float]:
    """{prepare_s, batches, examples, examples_per_s, batches_per_s} of `config`'s training input.

    The vocabulary is trained into a temporary directory (none of a workdir is touched).
    """
    from flaxformer_lite import datasets
    from flaxformer_lite.parallel import partitioning
    from flaxformer_lite.training import step as step_lib
    from flaxformer_lite.training import train_data

    mesh = partitioning.mesh_from_config(config.mesh)
    t0 = time.perf_counter()
    splits = datasets.load_splits(config.data)
    with tempfile.TemporaryDirectory(prefix="input-bench-") as workdir:
        tokenizer, _ = train_data.load_or_train_tokenizer(config.data, workdir, splits["train"])
    plan = train_data.make_train_batches(
        config.data,
        config.train,
        splits["train"],
        tokenizer,
        lambda s: None,
        extended=config.copy is not None,
    )
    prepare_s = time.perf_counter() - t0

    counted = []

    def make(i: int) -> dict:
        host = plan[i]
        counted.append(examples_in(host))
        return host

    t1 = time.perf_counter()
    device_batches = train_data.device_prefetch(
        train_data.prefetch(make, 0, batches), lambda host: step_lib.device_batch(host, mesh)
    )
    for batch in device_batches:
        jax.block_until_ready(batch)
    seconds = time.perf_counter() - t1
    results = {
        "prepare_s": prepare_s,
        "batches": batches,
        "examples": sum(counted),
        "examples_per_s": sum(counted) / seconds,
        "batches_per_s": batches / seconds,
    }
    log(
        f"input: {results['examples_per_s']:.0f} examples/s ({results['batches_per_s']:.1f} "
        f"batches/s of {config.data.batching} batches, {batches} timed); reading, vocabulary "
        f"and batch plan first: {prepare_s:.1f} s"
    )
    return results
