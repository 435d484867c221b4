"""Writing one checkpoint step and checking it on disk, and the thread that saves in the background.

A save is trusted only once read back: orbax writes the step, the written state
is read from disk and compared with the checksums taken before the write, and
whatever a failed save left (the step, orbax's temporary directories) is
removed. `BackgroundSaver` runs such saves on one thread, one at a time, so
that the training step only pays for copying the state to host memory.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from flaxformer_lite.training.checkpoint_checks import (
    all_processes,
    digest,
    held_stderr,
    quiet_loggers,
    read_on_host,
)
from flaxformer_lite.training.checkpoint_format import (
    META_ITEM,
    STATE_ITEM,
    is_out_of_memory,
    list_steps,
    short_reason,
)


def write_step(manager: ocp.CheckpointManager, step: int, state, meta: dict[str, Any]) -> None:
    """Writes the two items of `step` (`state`, a pytree, and the JSON `meta`) with `manager`.

    Orbax's worker threads log every failed write with its traceback (and
    tensorstore's callbacks print theirs to sys.stderr) before the error reaches
    here; the checkpointer's save turns it into one line, so they are kept quiet. What a
    successful write prints is passed on.
    """
    with quiet_loggers("absl", "asyncio", "concurrent.futures"), held_stderr():
        manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardSave(state),
                    META_ITEM: ocp.args.JsonSave(meta),
                }
            ),
            force=True,
        )
        manager.wait_until_finished()


def settle(manager: ocp.CheckpointManager) -> None:
    """Waits for whatever a failed `write_step` left running (orbax's writer threads of
    the other items and arrays), so that removing the step's leftovers is final: a thread
    still writing would recreate the temporary directory after it was removed. Their
    errors are the one already raised, and are not raised again."""
    try:
        with quiet_loggers("absl", "asyncio", "concurrent.futures"), held_stderr():
            manager.wait_until_finished()
    except Exception:  # noqa: BLE001 - the save's own error was raised already
        pass


def read_back_problem(directory: str, step: int, state, checksums: dict[str, str]) -> str | None:
    """None if `step`'s state reads back from disk with `checksums` on every process.

    Else what is wrong, in a few words. `state` is the pytree saved; `checksums`
    is {keystr of a leaf: its SHA-256}.
    """
    path = epath.Path(directory) / str(step) / STATE_ITEM
    problem = None
    try:
        back = read_on_host(path, state)
    except Exception as e:
        if is_out_of_memory(e):
            raise
        problem = f"does not read back ({short_reason(e)})"
    else:
        now = {
            jax.tree_util.keystr(p): digest(np.asarray(x))
            for p, x in jax.tree_util.tree_flatten_with_path(back)[0]
            if x is not ocp.PLACEHOLDER
        }
        bad = [k for k, v in checksums.items() if now.get(k) != v]
        if bad:
            problem = f"{len(bad)} array(s) read back differ from the state saved (first: {bad[0]})"
    if not all_processes(problem is None) and problem is None:
        problem = "another process could not read it back"
    return problem


def remove_failed(workdir: str, directory: str, step: int, *, keep_finalized: bool = False) -> None:
    """Removes what a failed save of `step` left: the step and orbax's temporary dirs
    (with `keep_finalized`, a finalized step directory stays)."""
    keep = keep_finalized and step in list_steps(workdir)
    if jax.process_index() == 0 and os.path.isdir(directory):
        for name in os.listdir(directory):
            if (name == str(step) and not keep) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def write_fix(cause: BaseException) -> str:
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


class BackgroundSaver:
    """One background thread that runs saves, one in flight at most.

    Its failure is raised by the next `submit`, `check` or `wait`, as the
    save would have raised it.
    """

    def __init__(self):
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending: concurrent.futures.Future | None = None  # the save in flight

    def submit(self, save: Callable[..., None], *args) -> None:
        """Starts `save(*args)` on the thread once the save in flight (if any) is done."""
        self.wait()
        self._pending = self._worker.submit(save, *args)

    def check(self) -> None:
        """Raises the failure of the save in flight if it has failed; never blocks."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Waits for the save in flight; raises its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
