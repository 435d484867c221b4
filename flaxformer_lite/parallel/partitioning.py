"""Where arrays live: the device mesh, the logical-axis rules and multi-host setup, in one place.

The mesh has three axes, data x fsdp x model, and every array's layout follows
from them through one table, `LOGICAL_RULES`, that maps the logical axis names
parameters carry (see `config/model.py`) to mesh axes:

  data    the batch is split over it; parameters are replicated along it.
  fsdp    the batch is split over it too, and so is the `embed` dimension of
          every parameter and of the optimiser state (ZeRO-3 / FSDP): each
          device stores 1/fsdp of the model, and XLA gathers a layer's weights
          when it runs it and reduce-scatters its gradients.
  model   tensor parallelism: heads, feed-forward units and the vocabulary are
          split over it (Megatron style); the batch is replicated along it.

With fsdp = model = 1 (the default) every parameter is replicated and this is
plain data parallelism; the same code runs on a 1-device mesh on a laptop CPU.
A parameter dimension that its mesh axis does not divide is a config error
(replicating it would silently cost the memory the axis was meant to save);
an activation dimension is left whole instead (a batch of one while decoding).

Several processes (hosts) form one job after `distributed.initialize_distributed`: the mesh
then spans every process's devices, each process feeds only its own rows of
every global batch (`process_rows`, `put_batch`), and jit inserts the
cross-process gradient all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.sections import MeshConfig

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, MODEL_AXIS)
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)  # the mesh axes a batch is split over

# logical axis -> mesh axis (None: replicated). The only place layouts are declared.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("embed", FSDP_AXIS),
    ("heads", MODEL_AXIS),
    ("kv", None),
    ("qkv", None),
    ("mlp", MODEL_AXIS),
    ("vocab", MODEL_AXIS),
    ("features", None),  # the input size of a feature front end
    ("length_classes", None),  # a non-autoregressive model's length classifier
    ("layers", None),  # the leading axis of scanned layers' parameters: each step reads one
    # Activations (`constrain`): rows split as the batch, the model dimension whole on
    # every device (fsdp splits weights, not activations), heads / feed-forward units /
    # vocabulary over `model` as their weights are. Pinned where layers hand them on,
    # they keep XLA from choosing a layout that moves [B*T, ...] arrays between devices.
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", MODEL_AXIS),
    ("activation_kv", None),
    ("activation_mlp", MODEL_AXIS),
    ("activation_vocab", MODEL_AXIS),
)


def make_mesh(
    num_devices: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    fsdp: int = 1,
    model: int = 1,
) -> Mesh:
    """A data x fsdp x model mesh over `num_devices` (default: all visible) devices.

    `data` gets the devices that `fsdp` and `model` leave: n / (fsdp * model).
    Axes are Auto (not Explicit) so that `with_sharding_constraint` and
    jit-level shardings compose as in the rest of the code. Default devices are
    ordered by process, so that process p holds the contiguous rows
    `[p * B / P, (p + 1) * B / P)` of a global batch, which is what the data
    pipelines produce for it.

    Raises:
      ConfigError: fsdp * model does not divide the device count.
    """
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    n = len(devices) if num_devices is None else num_devices
    if n < 1 or n > len(devices):
        raise ValueError(f"asked for {n} devices but {len(devices)} are visible")
    if fsdp < 1 or model < 1 or n % (fsdp * model):
        raise ConfigError(
            f"mesh.fsdp={fsdp} x mesh.model={model} must divide the {n} devices "
            f"({jax.process_count()} process(es)); the data axis gets the rest"
        )
    shape = (n // (fsdp * model), fsdp, model)
    types = (AxisType.Auto,) * 3
    try:
        # Topology-aware: on TPUs (and GPUs with a known interconnect) neighbouring
        # coordinates of the inner axes are neighbouring chips, so fsdp's and model's
        # collectives ride the fastest links.
        mesh = jax.make_mesh(shape, MESH_AXES, types, devices=devices[:n])
        if _rows_per_process_contiguous(mesh):
            return mesh
    except (ValueError, NotImplementedError):  # e.g. a multi-slice or unknown topology
        pass
    # Simulated CPU devices, hand-picked device lists, and topologies that would
    # interleave processes' rows: devices in process order.
    return Mesh(np.asarray(devices[:n]).reshape(shape), MESH_AXES, axis_types=types)


def _rows_per_process_contiguous(mesh: Mesh) -> bool:
    """Whether every process's devices hold one contiguous block of a batch's rows."""
    rows = batch_devices(mesh) * 2
    index_map = batch_sharding(mesh).devices_indices_map((rows,))
    blocks: dict[int, list[int]] = {}
    for device, index in index_map.items():
        blocks.setdefault(device.process_index, []).extend(range(rows)[index[0]])
    for held in blocks.values():
        held = sorted(set(held))
        if held[-1] - held[0] + 1 != len(held):
            return False
    return True


def mesh_from_config(mesh: MeshConfig) -> Mesh:
    """The mesh a run's `mesh` section asks for (fsdp x model; the rest of the devices
    form the data axis)."""
    return make_mesh(fsdp=mesh.fsdp, model=mesh.model)


# The run-config field that sets each sharded logical dimension of a parameter.
_FIELD_OF_AXIS = {
    "embed": "model.d_model",
    "heads": "model.num_heads",
    "mlp": "model.d_ff",
    "vocab": "model.vocab_multiple (the vocabulary rows are padded to a multiple of it)",
}


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """`spec` with the mesh axes dropped from every dimension they do not divide."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        kept = []
        for name in names:
            size = mesh.shape[name] * int(np.prod([mesh.shape[k] for k in kept]))
            if dim % size == 0:
                kept.append(name)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)


