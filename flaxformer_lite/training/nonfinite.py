"""What the loop does when a step's loss or gradient norm is not finite.

The train step itself never applies a non-finite update (`step.train_step`
returns the old parameters and a "nonfinite" flag), so the state in memory,
and every checkpoint of it, stays finite. `NonFiniteGuard` reads the flags,
one step behind the step just dispatched so that the host never waits for the
device in between, and decides:

  train.nonfinite = "stop": the first non-finite step ends training
    (`NonFiniteError`), with no checkpoint after it.
  train.nonfinite = "skip": the update is skipped and counted; more than
    `train.nonfinite_max_skips` in a row ends training the same way.
"""

from __future__ import annotations

from collections import deque

import jax

from flaxformer_lite.training.step import NONFINITE_WHAT


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient; the message names the step."""


class NonFiniteGuard:
    """Tracks the "nonfinite" flags of the steps in flight.

    Args:
      mode: "stop" or "skip".
      max_skips: with "skip", the number of non-finite steps in a row that ends training.
      log: where a skipped step is reported.
    """

    def __init__(self, mode: str, max_skips: int, log):
        if mode not in ("stop", "skip"):
            raise ValueError(f"mode must be 'stop' or 'skip', got {mode!r}")
        self.mode, self.max_skips, self._log = mode, max_skips, log
        self._pending: deque = deque()  # (step number after the update, flags on device)
        self.skipped = 0  # non-finite steps skipped in this run
        self._in_a_row = 0
        self.last_finite: int | None = None  # step count of the last finite update checked

    def add(self, done: int, sums: dict[str, jax.Array]) -> None:
        """Registers the step that produced `sums` (`done` = the step count after it)."""
        self._pending.append((done, sums["nonfinite"]))

    def check(self, keep: int = 1) -> None:
        """Reads the flags of all but the newest `keep` pending steps (0: all; waits for them).

        Raises:
          NonFiniteError: training must stop.
        """
        while len(self._pending) > keep:
            done, flag = self._pending.popleft()
            if not float(flag):
                self._in_a_row = 0
                self.last_finite = done
                continue
            what = NONFINITE_WHAT.get(int(float(flag)), "loss")
            if self.mode == "stop":
                raise NonFiniteError(
                    f"the {what} was not finite at step {done}; training stopped there "
                    "(train.nonfinite=stop) and no checkpoint was written after it: lower "
                    "optim.learning_rate, set optim.grad_clip_norm, or set "
                    "train.nonfinite=skip to skip such steps"
                )
            self.skipped += 1
            self._in_a_row += 1
            self._log(
                f"step {done}: the {what} was not finite; update skipped "
                f"({self._in_a_row} in a row, {self.skipped} in this run)"
            )
            if self._in_a_row >= self.max_skips:
                raise NonFiniteError(
                    f"{self._in_a_row} steps in a row were not finite (the last one's {what}, "
                    f"at step {done}; train.nonfinite_max_skips={self.max_skips}); training "
                    "stopped, "
                    "and no checkpoint was written after the last finite step: lower "
                    "optim.learning_rate or set optim.grad_clip_norm"
                )
