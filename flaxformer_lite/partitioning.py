"""Where arrays live: the device mesh and the logical-axis rules, in one place.

Parameters carry logical axis names (see `config.py`); `LOGICAL_RULES` maps
them to mesh axes. With the default rules every parameter is replicated and
the batch is split over the `data` axis (plain data parallelism); the same
code runs on a 1-device mesh on a laptop CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"

# logical axis -> mesh axis (None: replicated).
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA_AXIS),
    ("length", None),
    ("embed", None),
    ("heads", None),
    ("kv", None),
    ("qkv", None),
    ("mlp", None),
    ("vocab", None),
)


def make_mesh(num_devices: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over `num_devices` (default: all visible) devices, axis `data`.

    Axes are Auto (not Explicit) so that `with_sharding_constraint` and
    jit-level shardings compose as in the rest of the code.
    """
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices) if num_devices is None else num_devices
    if n < 1 or n > len(devices):
        raise ValueError(f"asked for {n} devices but {len(devices)} are visible")
    return Mesh(np.asarray(devices[:n]), (DATA_AXIS,), axis_types=(AxisType.Auto,))


def logical_shardings(boxed_tree, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings for a tree whose leaves may be `nn.LogicallyPartitioned`.

    Leaves without axis names (step counters, optimiser scalars) are replicated.
    """
    specs = nn.get_partition_spec(boxed_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch array: leading axis split over `data`."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Places a host batch on the mesh, split along its leading axis.

    Batch size must be divisible by the mesh's data size.
    """
    sharding = batch_sharding(mesh)
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
