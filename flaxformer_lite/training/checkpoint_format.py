"""What a checkpoint step holds on disk, and reading it without a checkpointer.

A workdir's `checkpoints/<step>/` holds two orbax items: "state" (the train
state) and "meta" (JSON: step, format version, model config, per-leaf SHA-256
checksums, validation metrics when given). Steps found unusable on resume are
moved to `checkpoints-corrupt/<step>/`, out of orbax's sight, never deleted.
(`workdir.py` describes the rest of a workdir.)

Here are the item names and format version, the errors a checkpoint raises,
and what decoding and the checkpointer both need: listing the complete steps,
reading a step's meta, refusing a newer format, ranking steps by a metric and
saying in one line why a read or write failed. Nothing here creates or changes
anything in a workdir.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from flaxformer_lite.training.workdir import CHECKPOINT_DIR

CORRUPT_SUFFIX = "-corrupt"  # checkpoints/ -> checkpoints-corrupt/ for steps set aside
STATE_ITEM, META_ITEM = "state", "meta"  # the orbax items of a step
# Version of what a step holds (items, meta fields, tree layout). Bump it when a
# change would make older code misread a new checkpoint; older checkpoints stay readable.
FORMAT_VERSION = 1


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint cannot be trusted: its bytes differ from what was saved, or it is unreadable.

    `reason` is the short cause alone (no step, no directory), for summaries.
    """

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


class CheckpointFormatError(RuntimeError):
    """A checkpoint was written by a newer library, in a format this one cannot read."""


class CheckpointWriteError(RuntimeError):
    """A save failed (no space, no permission, read-back mismatch, non-finite state).

    The failed step leaves nothing behind, and every earlier checkpoint is kept.
    """


def list_steps(workdir: str) -> list[int]:
    """Steps of the complete checkpoints in `workdir`, ascending (unfinished saves skipped)."""
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        # Orbax saves into "<step>.orbax-checkpoint-tmp-*" and renames when done; where renames
        # are not atomic (GCS) it marks a finished "<step>" with a commit file instead.
        if name.isdigit() and ocp.path.step.is_checkpoint_finalized(epath.Path(path)):
            steps.append(int(name))
    return sorted(steps)


def read_meta(workdir: str, step: int) -> dict[str, Any]:
    """The meta item of `workdir`'s checkpoint `step`, read without opening a manager.

    Nothing is created or changed in the workdir, so decoding can call it.

    Raises:
      CheckpointIntegrityError: the item is missing, not JSON, or not a JSON object.
    """
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    path = epath.Path(directory) / str(step) / META_ITEM
    try:
        meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path)
    except Exception as e:
        reason = f"meta unreadable: {short_reason(e)}"
        raise unusable(step, directory, reason) from e
    if not isinstance(meta, dict):
        reason = f"meta is a JSON {type(meta).__name__}, not an object"
        raise unusable(step, directory, reason)
    return meta


def check_format(meta: Mapping[str, Any], step: int, directory: str) -> None:
    """Refuses a checkpoint written in a newer format; one without a version is an old one.

    Raises:
      CheckpointFormatError: its format version is above `FORMAT_VERSION`.
      CheckpointIntegrityError: its format version is not an integer.
    """
    version = meta.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise unusable(step, directory, f"format_version {version!r} is not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"checkpoint {step} in {directory} has format version {version}, newer than this "
            f"library's ({FORMAT_VERSION}); upgrade flaxformer_lite or pass an older --step"
        )


def best_steps(
    metrics: Mapping[int, Mapping[str, float]], metric: str, mode: str, count: int = 1
) -> list[int]:
    """The `count` best steps by `metrics[step][metric]` ("min" or "max"), best first.

    Steps without a finite value of `metric` are no candidates; of equal values
    the earlier step wins (as in early stopping, where only a strict improvement
    makes a new best).
    """
    if mode not in ("min", "max"):
        raise ValueError(f"best mode must be 'min' or 'max', got {mode!r}")
    sign = 1.0 if mode == "min" else -1.0
    ranked = sorted(
        (sign * float(m[metric]), step)
        for step, m in metrics.items()
        if isinstance(m, Mapping)
        and isinstance(m.get(metric), int | float)
        and math.isfinite(m[metric])
    )
    return [step for _, step in ranked[:count]]


def short_reason(e: BaseException) -> str:
    """One line saying why `e` happened: its innermost cause, without long file paths.

    Orbax wraps tensorstore's error ("OUT_OF_RANGE: Error reading ...") in a
    bare `Exception` whose message is a page of tensorstore spec; the cause is
    the readable part.
    """
    if isinstance(e, CheckpointIntegrityError):
        return e.reason
    seen = 0
    while seen < 8:
        inner = e.__cause__ or (e.__context__ if type(e) is Exception else None)
        if inner is None:
            break
        e, seen = inner, seen + 1
    text = (str(e).strip().splitlines() or [""])[0]
    text = re.sub(r' at local file "[^"]*"', "", text)
    text = re.sub(r'"/(?:[^"]*/)?([^"/]+)/?"', r'"\1"', text)  # a path: its last part
    code = re.search(r"os_error_code='(\d+)'", text)
    if code and len(text) > 160:  # tensorstore's "RESOURCE_EXHAUSTED: ... [os_error_code='28']"
        text = f"{text.split(':')[0]}: {os.strerror(int(code.group(1)))}"
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def unusable(step: int, directory: str, reason: str) -> CheckpointIntegrityError:
    """The error for `step` in `directory` that cannot be trusted, with the short `reason`."""
    return CheckpointIntegrityError(
        f"checkpoint {step} in {directory} is corrupted: {reason}; restore an earlier step "
        "or delete this one",
        reason,
    )


def is_out_of_memory(e: BaseException) -> bool:
    """Whether a read failed for lack of memory, which says nothing about the checkpoint."""
    return isinstance(e, MemoryError) or "out of memory" in str(e).lower()
