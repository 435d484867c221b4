"""Stopping on SIGTERM / SIGINT at a step boundary, with a checkpoint, instead of dying.

A preemptible machine gets SIGTERM (and a grace period) before it is taken
away; Ctrl-C sends SIGINT. `StopSignals` turns the first of either into a
request that the training loop reads between steps: it finishes the step in
flight, saves a checkpoint and exits normally. A second signal means "now":
the process exits at once. Checkpoints are written into a temporary directory
and renamed when complete, so an exit in the middle of a save leaves nothing
that a resume would pick.

The loop polls between steps and between evaluation batches (`poll`), so a
stop is honoured within a step or a batch wherever the run is: a cloud
preemption notice leaves ~30 s. In a multi-process job the processes must stop
at the same point (the save is collective), but a signal may reach only some
of them, or them at different steps: they agree with a collective, which
`poll` runs only at every `check_every`-th call (each process polls at the same
points, so their counts agree), and `requested()` at every call.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager: SIGTERM/SIGINT set a stop request; a second one exits at once.

    Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    def __init__(self, log=lambda s: print(s, file=sys.stderr), check_every: int = 1):
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self._log = log
        self._received: str | None = None
        self._previous: dict[int, object] = {}
        self.check_every = check_every
        self._polls = 0

    @property
    def received(self) -> str | None:
        """The name of the first signal received on this process ("SIGTERM"), or None."""
        return self._received

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._received is not None:
            # The user insists: no checkpoint. os._exit skips cleanup that could block.
            print(f"second {name}: exiting at once, without a checkpoint", file=sys.stderr)
            sys.stderr.flush()
            os._exit(128 + signum)
        self._received = name
        self._log(f"{name} received: finishing the current step, then saving a checkpoint")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def requested(self) -> bool:
        """Whether any process received a stop signal (a collective when there are several)."""
        if jax.process_count() == 1:
            return self._received is not None
        flags = multihost_utils.process_allgather(np.int32(self._received is not None))
        return bool(np.asarray(flags).any())

    def poll(self) -> bool:
        """`requested()` where it is cheap: always with one process; with several, at
        every `check_every`-th call (False between), all processes calling at the same points.
        """
        if jax.process_count() == 1:
            return self._received is not None
        self._polls += 1
        return self._polls % self.check_every == 0 and self.requested()


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint; rerunning resumes it."""

    def __init__(self, step: int, saved: bool):
        self.step = step
        if saved:
            message = (
                f"preempted at step {step}; checkpoint saved; rerun the same command to resume"
            )
        else:
            message = (
                f"preempted at step {step}, before any step of this run; nothing new to save; "
                "rerun the same command to resume"
            )
        super().__init__(message)
