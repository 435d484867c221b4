"""What every search shares: the decoding step it calls and a top-k over rows.

Every autoregressive search takes a `TokensToLogits` callable and the cache it
starts from. The cache is an arbitrary pytree owned by the caller's adapter (see
`models/predict.py`); search code only threads it through. `rows_top_k` is the
top-k that greedy filtering, beam search and Mask-Predict rank with: under a mesh
each device takes it over its own rows.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import PartitionSpec

from flaxformer_lite.parallel.partitioning import BATCH_AXES

NEG_INF = -1.0e7  # log-probability of an impossible candidate; finite so sums stay ordered


class TokensToLogits(Protocol):
    """One decoding step.

    Args:
      token_ids: int32[batch, 1], the token chosen at the previous step (BOS first).
      cache: the adapter's state (a pytree).
    Returns:
      (logits float32[batch, vocab] for the next token, new cache).
    """

    def __call__(self, token_ids: jax.Array, cache: Any) -> tuple[jax.Array, Any]: ...


def rows_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` over the last axis of x [B, ..., N], each device on its own rows.

    XLA's partitioner has no rule for top-k along a split batch axis: it
    all-gathers the operand onto every device (in beam search, the [B, K, V]
    log-probabilities at every step). Under a mesh (`jax.set_mesh`, as
    `predict.decode`'s callers set it) whose batch axes split B, the top-k
    runs per shard instead, which is exact since rows are independent.
    Returns (values [B, ..., k], indices int32 [B, ..., k]).
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    shards = int(np.prod([mesh.shape[a] for a in axes]))
    if not axes or x.shape[0] % shards:
        return jax.lax.top_k(x, k)
    spec = PartitionSpec(axes)
    return jax.shard_map(
        lambda rows: tuple(jax.lax.top_k(rows, k)),
        mesh=mesh,
        in_specs=spec,
        out_specs=(spec, spec),
        axis_names=set(axes),
    )(x)