def _check_divisible(path: str, logical, spec: PartitionSpec, shape, mesh: Mesh) -> None:
    """Raises ConfigError where a mesh axis does not divide the parameter dimension it splits.

    Replicating such a dimension instead would silently store (and update) it in
    full on every device of that axis: the memory and the traffic the layout
    was chosen to avoid.
    """
    for i, (dim, axes) in enumerate(zip(shape, spec)):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = int(np.prod([mesh.shape[a] for a in names]))
        if size > 1 and dim % size:
            axis = logical[i] if i < len(logical) else None
            mesh_axes = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in names)
            field = _FIELD_OF_AXIS.get(axis, "the model's dimensions")
            raise ConfigError(
                f"parameter {path} {list(shape)}: its '{axis}' dimension {dim} is not "
                f"divisible by {mesh_axes}; choose {field} divisible by {size}, or a "
                f"smaller {mesh_axes.split('=')[0]}"
            )


def logical_shardings(boxed_tree, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings for a tree whose leaves may be `nn.LogicallyPartitioned`.

    Leaves without axis names (step counters, optimiser scalars) are replicated.

    Raises:
      ConfigError: a mesh axis does not divide the dimension it would split
        (naming the parameter and the config field to change).
    """
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    logical = nn.get_partition_spec(boxed_tree)
    mesh_specs = nn.logical_to_mesh(logical, rules)
    shapes = nn.meta.unbox(boxed_tree)

    def sharding(path, spec, names, x):
        _check_divisible(_path_name(path), tuple(names), spec, x.shape, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, mesh_specs, logical, shapes, is_leaf=is_spec)


def _path_name(path) -> str:
    """ "encoder/layer_0/ffn/wi/kernel" for a key path (optimiser states keep their own keys)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def constrain(x: jax.Array, logical_axes: tuple[str, ...], rules=LOGICAL_RULES) -> jax.Array:
    """x laid out as its logical axes say, on the mesh of the enclosing program.

    The mesh is the abstract one in context (`jit_train_step` and the evaluation
    set it; `jax.set_mesh` outside jit); without one, or on a single device,
    x is returned as it is, so layers run unchanged outside a mesh. A mesh
    axis that does not divide its dimension (a batch of 1 while decoding) is
    dropped for this array.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = nn.logical_to_mesh_axes(logical_axes, rules)
    return jax.lax.with_sharding_constraint(x, _fit(spec, x.shape, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch array: leading axis split over `data` and `fsdp`."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def batch_devices(mesh: Mesh) -> int:
    """How many ways a batch is split: data x fsdp (`model` devices share rows)."""
    return mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch_size(batch_size: int, mesh: Mesh, name: str) -> None:
    """Raises ConfigError unless every device of the mesh gets the same number of rows."""
    n = batch_devices(mesh)
    if batch_size % n:
        shape = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
        raise ConfigError(
            f"{name}={batch_size} must be divisible by the {n} batch shards of the mesh "
            f"({shape}; {jax.process_count()} process(es) x {jax.local_device_count()} local "
            f"devices); use e.g. {n * -(-batch_size // n)}"
        )


def process_rows(batch_size: int, mesh: Mesh) -> slice:
    """The rows of a global batch of `batch_size` rows that this process's devices hold.

    All rows (`slice(0, batch_size)`) for a single process. Raises ValueError if
    they are not contiguous (a hand-made mesh that interleaves processes).
    """
    index_map = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    rows = np.unique(np.concatenate([np.arange(batch_size)[i[0]] for i in index_map.values()]))
    if rows[-1] - rows[0] + 1 != rows.size:
        raise ValueError(
            "this process's devices hold non-contiguous rows of the batch; build the mesh "
            "with make_mesh(), which orders devices by process"
        )
    return slice(int(rows[0]), int(rows[-1]) + 1)


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assembles every process's rows into global batch arrays split along the leading axis.

    Args:
      batch: this process's rows (`process_rows`), each array [B / P, ...]; with
        one process, the whole batch [B, ...]. B must be divisible by the
        mesh's device count (`check_batch_size`).
    Returns:
      Global arrays [B, ...] sharded over `data`; no data crosses hosts.
    """
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()
    }
