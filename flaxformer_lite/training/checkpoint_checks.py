"""The checks around a checkpoint save: checksums and finiteness of the state, the
state read back from disk, its layout, agreement between processes, and quiet output
while orbax writes (its worker threads print the traceback of every failed write).

Leaves split across processes (no process holds them whole) are not hashed: that
would need an all-gather of the whole array onto every host.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath


def digest(arr: np.ndarray) -> str:
    digest = hashlib.sha256(arr.tobytes())
    digest.update(str((arr.dtype, arr.shape)).encode())
    return digest.hexdigest()


def split_across_processes(leaf) -> bool:
    return isinstance(leaf, jax.Array) and not (
        leaf.is_fully_addressable or leaf.is_fully_replicated
    )


def host_pass(tree) -> tuple[dict[str, str], str | None]:
    """(SHA-256 per leaf by tree path, path of the first leaf with a non-finite value or None).

    One host copy of each leaf at a time serves both. Leaves split across
    processes are not hashed (that would need an all-gather of the whole array
    onto every host); their finiteness is reduced on the devices, which gives
    every process the same answer.
    """
    checksums, nonfinite = {}, None
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        if split_across_processes(leaf):
            if nonfinite is None and not finite(leaf, jnp):
                nonfinite = name
            continue
        arr = np.asarray(jax.device_get(leaf))
        checksums[name] = digest(arr)
        if nonfinite is None and not finite(arr, np):
            nonfinite = name
    return checksums, nonfinite


def finite(x, xp) -> bool:
    """Whether a numpy (`xp=np`) or device (`xp=jnp`) array has no inf or NaN."""
    return not jnp.issubdtype(x.dtype, jnp.inexact) or bool(xp.isfinite(x).all())


def tree_checksums(tree) -> dict[str, str]:
    """SHA-256 of every leaf's bytes, keyed by its tree path (host copy of each leaf).

    Orbax checks structure, not content: these catch silent corruption. Leaves
    split across processes (no process holds them whole) are skipped: hashing
    them would need an all-gather of the full array onto every host.
    """
    return host_pass(tree)[0]


def all_processes(ok: bool) -> bool:
    """Whether `ok` holds on every process (each reads its own shards, so they may differ)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.int32(ok)).all())


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"checkpoints: {name}")


def read_on_host(path: epath.Path, like) -> Any:
    """The state item at `path` as host numpy arrays, in `like`'s tree structure.

    Leaves split across processes come back as `ocp.PLACEHOLDER` (not read):
    they have no checksum to compare with.
    """

    def item(x):
        return (
            ocp.PLACEHOLDER if split_across_processes(x) else jax.ShapeDtypeStruct(x.shape, x.dtype)
        )

    def restore_args(x):
        return (
            ocp.PLACEHOLDER
            if split_across_processes(x)
            else ocp.RestoreArgs(restore_type=np.ndarray)
        )

    return ocp.PyTreeCheckpointer().restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=jax.tree.map(item, like), restore_args=jax.tree.map(restore_args, like)
        ),
    )


def layout(tree) -> list[tuple[tuple[int, ...], str]]:
    """The sorted (shape, dtype name) of a tree's arrays (or orbax's ArrayMetadata)."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")]
    return sorted((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves)


@contextlib.contextmanager
def quiet_loggers(*names: str):
    """Only CRITICAL records of these Python loggers while the block runs."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _HeldStderr(io.TextIOBase):
    """sys.stderr while held: the main thread's writes pass through when another thread
    holds (a background save must not swallow the training loop's lines); the rest wait."""

    def __init__(self, real):
        self.real, self.held = real, io.StringIO()
        self._passes = threading.current_thread() is not threading.main_thread()

    def write(self, text: str) -> int:
        if self._passes and threading.current_thread() is threading.main_thread():
            return self.real.write(text)
        return self.held.write(text)

    def flush(self) -> None:
        self.real.flush()


@contextlib.contextmanager
def held_stderr():
    """Collects what Python code writes to sys.stderr in the block; passes it on unless
    the block raised."""
    real = sys.stderr
    held = sys.stderr = _HeldStderr(real)
    try:
        yield
    except BaseException:
        sys.stderr = real
        raise
    sys.stderr = real
    real.write(held.held.getvalue())
