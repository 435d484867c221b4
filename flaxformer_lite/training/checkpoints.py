"""Workdir ownership, orbax checkpoints and their integrity checks.

Layout of a workdir:

  workdir/
    run_config.json      the full run config of the run that made it (marks ownership)
    checkpoints/<step>/  orbax items: "state" (train state), "meta" (JSON: step,
                         model config, per-leaf SHA-256 checksums)
    vocab.spm            the shared tokenizer, or vocab.source.spm and
                         vocab.target.spm (see data/tokenizer.py: Vocabularies)
    metrics.jsonl        one JSON object per logged step / evaluation
    tensorboard/         event files

A run only writes into a workdir that is empty, new, or carries a
`run_config.json` whose model has the same parameter shapes as its own;
anything else is refused with a `WorkdirError`, and nothing is deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from flaxformer_lite import files

# {parameter path: (shape, dtype name)}, as `training.state.param_shapes` returns.
ParamShapes = Mapping[str, tuple[tuple[int, ...], str]]

RUN_CONFIG = "run_config.json"
CHECKPOINT_DIR = "checkpoints"


class WorkdirError(RuntimeError):
    """The workdir cannot be used as asked; the message says why and what to do."""


class CheckpointIntegrityError(RuntimeError):
    """A restored checkpoint's bytes differ from what was saved."""


def claim_workdir(
    workdir: str,
    run_config: dict[str, Any],
    param_shapes: ParamShapes,
    saved_param_shapes: Callable[[dict[str, Any]], ParamShapes],
) -> bool:
    """Makes sure `workdir` belongs to this run; returns True if it already had a run.

    A workdir's run is resumed when its model has the same parameters (paths,
    shapes and dtypes) as this run's: changes that keep them, such as a dropout
    rate, resume; any other change is refused.

    Args:
      workdir: directory path (created if missing).
      run_config: JSON-friendly full config (`run_config.to_saved_dict`).
      param_shapes: this run's {parameter path: (shape, dtype name)}
        (`training.state.param_shapes`).
      saved_param_shapes: computes those of a saved run config
        (`training.loop.saved_param_shapes`).
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
        with open(marker, encoding="utf-8") as f:
            try:
                previous = json.load(f)
            except json.JSONDecodeError as e:
                raise WorkdirError(
                    f"{marker} is not valid JSON ({e}); restore it or use another --workdir"
                ) from e
        try:
            old = saved_param_shapes(previous)
        except (KeyError, TypeError, ValueError) as e:
            raise WorkdirError(
                f"workdir {workdir!r} holds a run config whose model cannot be built here "
                f"({type(e).__name__}: {e}); pass a new --workdir"
            ) from e
        diffs = shape_differences(old, param_shapes)
        if diffs:
            more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
            before, now = previous.get("model", {}), run_config.get("model", {})
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
        files.atomic_write(marker, json.dumps(run_config, indent=2, sort_keys=True).encode())
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


def load_run_config(workdir: str) -> dict[str, Any]:
    """Reads the run config saved in a workdir (for decoding and inspection)."""
    marker = os.path.join(workdir, RUN_CONFIG)
    if not os.path.exists(marker):
        raise WorkdirError(
            f"{workdir!r} has no {RUN_CONFIG}: it is not a training workdir; "
            "pass the --workdir that train.py wrote"
        )
    with open(marker, encoding="utf-8") as f:
        return json.load(f)


def tree_checksums(tree) -> dict[str, str]:
    """SHA-256 of every leaf's bytes, keyed by its tree path (host copy of each leaf).

    Orbax checks structure, not content: these catch silent corruption. Leaves
    split across processes (no process holds them whole) are skipped: hashing
    them would need an all-gather of the full array onto every host.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not (
            leaf.is_fully_addressable or leaf.is_fully_replicated
        ):
            continue
        arr = np.asarray(jax.device_get(leaf))
        digest = hashlib.sha256(arr.tobytes())
        digest.update(str((arr.dtype, arr.shape)).encode())
        out[jax.tree_util.keystr(path)] = digest.hexdigest()
    return out


class Checkpointer:
    """Saves and restores the train state with orbax, every N steps, keeping the last K."""

    def __init__(self, workdir: str, *, keep: int, save_every: int):
        self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
        self.save_every = save_every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Saves `state` at `step` if due (or forced). Returns whether it saved."""
        if not force and (self.save_every <= 0 or step % self.save_every):
            return False
        if step in self._manager.all_steps():
            return False
        meta = dict(meta, step=int(step), checksums=tree_checksums(state))
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(self, abstract_state, step: int | None = None, *, verify: bool = True):
        """Restores (state, meta) at `step` (default: latest) into `abstract_state`'s shardings.

        Raises:
          FileNotFoundError: no checkpoint to restore.
          CheckpointIntegrityError: stored checksums disagree with the bytes read.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        state, meta = restored["state"], restored["meta"]
        if verify and "checksums" in meta:
            now = tree_checksums(state)
            bad = [k for k, v in meta["checksums"].items() if now.get(k, v) != v]
            if bad:
                raise CheckpointIntegrityError(
                    f"checkpoint {step} in {self.directory} is corrupted: {len(bad)} array(s) "
                    f"differ from their saved checksums (first: {bad[0]}); restore an earlier "
                    "step or delete this one"
                )
        return state, meta

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON item saved with the checkpoint at `step` (default: latest), not the state."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
