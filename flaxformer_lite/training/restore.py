"""Restoring parameters for decoding and scoring: no optimiser, no Adam moments.

A checkpoint's "state" item holds the whole train state (step, params,
opt_state, rng). Decoding needs only the parameters, a third of the bytes for
Adam, so they are read with orbax's partial restore
(`PyTreeRestore(item={"params": ...}, partial_restore=True)`): the other
subtrees are never read, and no optimiser is built. The restore target comes
from the checkpoint's own metadata, so no model is built either.

Which checkpoint is read is a step spec (`resolve_step`): "latest", a step
number, "best" (by the validation metric saved with it), or "latest-good" (the
newest whose parameters read and verify). Nothing here writes to the workdir.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.models import layer_layout
from flaxformer_lite.training import checkpoint_checks, checkpoint_format
from flaxformer_lite.training.workdir import CHECKPOINT_DIR, load_run_config

PARAMS = "params"  # the train state's field holding the model parameters
STATE_ITEM = checkpoint_format.STATE_ITEM  # orbax item of the train state
STEP_SPECS = ("latest", "latest-good", "best")  # besides a step number


class StepSpecError(ValueError):
    """A step spec that is none of `STEP_SPECS` nor a step number, or names no checkpoint."""


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _read_params(step_dir: str, sharding: jax.sharding.Sharding) -> Any:
    """The params subtree of one checkpoint's state item, every leaf placed on `sharding`."""
    # Absolute: orbax reads no tree metadata from a relative path (a relative --workdir).
    path = os.path.abspath(os.path.join(step_dir, STATE_ITEM))
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
    now = checkpoint_checks.tree_checksums(params)
    bad = [k for k, v in now.items() if saved.get(f".{PARAMS}{k}", v) != v]
    if bad:
        reason = (
            f"{len(bad)} parameter array(s) differ from their saved checksums (first: {bad[0]})"
        )
        raise checkpoint_format.CheckpointIntegrityError(
            f"{where} is corrupted: {reason}; restore an earlier step or delete this one", reason
        )


def parse_step(spec: str | int | None) -> int | str:
    """A step spec as a step number or one of `STEP_SPECS` (None is "latest").

    Raises:
      StepSpecError: anything else.
    """
    if spec is None:
        return "latest"
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return spec
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text.isdigit():
            return int(text)
        if text in STEP_SPECS:
            return text
    raise StepSpecError(
        f"--step {spec!r} is not a checkpoint: pass latest, latest-good, best, or a step number"
    )


def resolve_step(
    workdir: str, spec: str | int | None, *, log: Callable[[str], None] = _warn
) -> int:
    """The checkpoint step a spec names in `workdir`.

    Args:
      spec: None or "latest": the newest complete step; a step number (int or
        digits); "best": the best step by the metric the run ranked its
        checkpoints with (meta "best_metric"/"best_mode", default loss, lower
        is better); "latest-good": the newest step whose parameters restore and
        verify, logging one warning per newer unusable step (nothing is moved:
        decoding leaves the workdir as it is).
    Raises:
      StepSpecError: `spec` is no step spec, or "best" without any checkpoint
        saved with validation metrics.
      FileNotFoundError: no checkpoint, or none for that step number.
      CheckpointIntegrityError: "latest-good" with no usable checkpoint.
    """
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return _resolve(workdir, parse_step(spec), sharding, log)[0]


def _resolve(
    workdir: str, spec: int | str, sharding: jax.sharding.Sharding, log
) -> tuple[int, Any]:
    """(step, its verified params if reading them was how it was found, else None)."""
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    steps = checkpoint_format.list_steps(workdir)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    if spec == "latest":
        return steps[-1], None
    if isinstance(spec, int):
        if spec not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {spec} in {directory}; available steps: "
                + ", ".join(map(str, steps))
            )
        return spec, None
    if spec == "best":
        return _best(workdir, steps), None
    bad = []
    for step in reversed(steps):
        try:
            params = _read_verified(workdir, step, sharding)
        except checkpoint_format.CheckpointFormatError:
            raise
        except Exception as e:
            if checkpoint_format.is_out_of_memory(e):
                raise
            bad.append((step, checkpoint_format.short_reason(e)))
            continue
        for s, why in bad:
            log(f"warning: checkpoint {s} in {directory} is unusable ({why}); using step {step}")
        return step, params
    listed = ", ".join(str(s) for s, _ in bad)
    verb = "is" if len(bad) == 1 else "are all"
    raise checkpoint_format.CheckpointIntegrityError(
        f"no usable checkpoint in {directory}: step{'s' * (len(bad) > 1)} {listed} {verb} "
        f"unusable (first, {bad[0][0]}: {bad[0][1]}); pass another --workdir"
    )


