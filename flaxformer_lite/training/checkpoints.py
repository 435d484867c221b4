"""Orbax checkpoints of the train state, and what keeps them usable.

A workdir's `checkpoints/<step>/` holds two orbax items: "state" (the train
state) and "meta" (JSON: step, format version, model config, per-leaf SHA-256
checksums, validation metrics when given). Steps found unusable on resume are
moved to `checkpoints-corrupt/<step>/`, out of orbax's sight, never deleted.
(`workdir.py` describes the rest of a workdir.)

A save is trusted only once read back: one host pass over the state computes
the checksums and refuses non-finite values, orbax writes the step, the
written state is read from disk and compared with the checksums, and only
then are older steps deleted (retention is done here, not by orbax's
`max_to_keep`, which deletes old steps once a new one is written, before
anything has checked it). A failed save raises `CheckpointWriteError`, leaves
no partial step directory, and keeps every earlier checkpoint. A resume
(`Checkpointer.restore_latest_good`) tries steps newest first and moves the
unusable ones aside.

With `asynchronous=True` (one process) the step path only copies the state to
host memory; the checksums, the write, the read-back and the retention run
on a background thread while the device trains on. One save is in flight at
most: the next save, any read of the checkpoints, `wait` and `close` wait for
it, and `check` (called between steps) raises its `CheckpointWriteError` once
it failed. A process killed meanwhile leaves either orbax's unfinished
temporary directory (never picked) or a complete step whose checksums are
verified when it is restored, as after a kill during a synchronous save.
With several processes saves stay synchronous: their checks agree through
collectives, which must not run beside the training step's.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from flaxformer_lite import atomic_files
from flaxformer_lite.models import layer_layout
from flaxformer_lite.training.checkpoint_checks import (
    all_processes as _all_processes,
)
from flaxformer_lite.training.checkpoint_checks import (
    barrier as _barrier,
)
from flaxformer_lite.training.checkpoint_checks import (
    digest as _digest,
)
from flaxformer_lite.training.checkpoint_checks import (
    held_stderr as _held_stderr,
)
from flaxformer_lite.training.checkpoint_checks import (
    host_pass as _host_pass,
)
from flaxformer_lite.training.checkpoint_checks import (
    layout as _layout,
)
from flaxformer_lite.training.checkpoint_checks import (
    quiet_loggers as _quiet_loggers,
)
from flaxformer_lite.training.checkpoint_checks import (
    read_on_host as _read_on_host,
)
from flaxformer_lite.training.checkpoint_checks import (
    tree_checksums,
)
from flaxformer_lite.training.workdir import CHECKPOINT_DIR, WorkdirError

CORRUPT_SUFFIX = "-corrupt"  # checkpoints/ -> checkpoints-corrupt/ for steps set aside
STATE_ITEM, META_ITEM = "state", "meta"  # the orbax items of a step
# Version of what a step holds (items, meta fields, tree layout). Bump it when a
# change would make older code misread a new checkpoint; older checkpoints stay readable.
FORMAT_VERSION = 1

Log = Callable[[str], None]


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
        raise _unusable(step, directory, reason) from e
    if not isinstance(meta, dict):
        reason = f"meta is a JSON {type(meta).__name__}, not an object"
        raise _unusable(step, directory, reason)
    return meta


def check_format(meta: Mapping[str, Any], step: int, directory: str) -> None:
    """Refuses a checkpoint written in a newer format; one without a version is an old one.

    Raises:
      CheckpointFormatError: its format version is above `FORMAT_VERSION`.
      CheckpointIntegrityError: its format version is not an integer.
    """
    version = meta.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise _unusable(step, directory, f"format_version {version!r} is not an integer")
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


def _unusable(step: int, directory: str, reason: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"checkpoint {step} in {directory} is corrupted: {reason}; restore an earlier step "
        "or delete this one",
        reason,
    )


def is_out_of_memory(e: BaseException) -> bool:
    """Whether a read failed for lack of memory, which says nothing about the checkpoint."""
    return isinstance(e, MemoryError) or "out of memory" in str(e).lower()


def _write_fix(cause: BaseException) -> str:
    """What to do about a failed write, from its cause."""
    chain = _chain(cause)
    text = " ".join(str(c) for c in chain)
    codes = {getattr(c, "errno", None) for c in chain}
    if errno.ENOSPC in codes or "RESOURCE_EXHAUSTED" in text or "No space" in text:
        return "free disk space there (or lower train.keep_checkpoints), then rerun to resume"
    if codes & {errno.EACCES, errno.EPERM, errno.EROFS}:
        return "make the directory writable, then rerun to resume"
    return "check the filesystem, then rerun to resume"


def _chain(e: BaseException) -> list[BaseException]:
    out = []
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


class Checkpointer:
    """Saves and restores the train state with orbax; keeps the last K and the best K.

    Args:
      workdir: the training workdir; checkpoints go to `workdir/checkpoints`.
      keep: the most recent checkpoints kept (>= 1).
      save_every: `save` saves steps that are multiples of this (0: only forced saves).
      keep_best: also keep this many best checkpoints by `best_metric` among the
        steps saved with metrics (0: none kept for being best).
      best_metric: the key of the `metrics` given to `save` that ranks checkpoints.
      best_mode: "min" (lower is better, as for a loss) or "max" (as for BLEU).
      log: one line per event worth a user's attention (default: stderr).
      asynchronous: verify and write saves on a background thread (see the module
        docstring); ignored with several processes.
      after_write: called with a step's number once its files are written and before
        they are read back and verified (on the thread that saves). A hook for fault
        injection: the tests change bytes on disk here, or hold a save in flight.
    """

    def __init__(
        self,
        workdir: str,
        *,
        keep: int,
        save_every: int,
        keep_best: int = 0,
        best_metric: str = "loss",
        best_mode: str = "min",
        log: Log | None = None,
        asynchronous: bool = False,
        after_write: Callable[[int], None] | None = None,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the checkpoint just saved), got {keep}")
        if keep_best < 0:
            raise ValueError(f"keep_best must be >= 0, got {keep_best}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        self.workdir = workdir
        self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
        self.corrupt_directory = self.directory + CORRUPT_SUFFIX
        self.keep, self.save_every, self.keep_best = keep, save_every, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self._log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.after_write = after_write
        self._metrics: dict[int, dict[str, float] | None] = {}  # read metas, by step
        self.asynchronous = asynchronous and jax.process_count() == 1
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            if self.asynchronous
            else None
        )
        self._pending: concurrent.futures.Future | None = None  # the save in flight
        self._manager = ocp.CheckpointManager(
            self.directory,
            # No max_to_keep: orbax would delete old steps once a new one is written, before
            # anything has checked it. Synchronous, so a save is verified before it returns.
            options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
            item_names=(STATE_ITEM, META_ITEM),
        )

    def latest_step(self) -> int | None:
        self.wait()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The saved steps, ascending, once the save in flight (if any) is verified."""
        self.wait()
        return self._all_steps()

    def _all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    # Saving.

    def save(
        self,
        step: int,
        state,
        meta: dict[str, Any],
        *,
        force: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Saves `state` at `step` if due (a multiple of `save_every`) or forced.

        The state is refused if any floating-point leaf is not finite; once
        written it is read back from disk and compared with its checksums; then
        steps beyond the last `keep` and the best `keep_best` are deleted.

        Args:
          meta: JSON-friendly fields saved with it (step, format_version,
            checksums and metrics are added).
          metrics: e.g. validation metrics {name: float}, saved as meta["metrics"]
            and used to rank the best checkpoints.
        Asynchronous, it returns once the state is copied to host memory; the
        rest runs on the background thread, and its failure is raised by the
        next `check`, `wait`, `save` or read of the checkpoints.

        Returns:
          Whether it saved, or started to (False: not due, or `step` is already saved).
        Raises:
          CheckpointWriteError: nothing was saved (non-finite state, write
            error such as a full disk, or a read-back mismatch); no partial step
            is left and the earlier checkpoints are all kept. Asynchronous: the
            previous save failed so.
        """
        if not force and (self.save_every <= 0 or step % self.save_every):
            return False
        if step in self.all_steps():  # waits for the save in flight
            return False
        if not self.asynchronous:
            self._save(step, state, meta, metrics)
            return True
        # The one copy the step path pays for: the device may overwrite (donate) its
        # buffers at the next step. jax.device_get starts every leaf's transfer at once.
        host_state = jax.device_get(state)
        self._pending = self._worker.submit(self._save, step, host_state, meta, metrics)
        return True

    def check(self) -> None:
        """Raises the failure of the save in flight if it has failed; never blocks."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def _save(self, step: int, state, meta: dict[str, Any], metrics) -> None:
        """Checks, writes, reads back and applies retention (see `save`)."""
        checksums, nonfinite = _host_pass(state)
        if nonfinite is not None:
            raise CheckpointWriteError(
                f"state at step {step} has non-finite values (first: {nonfinite}); not saved; "
                f"{self._kept()}; lower optim.learning_rate or set optim.grad_clip_norm, and "
                "rerun to resume from it"
            )
        meta = dict(meta, step=int(step), format_version=FORMAT_VERSION, checksums=checksums)
        if metrics is not None:
            meta["metrics"] = {k: float(v) for k, v in metrics.items()}
            meta["best_metric"], meta["best_mode"] = self.best_metric, self.best_mode
        try:
            self._write(step, state, meta)
        except Exception as e:
            # A step that orbax finalized before the failure (e.g. a peer died in the
            # barrier after the commit) is complete: it stays, and its checksums are
            # verified when it is restored. Only unfinished leftovers are removed.
            self._remove_failed(step, keep_finalized=True)
            raise CheckpointWriteError(
                f"could not save checkpoint {step} in {self.directory} ({short_reason(e)}); "
                f"{self._kept()}; {_write_fix(e)}"
            ) from e
        if self.after_write is not None:
            self.after_write(step)
        problem = self._read_back_problem(step, state, checksums)
        if problem is not None:
            _barrier(f"unverified step {step}")
            self._remove_failed(step)
            _barrier(f"removed step {step}")
            raise CheckpointWriteError(
                f"checkpoint {step} in {self.directory} was written but {problem}; deleted it; "
                f"{self._kept()}; check the disk and the filesystem, then rerun to resume"
            )
        self._metrics[step] = meta.get("metrics")
        self._apply_retention()

    def record_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Adds validation metrics to the saved step `step` (measured after it was saved),
        so that it is ranked among the best; retention then runs again.

        Only the meta item's JSON file changes (written atomically); the state and
        its checksums are untouched. A step that no longer exists is ignored.
        """
        if step not in self.all_steps():  # waits for the save in flight
            return
        meta = self.read_meta(step)
        meta["metrics"] = {k: float(v) for k, v in metrics.items()}
        meta["best_metric"], meta["best_mode"] = self.best_metric, self.best_mode
        if jax.process_index() == 0:
            path = os.path.join(self.directory, str(step), META_ITEM, "metadata")
            atomic_files.atomic_write(path, json.dumps(meta).encode())
        _barrier(f"metrics of step {step}")
        self._metrics[step] = meta["metrics"]
        self._apply_retention()

    def _write(self, step: int, state, meta: dict[str, Any]) -> None:
        """Writes the two items of `step`.

        Orbax's worker threads log every failed write with its traceback (and
        tensorstore's callbacks print theirs to sys.stderr) before the error reaches
        here; `save` turns it into one line, so they are kept quiet. What a
        successful write prints is passed on.
        """
        with _quiet_loggers("absl", "asyncio", "concurrent.futures"), _held_stderr():
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.StandardSave(state),
                        META_ITEM: ocp.args.JsonSave(meta),
                    }
                ),
                force=True,
            )
            self._manager.wait_until_finished()

    def _read_back_problem(self, step: int, state, checksums: dict[str, str]) -> str | None:
        """None if `step`'s state reads back from disk with `checksums` on every process."""
        path = epath.Path(self.directory) / str(step) / STATE_ITEM
        problem = None
        try:
            back = _read_on_host(path, state)
        except Exception as e:
            if is_out_of_memory(e):
                raise
            problem = f"does not read back ({short_reason(e)})"
        else:
            now = {
                jax.tree_util.keystr(p): _digest(np.asarray(x))
                for p, x in jax.tree_util.tree_flatten_with_path(back)[0]
                if x is not ocp.PLACEHOLDER
            }
            bad = [k for k, v in checksums.items() if now.get(k) != v]
            if bad:
                problem = (
                    f"{len(bad)} array(s) read back differ from the state saved (first: {bad[0]})"
                )
        if not _all_processes(problem is None) and problem is None:
            problem = "another process could not read it back"
        return problem

    def _kept(self) -> str:
        steps = self._all_steps()
        if not steps:
            return "there is no earlier checkpoint"
        return f"the previous checkpoint (step {steps[-1]}) is kept"

    def _remove_failed(self, step: int, *, keep_finalized: bool = False) -> None:
        """Removes what a failed save of `step` left: the step and orbax's temporary dirs
        (with `keep_finalized`, a finalized step directory stays)."""
        keep = keep_finalized and step in list_steps(self.workdir)
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if (name == str(step) and not keep) or name.startswith(
                    f"{step}.orbax-checkpoint-tmp"
                ):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self._metrics.pop(step, None)
        self._manager.reload()

    def _apply_retention(self) -> None:
        """Deletes the steps that are neither among the last `keep` nor the best `keep_best`."""
        steps = self._all_steps()
        kept = set(steps[-self.keep :])
        if self.keep_best:
            kept |= set(
                best_steps(self._step_metrics(), self.best_metric, self.best_mode, self.keep_best)
            )
        for step in steps:
            if step not in kept:
                self._manager.delete(step)
                self._metrics.pop(step, None)

    # Reading.

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON item saved with the checkpoint at `step` (default: latest), not the state."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return read_meta(self.workdir, step)

    def step_metrics(self) -> dict[int, dict[str, float]]:
        """{step: the metrics saved with it} for the steps saved with metrics."""
        self.wait()
        return self._step_metrics()

    def _step_metrics(self) -> dict[int, dict[str, float]]:
        out = {}
        for step in self._all_steps():
            if step not in self._metrics:
                try:
                    self._metrics[step] = self.read_meta(step).get("metrics")
                except CheckpointIntegrityError:
                    self._metrics[step] = None  # ranked as a step without metrics
            if self._metrics[step]:
                out[step] = self._metrics[step]
        return out

    def best_step(self) -> int | None:
        """The best step by `best_metric` ("min"/"max" per `best_mode`); None without metrics."""
        best = best_steps(self.step_metrics(), self.best_metric, self.best_mode)
        return best[0] if best else None

    def restore(self, abstract_state, step: int | None = None, *, verify: bool = True):
        """Restores (state, meta) at `step` (default: latest) into `abstract_state`'s shardings.

        Raises:
          FileNotFoundError: no checkpoint to restore.
          CheckpointFormatError: it was written in a newer format.
          CheckpointIntegrityError: stored checksums disagree with the bytes read,
            or the meta item is unreadable.
        """
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        meta = self.read_meta(step)
        check_format(meta, step, self.directory)
        return self._restore_state(abstract_state, step, meta, verify), meta

    def _restore_state(self, abstract_state, step: int, meta: dict[str, Any], verify: bool):
        target, convert = self._saved_layers_layout(step, abstract_state)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target)})
        )
        state = restored[STATE_ITEM]
        if verify and "checksums" in meta:
            now = tree_checksums(state)
            bad = [k for k, v in meta["checksums"].items() if now.get(k, v) != v]
            if bad:
                raise _unusable(
                    step,
                    self.directory,
                    f"{len(bad)} array(s) differ from their saved checksums (first: {bad[0]})",
                )
        return convert(state)

    def _saved_layers_layout(self, step: int, abstract_state):
        """(the restore target in the layout of the layers `step` holds, a function that
        puts a state restored in it back into `abstract_state`'s layout and shardings).

        A run may store its layers stacked or unrolled (`model.scan_layers`,
        `models/layer_layout.py`): a checkpoint of either restores into the other, so
        a resume may flip `scan_layers` and checkpoints written before parameters were
        stored stacked resume with it on.
        """
        path = epath.Path(self.directory) / str(step) / STATE_ITEM
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

    def restore_latest_good(self, abstract_state):
        """Restores the newest usable checkpoint, setting the unusable newer ones aside.

        A step is unusable when its meta is unreadable or its state fails to
        read (missing or truncated files, orbax and tensorstore errors) or to
        verify against its checksums. Each such step newer than the one restored
        is moved to `corrupt_directory` (never deleted) with one log line, so
        later saves of those step numbers start afresh. When no step is usable,
        nothing is moved. Every process reads the same files and they agree
        before anything moves; process 0 alone moves the directories.

        Returns:
          (state, meta, step).
        Raises:
          FileNotFoundError: no checkpoint at all.
          CheckpointFormatError: a checkpoint written in a newer format (not
            skipped: an older library must not silently train past it).
          CheckpointIntegrityError: no step is usable.
        """
        self.wait()
        self._manager.reload()
        steps = self._all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        bad: list[tuple[int, str]] = []
        for step in reversed(steps):
            problem = None
            try:
                meta = self.read_meta(step)
                check_format(meta, step, self.directory)
            except CheckpointIntegrityError as e:
                problem = e.reason
            else:
                try:
                    state = self._restore_state(abstract_state, step, meta, verify=True)
                except CheckpointIntegrityError as e:
                    problem = e.reason
                except Exception as e:
                    if is_out_of_memory(e):
                        raise
                    self._refuse_other_layout(step, abstract_state, e)
                    problem = f"state unreadable: {short_reason(e)}"
            if not _all_processes(problem is None) and problem is None:
                problem = "another process could not read it"
            if problem is None:
                self._set_aside(bad, step)
                return state, meta, step
            bad.append((step, problem))
        listed = ", ".join(str(s) for s, _ in bad)
        reasons = "; ".join(f"{s}: {why}" for s, why in bad[:3])
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        verb = "is" if len(bad) == 1 else "are all"
        raise CheckpointIntegrityError(
            f"no usable checkpoint in {self.directory}: step{'s' * (len(bad) > 1)} {listed} "
            f"{verb} unusable ({reasons}{more}); delete the workdir's checkpoints to start "
            "over or pass a new --workdir",
            f"steps {listed} unusable",
        )

    def _refuse_other_layout(self, step: int, abstract_state, error: Exception) -> None:
        """Raises WorkdirError if `step` failed because it holds another tree than the target.

        That is a changed config (say another optimiser chain), not corruption:
        no step would restore, and none should be set aside.
        """
        path = epath.Path(self.directory) / str(step) / STATE_ITEM
        try:
            saved = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
        except Exception:
            return  # unreadable metadata: the step itself is bad
        there = _layout(saved)
        here = _layout(abstract_state)
        if there == here:
            return
        if len(there) != len(here):
            what = f"{len(there)} arrays there vs {len(here)} here"
        else:
            a, b = next((a, b) for a, b in zip(there, here) if a != b)
            what = f"an array of {a[0]} {a[1]} there vs {b[0]} {b[1]} here"
        raise WorkdirError(
            f"checkpoint {step} in {self.directory} holds another train state than this run "
            f"builds ({what}); resume with the config that wrote it (optimiser settings "
            "included), or pass a new --workdir"
        ) from error

    def _set_aside(self, bad: list[tuple[int, str]], good: int) -> None:
        """Moves the unusable steps out of the orbax directory, logging one line each."""
        if not bad:
            return
        _barrier("before setting checkpoints aside")
        for step, why in bad:
            source = os.path.join(self.directory, str(step))
            dest = os.path.join(self.corrupt_directory, str(step))
            n = 1
            while os.path.lexists(dest):  # the same step number set aside before
                dest, n = os.path.join(self.corrupt_directory, f"{step}.{n}"), n + 1
            if jax.process_index() == 0:
                try:
                    os.makedirs(self.corrupt_directory, exist_ok=True)
                    os.rename(source, dest)
                except OSError as e:
                    raise WorkdirError(
                        f"checkpoint {step} in {self.directory} is unusable ({why}) and could "
                        f"not be moved to {dest} ({e.strerror or e}); move or delete it, then "
                        "rerun"
                    ) from e
            self._metrics.pop(step, None)
            self._log(
                f"checkpoint {step} in {self.directory} is unusable ({why}); moved it to "
                f"{dest} and falling back to step {good}"
            )
        _barrier("after setting checkpoints aside")
        self._manager.reload()

    def wait(self) -> None:
        """Waits for the save in flight; raises its `CheckpointWriteError` if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        self._manager.wait_until_finished()

    def close(self, *, failing: bool = False) -> None:
        """Waits for the save in flight and closes. With `failing` (the run is ending on
        another error, which must not be masked) a failed save is logged, not raised."""
        try:
            self.wait()
        except CheckpointWriteError as e:
            if not failing:
                raise
            self._log(f"error: {e}")
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self._manager.close()
