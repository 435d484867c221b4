"""Where arrays live: the device mesh, the logical-axis rules and multi-host setup, in one place.

The mesh has three axes, data x fsdp x model, and every array's layout follows
from them through one table, `LOGICAL_RULES`, that maps the logical axis names
parameters carry (see `config.py`) to mesh axes:

  data    the batch is split over it; parameters are replicated along it.
  fsdp    the batch is split over it too, and so is the `embed` dimension of
          every parameter and of the optimiser state (ZeRO-3 / FSDP): each
          device stores 1/fsdp of the model, and XLA gathers a layer's weights
          when it runs it and reduce-scatters its gradients.
  model   tensor parallelism: heads, feed-forward units and the vocabulary are
          split over it (Megatron style); the batch is replicated along it.

With fsdp = model = 1 (the default) every parameter is replicated and this is
plain data parallelism; the same code runs on a 1-device mesh on a laptop CPU.
A dimension that the mesh axis does not divide is replicated along it instead.

Several processes (hosts) form one job after `initialize_distributed`: the mesh
then spans every process's devices, each process feeds only its own rows of
every global batch (`process_rows`, `put_batch`), and jit inserts the
cross-process gradient all-reduce.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flaxformer_lite.config import ConfigError

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
    grid = np.asarray(devices[:n]).reshape(n // (fsdp * model), fsdp, model)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def mesh_from_config(config) -> Mesh:
    """The mesh a run config asks for (section `mesh`: fsdp, model; absent: data only)."""
    section = config.get("mesh") or {}
    return make_mesh(fsdp=section.get("fsdp", 1), model=section.get("model", 1))


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
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


def logical_shardings(boxed_tree, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings for a tree whose leaves may be `nn.LogicallyPartitioned`.

    Leaves without axis names (step counters, optimiser scalars) are replicated,
    and so is any dimension along a mesh axis that does not divide it (e.g. an
    odd vocabulary size over `model`).
    """
    specs = nn.get_partition_spec(boxed_tree)
    mesh_specs = nn.logical_to_mesh(specs, rules)
    shapes = nn.meta.unbox(boxed_tree)
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)),
        mesh_specs,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


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


# ----------------------------------------------------------------------------
# Several processes.
# ----------------------------------------------------------------------------

# Environment variables read when the arguments of `initialize_distributed` are
# None. JAX 0.10 itself reads only the first; the other two are this library's.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class DistributedError(RuntimeError):
    """The processes of a multi-host job could not be set up; the message says why."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} must be an integer") from None


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"coordinator address {address!r} must be host:port, e.g. 10.0.0.1:1234 (the "
            "address of process 0 and a free port on it)"
        )
    return host.strip("[]"), int(port)


def _wait_for_coordinator(host: str, port: int, timeout_s: float, who: str) -> None:
    """Polls until the coordinator's port accepts TCP connections.

    JAX aborts the whole process (no Python exception) when it cannot reach the
    coordinator, so the common failures are caught here first, with a message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(host, port)
        except socket.gaierror as e:
            raise DistributedError(f"{who}: cannot resolve coordinator host {host!r}: {e}") from e
        try:
            with socket.create_connection((host, port), timeout=5):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"{who}: the coordinator {host}:{port} did not answer within {timeout_s:.0f} s "
                    f"({e}); start process 0 with the same --coordinator_address, and check that "
                    "this host can reach that address and port"
                ) from e
            time.sleep(0.5)