def _best(workdir: str, steps: list[int]) -> int:
    metrics, metric, mode = {}, "loss", "min"
    for step in steps:
        try:
            meta = checkpoint_format.read_meta(workdir, step)
        except checkpoint_format.CheckpointIntegrityError:
            continue  # an unreadable step cannot be ranked
        if meta.get("metrics"):
            metrics[step] = meta["metrics"]
            metric, mode = meta.get("best_metric", metric), meta.get("best_mode", mode)
    best = checkpoint_format.best_steps(metrics, metric, mode)
    if not best:
        directory = os.path.join(workdir, CHECKPOINT_DIR)
        what = f"a finite validation {metric!r}" if metrics else "validation metrics"
        raise StepSpecError(
            f"{directory} has no checkpoint with {what}; train with train.eval_every > 0, "
            "or pass --step latest"
        )
    return best[0]


def _read_verified(workdir: str, step: int, sharding: jax.sharding.Sharding) -> Any:
    """The params of checkpoint `step`, checked against its format and checksums."""
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    meta = checkpoint_format.read_meta(workdir, step)
    checkpoint_format.check_format(meta, step, directory)
    params = _read_params(os.path.join(directory, str(step)), sharding)
    verify_params(params, meta, f"checkpoint {step} in {directory}")
    return params


def _steps_to_average(workdir: str, step: int, average: int) -> list[int]:
    """The checkpoint steps whose parameters are averaged, in step order."""
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    chosen = [s for s in checkpoint_format.list_steps(workdir) if s <= step][-average:]
    if len(chosen) < average:
        raise FileNotFoundError(
            f"averaging {average} checkpoints needs {average} up to step {step}, but "
            f"{directory} has {len(chosen)}: {', '.join(map(str, chosen))}"
        )
    return chosen


def restore_params(
    workdir: str,
    step: str | int | None = None,
    average: int = 1,
    *,
    sharding: jax.sharding.Sharding | None = None,
    log: Callable[[str], None] = _warn,
) -> tuple[Any, RunConfig]:
    """Parameters of a training workdir's checkpoint, and its run config.

    Args:
      step: a step spec (see `resolve_step`; default: the latest).
      average: > 1: the mean parameters of the last `average` checkpoints up
        to `step` (checkpoint averaging, as fairseq's average_checkpoints.py;
        it usually adds a little BLEU at no training cost), summed in float32
        and cast back to each leaf's dtype.
      sharding: where every leaf is placed (default: the first local device).
      log: where "latest-good" warns about the unusable steps it skips.
    Returns:
      (params: the nested dict of arrays the model was trained with, the run
      config saved in the workdir).
    Raises:
      WorkdirError: not a training workdir.
      StepSpecError: `step` is no step spec.
      FileNotFoundError: no such checkpoint, or fewer than `average` up to `step`.
      CheckpointFormatError: the checkpoint was written in a newer format.
      CheckpointIntegrityError: some parameter's bytes differ from their saved
        checksum; or see `resolve_step`.
    """
    if average < 1:
        raise ValueError(f"average must be >= 1, got {average}")
    run_config = load_run_config(workdir)
    spec = parse_step(step)
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    chosen_step, read = _resolve(workdir, spec, sharding, log)
    total, last = None, None
    for s in _steps_to_average(workdir, chosen_step, average):  # one in memory at a time
        last = read if s == chosen_step and read is not None else None
        if last is None:
            last = _read_verified(workdir, s, sharding)
        if average == 1:
            return _model_layout(last, run_config), run_config
        as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32), last)
        total = as_f32 if total is None else jax.tree.map(jnp.add, total, as_f32)
    mean = jax.tree.map(lambda t, x: (t / average).astype(x.dtype), total, last)
    return _model_layout(mean, run_config), run_config


def _model_layout(params: Any, run: RunConfig) -> Any:
    """`params` with their layers stacked or not as the run config's model reads them: a
    checkpoint written before `model.scan_layers` stored them stacked holds them unrolled."""
    return layer_layout.to_layout(params, run.model.scan_layers)
