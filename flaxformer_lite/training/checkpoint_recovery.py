"""Restoring a checkpoint step whole, and setting unusable steps aside.

A step restores into the target's shardings, verified against its saved
checksums and converted between stacked and unrolled layers when the run
stores them the other way. On resume (`Checkpointer.restore_latest_good`)
steps are tried newest first; `first_usable` says of each why it cannot be
used, and `set_aside` moves the unusable ones to `checkpoints-corrupt/`,
never deleting them. A step holding another train state than the run builds
(a changed config) is refused as such, not set aside.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from flaxformer_lite.models import layer_layout
from flaxformer_lite.training.checkpoint_checks import (
    all_processes,
    barrier,
    layout,
    tree_checksums,
)
from flaxformer_lite.training.checkpoint_format import (
    STATE_ITEM,
    CheckpointIntegrityError,
    check_format,
    is_out_of_memory,
    read_meta,
    short_reason,
    unusable,
)
from flaxformer_lite.training.workdir import WorkdirError

Log = Callable[[str], None]


def restore_state(
    manager: ocp.CheckpointManager,
    directory: str,
    abstract_state,
    step: int,
    meta: dict[str, Any],
    verify: bool,
):
    """`step`'s train state from `manager` (of `directory`), in `abstract_state`'s layout.

    With `verify`, its arrays are compared with `meta`'s checksums.

    Raises:
      CheckpointIntegrityError: an array differs from its saved checksum.
    """
    target, convert = saved_layers_layout(directory, step, abstract_state)
    restored = manager.restore(
        step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target)})
    )
    state = restored[STATE_ITEM]
    if verify and "checksums" in meta:
        now = tree_checksums(state)
        bad = [k for k, v in meta["checksums"].items() if now.get(k, v) != v]
        if bad:
            raise unusable(
                step,
                directory,
                f"{len(bad)} array(s) differ from their saved checksums (first: {bad[0]})",
            )
    return convert(state)


def saved_layers_layout(directory: str, step: int, abstract_state):
    """(the restore target in the layout of the layers `step` holds, a function that
    puts a state restored in it back into `abstract_state`'s layout and shardings).

    A run may store its layers stacked or unrolled (`model.scan_layers`,
    `models/layer_layout.py`): a checkpoint of either restores into the other, so
    a resume may flip `scan_layers` and checkpoints written before parameters were
    stored stacked resume with it on.
    """
    path = epath.Path(directory) / str(step) / STATE_ITEM
    try:
        saved = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    except Exception:
        return abstract_state, lambda state: state  # the restore itself then says why
    there, here = layer_layout.is_stacked(saved), layer_layout.is_stacked(abstract_state)
    if there is None or here is None or there == here:
        return abstract_state, lambda state: state
    wanted = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state
    )

    def convert(state):
        converted = layer_layout.to_layout(state, here)
        return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), converted, wanted)

    return layer_layout.to_layout(wanted, there), convert


def refuse_other_layout(directory: str, step: int, abstract_state, error: Exception) -> None:
    """Raises WorkdirError if `step` failed because it holds another tree than the target.

    That is a changed config (say another optimiser chain), not corruption:
    no step would restore, and none should be set aside.
    """
    path = epath.Path(directory) / str(step) / STATE_ITEM
    try:
        saved = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    except Exception:
        return  # unreadable metadata: the step itself is bad
    there = layout(saved)
    here = layout(abstract_state)
    if there == here:
        return
    if len(there) != len(here):
        what = f"{len(there)} arrays there vs {len(here)} here"
    else:
        a, b = next((a, b) for a, b in zip(there, here) if a != b)
        what = f"an array of {a[0]} {a[1]} there vs {b[0]} {b[1]} here"
    raise WorkdirError(
        f"checkpoint {step} in {directory} holds another train state than this run "
        f"builds ({what}); resume with the config that wrote it (optimiser settings "
        "included), or pass a new --workdir"
    ) from error


def set_aside(
    directory: str, corrupt_directory: str, bad: list[tuple[int, str]], good: int, log: Log
) -> None:
    """Moves the unusable steps `bad` ((step, why) pairs) from `directory` to
    `corrupt_directory`, logging one line each that says `good` is restored instead."""
    barrier("before setting checkpoints aside")
    for step, why in bad:
        source = os.path.join(directory, str(step))
        dest = os.path.join(corrupt_directory, str(step))
        n = 1
        while os.path.lexists(dest):  # the same step number set aside before
            dest, n = os.path.join(corrupt_directory, f"{step}.{n}"), n + 1
        if jax.process_index() == 0:
            try:
                os.makedirs(corrupt_directory, exist_ok=True)
                os.rename(source, dest)
            except OSError as e:
                raise WorkdirError(
                    f"checkpoint {step} in {directory} is unusable ({why}) and could "
                    f"not be moved to {dest} ({e.strerror or e}); move or delete it, then "
                    "rerun"
                ) from e
        log(
            f"checkpoint {step} in {directory} is unusable ({why}); moved it to "
            f"{dest} and falling back to step {good}"
        )
    barrier("after setting checkpoints aside")


def first_usable(
    manager: ocp.CheckpointManager, workdir: str, directory: str, steps: list[int], abstract_state
) -> tuple[tuple[Any, dict[str, Any], int], list[tuple[int, str]]]:
    """((state, meta, step) of the newest usable of `steps`, the newer unusable (step, why)).

    Every process reads the same files and they agree on each step.

    Raises:
      CheckpointFormatError: a checkpoint written in a newer format (not
        skipped: an older library must not silently train past it).
      CheckpointIntegrityError: no step is usable.
      WorkdirError: a step holds another train state than `abstract_state`.
    """
    bad: list[tuple[int, str]] = []
    for step in reversed(steps):
        state, meta, problem = _try_step(manager, workdir, directory, step, abstract_state)
        if not all_processes(problem is None) and problem is None:
            problem = "another process could not read it"
        if problem is None:
            return (state, meta, step), bad
        bad.append((step, problem))
    listed = ", ".join(str(s) for s, _ in bad)
    reasons = "; ".join(f"{s}: {why}" for s, why in bad[:3])
    more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
    verb = "is" if len(bad) == 1 else "are all"
    raise CheckpointIntegrityError(
        f"no usable checkpoint in {directory}: step{'s' * (len(bad) > 1)} {listed} "
        f"{verb} unusable ({reasons}{more}); delete the workdir's checkpoints to start "
        "over or pass a new --workdir",
        f"steps {listed} unusable",
    )


def _try_step(manager, workdir: str, directory: str, step: int, abstract_state):
    """(state, meta, None) if `step` restores and verifies, else (None, None, why not)."""
    try:
        meta = read_meta(workdir, step)
        check_format(meta, step, directory)
    except CheckpointIntegrityError as e:
        return None, None, e.reason
    try:
        state = restore_state(manager, directory, abstract_state, step, meta, verify=True)
    except CheckpointIntegrityError as e:
        return None, None, e.reason
    except Exception as e:
        if is_out_of_memory(e):
            raise
        refuse_other_layout(directory, step, abstract_state, e)
        return None, None, f"state unreadable: {short_reason(e)}"
    return state, meta, None