def _check_port_free(port: int, who: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the coordinator will
        try:
            s.bind(("", port))
        except OSError as e:
            raise DistributedError(
                f"{who}: cannot listen on port {port} for the coordinator ({e}); pick a free "
                "port in --coordinator_address"
            ) from e


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    initialization_timeout_s: int = 300,
    heartbeat_timeout_s: int = 100,
    shutdown_timeout_s: int = 300,
) -> None:
    """Joins this process to a multi-process job; call it before anything touches devices.

    A no-op beyond `local_device_count` for a single process (no arguments and
    none of the environment variables above). Otherwise every process runs the
    same program with the same `coordinator_address` (host:port of process 0)
    and `num_processes`, and its own `process_id` in [0, num_processes).

    Args:
      coordinator_address, num_processes, process_id: None: read from
        $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID.
      local_device_count: CPU only: how many devices this process simulates
        (as XLA_FLAGS=--xla_force_host_platform_device_count); accelerators
        always use all their local devices.
      initialization_timeout_s: how long processes wait for each other at start.
      heartbeat_timeout_s: a process silent this long is declared dead, and
        the runtime then terminates all the others (instead of a hang in the
        next collective).
      shutdown_timeout_s: how long an exiting process waits for the others.
    Raises:
      ConfigError: inconsistent arguments.
      DistributedError: JAX's devices were already in use, the coordinator's
        port is taken, or (process > 0) the coordinator cannot be reached.
        Process 0 waiting for peers that never come is aborted by JAX after
        `initialization_timeout_s` (DEADLINE_EXCEEDED on stderr).
    """
    if local_device_count is not None:
        if local_device_count < 1:
            raise ConfigError(f"local_device_count must be >= 1, got {local_device_count}")
        try:
            jax.config.update("jax_num_cpu_devices", local_device_count)
        except RuntimeError as e:  # devices already created
            raise DistributedError(f"local_device_count: {e}") from e
    address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    count = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    index = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if count in (None, 1) and index in (None, 0):
        return  # one process: nothing to coordinate (a coordinator address alone is ignored)
    if address is None or count is None or index is None:
        raise ConfigError(
            "a multi-process job needs --coordinator_address, --num_processes and --process_id "
            f"(or ${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}); got "
            f"{address!r}, {count!r}, {index!r}"
        )
    if count < 1 or not 0 <= index < count:
        raise ConfigError(
            f"process_id must be in [0, num_processes), got process_id={index}, "
            f"num_processes={count}"
        )
    host, port = _split_address(address)
    if jax.distributed.is_initialized():
        return
    # CPU processes exchange gradients through gloo (TCP); accelerators use their own
    # interconnect and ignore this. Keep an explicit user choice such as "mpi".
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    who = f"process {index} of {count}"
    if index == 0:
        _check_port_free(port, who)
    else:
        _wait_for_coordinator(host, port, initialization_timeout_s, who)
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=index,
            initialization_timeout=initialization_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            shutdown_timeout_seconds=shutdown_timeout_s,
        )
    except RuntimeError as e:  # devices already created; failures to connect abort instead
        raise DistributedError(f"{who}: {e}") from e


T = TypeVar("T")


def _all_ok(ok: bool) -> np.ndarray:
    """bool[P]: every process's `ok` (a collective: all processes must call it)."""
    return multihost_utils.process_allgather(np.int32(ok)).reshape(-1).astype(bool)


def process_0_first(fn: Callable[[], T], what: str) -> T:
    """Runs `fn` on process 0, then on the others: process 0 writes, they read what it wrote.

    With one process this is `fn()`. If `fn` fails anywhere, every process
    raises (the failing ones their own error), so that none is left waiting in
    a collective for a peer that has gone.
    """
    if jax.process_count() == 1:
        return fn()
    result, failure = None, None

    def attempt():
        nonlocal result, failure
        try:
            result = fn()
        except Exception as e:  # re-raised below, once every process knows
            failure = e

    for turn in ("first", "then"):
        if (jax.process_index() == 0) == (turn == "first"):
            attempt()
        ok = _all_ok(failure is None)
        if failure is not None:
            raise failure
        if not ok.all():
            failed = ", ".join(str(i) for i in np.flatnonzero(~ok))
            raise DistributedError(f"process(es) {failed} failed while {what}; their logs say why")
    return result
