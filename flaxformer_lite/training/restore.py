"""Restoring parameters for decoding and scoring: no optimiser, no Adam moments.

A checkpoint's "state" item holds the whole train state (step, params,
opt_state, rng). Decoding needs only the parameters, a third of the bytes for
Adam, so they are read with orbax's partial restore
(`PyTreeRestore(item={"params": ...}, partial_restore=True)`): the other
subtrees are never read, and no optimiser is built. The restore target comes
from the checkpoint's own metadata, so no model is built either.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from flaxformer_lite.training import checkpoints

PARAMS = "params"  # the train state's field holding the model parameters
STATE_ITEM = "state"  # orbax item of the train state (see checkpoints.Checkpointer)


def _read_params(step_dir: str, sharding: jax.sharding.Sharding) -> Any:
    """The params subtree of one checkpoint's state item, every leaf placed on `sharding`."""
    path = os.path.join(step_dir, STATE_ITEM)
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(path).item_metadata.tree  # {field: tree of ArrayMetadata}
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), saved[PARAMS]
    )
    restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=sharding), target)
    restored = checkpointer.restore(
        path,
        args=ocp.args.PyTreeRestore(
            item={PARAMS: target}, restore_args={PARAMS: restore_args}, partial_restore=True
        ),
    )
    return restored[PARAMS]


def verify_params(params: Any, meta: dict[str, Any], where: str) -> None:
    """Compares the params' bytes with the checksums saved in the checkpoint's meta item.

    Checksums are keyed by tree path in the train state (".params['encoder']...");
    leaves without a saved checksum (older checkpoints) are not checked.

    Raises:
      CheckpointIntegrityError: some leaf's bytes differ from what was saved.
    """
    saved = meta.get("checksums", {})
    now = checkpoints.tree_checksums(params)
    bad = [k for k, v in now.items() if saved.get(f".{PARAMS}{k}", v) != v]
    if bad:
        raise checkpoints.CheckpointIntegrityError(
            f"{where} is corrupted: {len(bad)} parameter array(s) differ from their saved "
            f"checksums (first: {bad[0]}); restore an earlier step or delete this one"
        )


def _steps_to_read(ckpt: checkpoints.Checkpointer, step: int | None, average: int) -> list[int]:
    """The checkpoint steps whose parameters are averaged, in step order."""
    steps = ckpt.all_steps()
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(
            f"no checkpoint for step {step} in {ckpt.directory}; available steps: "
            + ", ".join(map(str, steps))
        )
    chosen = [s for s in steps if s <= step][-average:]
    if len(chosen) < average:
        raise FileNotFoundError(
            f"averaging {average} checkpoints needs {average} up to step {step}, but "
            f"{ckpt.directory} has {len(chosen)}: {', '.join(map(str, chosen))}"
        )
    return chosen


def restore_params(
    workdir: str,
    step: int | None = None,
    average: int = 1,
    *,
    sharding: jax.sharding.Sharding | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Parameters of a training workdir's checkpoint, and its run config.

    Args:
      step: the checkpoint to read (default: the latest).
      average: > 1: the mean parameters of the last `average` checkpoints up
        to `step` (checkpoint averaging, as fairseq's average_checkpoints.py;
        it usually adds a little BLEU at no training cost), summed in float32
        and cast back to each leaf's dtype.
      sharding: where every leaf is placed (default: the first local device).
    Returns:
      (params: the nested dict of arrays the model was trained with, the run
      config dict saved in the workdir).
    Raises:
      WorkdirError: not a training workdir.
      FileNotFoundError: no such checkpoint, or fewer than `average` up to `step`.
      CheckpointIntegrityError: some parameter's bytes differ from their saved checksum.
    """
    if average < 1:
        raise ValueError(f"average must be >= 1, got {average}")
    run_config = checkpoints.load_run_config(workdir)
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    ckpt = checkpoints.Checkpointer(workdir, keep=1 << 30, save_every=0)
    try:
        total, last = None, None
        for s in _steps_to_read(ckpt, step, average):  # one checkpoint in memory at a time
            last = _read_params(os.path.join(ckpt.directory, str(s)), sharding)
            verify_params(last, ckpt.read_meta(s), f"checkpoint {s} in {ckpt.directory}")
            if average == 1:
                return last, run_config
            as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32), last)
            total = as_f32 if total is None else jax.tree.map(jnp.add, total, as_f32)
    finally:
        ckpt.close()
    mean = jax.tree.map(lambda t, x: (t / average).astype(x.dtype), total, last)
    return mean, run_config
