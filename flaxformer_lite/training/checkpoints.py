"""The checkpointer: saves, verifies, keeps and restores the train state with orbax.

A save is trusted only once read back: one host pass over the state computes
the checksums and refuses non-finite values, orbax writes the step, the
written state is read from disk and compared with the checksums, and only
then are older steps deleted (retention is done here, not by orbax's
`max_to_keep`, which deletes old steps once a new one is written, before
anything has checked it). A failed save raises `CheckpointWriteError`, leaves
no partial step directory, and keeps every earlier checkpoint. A resume
(`Checkpointer.restore_latest_good`) tries steps newest first and moves the
unusable ones aside. What a step holds on disk is `checkpoint_format.py`'s;
writing and reading back is `checkpoint_writer.py`'s, restoring and setting
aside `checkpoint_recovery.py`'s.

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

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from flaxformer_lite import atomic_files
from flaxformer_lite.training import checkpoint_recovery, checkpoint_writer
from flaxformer_lite.training.checkpoint_checks import barrier, host_pass
from flaxformer_lite.training.checkpoint_format import (
    CORRUPT_SUFFIX,
    FORMAT_VERSION,
    META_ITEM,
    STATE_ITEM,
    CheckpointIntegrityError,
    CheckpointWriteError,
    best_steps,
    check_format,
    read_meta,
    short_reason,
)
from flaxformer_lite.training.workdir import CHECKPOINT_DIR

Log = Callable[[str], None]


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
        self._saver = checkpoint_writer.BackgroundSaver() if self.asynchronous else None
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
        self._saver.submit(self._save, step, host_state, meta, metrics)
        return True

    def check(self) -> None:
        """Raises the failure of the save in flight if it has failed; never blocks."""
        if self._saver is not None:
            self._saver.check()

    def _save(self, step: int, state, meta: dict[str, Any], metrics) -> None:
        """Checks, writes, reads back and applies retention (see `save`)."""
        checksums, nonfinite = host_pass(state)
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
            checkpoint_writer.write_step(self._manager, step, state, meta)
        except Exception as e:
            # A step that orbax finalized before the failure (e.g. a peer died in the
            # barrier after the commit) is complete: it stays, and its checksums are
            # verified when it is restored. Only unfinished leftovers are removed, once
            # orbax's writer threads of this save have all stopped.
            checkpoint_writer.settle(self._manager)
            self._remove_failed(step, keep_finalized=True)
            raise CheckpointWriteError(
                f"could not save checkpoint {step} in {self.directory} ({short_reason(e)}); "
                f"{self._kept()}; {checkpoint_writer.write_fix(e)}"
            ) from e
        if self.after_write is not None:
            self.after_write(step)
        problem = checkpoint_writer.read_back_problem(self.directory, step, state, checksums)
        if problem is not None:
            barrier(f"unverified step {step}")
            self._remove_failed(step)
            barrier(f"removed step {step}")
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
        barrier(f"metrics of step {step}")
        self._metrics[step] = meta["metrics"]
        self._apply_retention()

    def _kept(self) -> str:
        steps = self._all_steps()
        if not steps:
            return "there is no earlier checkpoint"
        return f"the previous checkpoint (step {steps[-1]}) is kept"

    def _remove_failed(self, step: int, *, keep_finalized: bool = False) -> None:
        """Removes what a failed save of `step` left: the step and orbax's temporary dirs
        (with `keep_finalized`, a finalized step directory stays)."""
        checkpoint_writer.remove_failed(
            self.workdir, self.directory, step, keep_finalized=keep_finalized
        )
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
        state = checkpoint_recovery.restore_state(
            self._manager, self.directory, abstract_state, step, meta, verify
        )
        return state, meta

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
        (state, meta, step), bad = checkpoint_recovery.first_usable(
            self._manager, self.workdir, self.directory, steps, abstract_state
        )
        if bad:
            checkpoint_recovery.set_aside(
                self.directory, self.corrupt_directory, bad, step, self._log
            )
            for unusable, _ in bad:
                self._metrics.pop(unusable, None)
            self._manager.reload()
        return state, meta, step

    def wait(self) -> None:
        """Waits for the save in flight; raises its `CheckpointWriteError` if it failed."""
        if self._saver is not None:
            self._saver.wait()
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
            if self._saver is not None:
                self._saver.shutdown()
            self._manager.close()
