"""Workdir ownership, and whether checkpoints can be written there.

Layout of a workdir:

  workdir/
    run_config.json      the full run config of the run that made it (marks ownership)
    checkpoints/<step>/  orbax checkpoints (see checkpoint_format.py)
    checkpoints-corrupt/<step>/  checkpoints found unusable when resuming, moved
                         aside (never deleted)
    vocab.spm            the shared tokenizer, or vocab.source.spm and
                         vocab.target.spm (see data/tokenizer.py: Vocabularies)
    metrics.jsonl        one JSON object per logged step / evaluation
    tensorboard/         event files

A run only writes into a workdir that is empty, new, or carries a
`run_config.json` whose model has the same parameter shapes as its own;
anything else is refused with a `WorkdirError`, and nothing is deleted.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Mapping

import jax
import numpy as np

from flaxformer_lite import atomic_files
from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.run import RunConfig

# {parameter path: (shape, dtype name)}, as `training.state.param_shapes` returns.
ParamShapes = Mapping[str, tuple[tuple[int, ...], str]]

RUN_CONFIG = "run_config.json"
CHECKPOINT_DIR = "checkpoints"


class WorkdirError(RuntimeError):
    """The workdir cannot be used as asked; the message says why and what to do."""


def claim_workdir(
    workdir: str,
    run: RunConfig,
    param_shapes: ParamShapes,
    saved_param_shapes: Callable[[RunConfig], ParamShapes],
) -> bool:
    """Makes sure `workdir` belongs to this run; returns True if it already had a run.

    A workdir's run is resumed when its model has the same parameters (paths,
    shapes and dtypes) as this run's: changes that keep them, such as a dropout
    rate, resume; any other change is refused.

    Args:
      workdir: directory path (created if missing).
      run: this run's config, with its vocabularies' sizes (saved as `run.to_json()`).
      param_shapes: this run's {parameter path: (shape, dtype name)}
        (`training.state.param_shapes`).
      saved_param_shapes: computes those of a saved run config
        (`training.load_state.saved_param_shapes`).
    Raises:
      WorkdirError: the path is a file, a non-empty foreign directory, or a
        workdir whose model has other parameters.
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"workdir {workdir!r} is a file; pass --workdir a directory path")
    marker = os.path.join(workdir, RUN_CONFIG)
    if os.path.isdir(workdir) and not os.path.exists(marker) and os.listdir(workdir):
        raise WorkdirError(
            f"workdir {workdir!r} is not empty and was not made by this library (no "
            f"{RUN_CONFIG}); pass a new or empty directory as --workdir"
        )
    if os.path.exists(marker):
        previous = _read_run_config(marker, "or use another --workdir")
        try:
            old = saved_param_shapes(previous)
        except (KeyError, TypeError, ValueError) as e:  # (ConfigError is a ValueError)
            raise WorkdirError(
                f"workdir {workdir!r} holds a run config whose model cannot be built here "
                f"({type(e).__name__}: {e}); pass a new --workdir"
            ) from e
        diffs = shape_differences(old, param_shapes)
        if diffs:
            more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
            before, now = previous.model.to_dict(), run.model.to_dict()
            fields = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
            raise WorkdirError(
                f"workdir {workdir!r} holds a model with other parameters ("
                + "; ".join(diffs[:3])
                + more
                + (f"; model fields changed: {', '.join(fields)}" if fields else "")
                + "); use the same model config to resume, or pass a new --workdir"
            )
        return True
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:
        atomic_files.atomic_write(
            marker, json.dumps(run.to_json(), indent=2, sort_keys=True).encode()
        )
    return False


def shape_differences(there: ParamShapes, here: ParamShapes) -> list[str]:
    """One "path: <there> there vs <here> here" per parameter that differs, in path order."""

    def show(entry):
        return "absent" if entry is None else f"{tuple(entry[0])} {entry[1]}"

    out = []
    for path in sorted(set(there) | set(here)):
        a, b = there.get(path), here.get(path)
        if a is None or b is None or (tuple(a[0]), a[1]) != (tuple(b[0]), b[1]):
            out.append(f"{path}: {show(a)} there vs {show(b)} here")
    return out


def load_run_config(workdir: str) -> RunConfig:
    """The run config saved in a workdir, typed; one an earlier version saved is read as
    that version meant it (`RunConfig.from_json`)."""
    marker = os.path.join(workdir, RUN_CONFIG)
    if not os.path.exists(marker):
        raise WorkdirError(
            f"{workdir!r} has no {RUN_CONFIG}: it is not a training workdir; "
            "pass the --workdir that train.py wrote"
        )
    return _read_run_config(marker, "or pass the --workdir that train.py wrote")


def _read_run_config(marker: str, fix: str) -> RunConfig:
    """The run config in `marker`, or a WorkdirError naming what is wrong with the file."""
    with open(marker, "rb") as f:
        data = f.read()
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WorkdirError(f"{marker} is not valid JSON ({e}); restore it, {fix}") from None
    if not isinstance(config, dict) or not all(
        isinstance(config.get(k), dict) for k in ("model", "data")
    ):
        raise WorkdirError(
            f"{marker} is not a run config (train.py writes a JSON object with model and "
            f"data sections); restore it, {fix}"
        )
    try:
        return RunConfig.from_json(config)
    except (ConfigError, TypeError) as e:
        raise WorkdirError(
            f"{marker} holds a run config this version cannot read ({e}); {fix}"
        ) from None


def state_nbytes(tree) -> int:
    """Bytes of all the leaves of `tree` (arrays or `jax.ShapeDtypeStruct`s), whole arrays.

    For `check_writable`: a save needs about twice this (the previous checkpoint
    is kept until the new one is verified).
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    return total


def check_writable(workdir: str, need_bytes: int) -> None:
    """Refuses a workdir where checkpoints cannot be written, before any training.

    A probe file is created and removed in the checkpoint directory, or in its
    nearest existing ancestor (nothing is left behind or created: a new workdir
    stays new for `claim_workdir`), and the free space is compared with
    `need_bytes` (`2 * state_nbytes(state)`: the new checkpoint, with the
    previous one kept until it is verified).

    Raises:
      WorkdirError: the directory cannot be created or written, or has less
        than `need_bytes` free.
    """
    directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    existing = directory
    while not os.path.isdir(existing):
        if os.path.lexists(existing):
            raise WorkdirError(
                f"cannot write checkpoints to {directory}: {existing} is not a directory; "
                "pass another --workdir"
            )
        existing = os.path.dirname(existing)
    probe = os.path.join(existing, f".write-probe-{jax.process_index()}-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(
            f"cannot write checkpoints to {directory}: {e.strerror or e} in {existing}; "
            "make it writable or pass another --workdir"
        ) from None
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise WorkdirError(
            f"workdir {workdir} has {_mb(free)} free, but a checkpoint needs about "
            f"{_mb(need_bytes)} (twice the train state, since the previous one is kept until "
            "the new one is verified); free space or pass another --workdir"
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e7 else f"{n / 1e6:,.0f} MB"
