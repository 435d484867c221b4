"""A hang watchdog: a training step or save that runs far longer than usual ends the process.

A step stuck in a collective whose peer is gone, or a checkpoint save on a dead
filesystem, never returns and never raises, so the process would wait forever
(and hold its accelerators). The watchdog times each activity against the
recent durations of its kind and, past the limit, logs what was running and
every thread's stack, then exits with `EXIT_HANG`:

    with Watchdog(factor=10, min_seconds=600) as watchdog:
        for step in ...:
            with watchdog.watch("step", f"step {step}"):
                state = train_step(state, batch)
                jax.block_until_ready(state)  # the dispatch alone returns at once

An activity's limit is `max(min_seconds, factor * median of the last `window`
durations of its kind)`. The first activity of a kind (a step that compiles,
the first evaluation) has no limit, so `min_seconds` must cover what the median
does not: a later recompilation (new batch shapes), a slow save.
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

# The exit status of a process ended by the watchdog (absl uses 1 for errors, 2 for usage).
EXIT_HANG = 3


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _seconds(x: float) -> str:
    """A duration for a message: three significant digits, whole seconds from 100 s."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def thread_stacks() -> str:
    """Every other Python thread's stack, most recent call last, under its thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the caller's own stack shows only how it got here
        stack = "".join(traceback.format_stack(frame))
        blocks.append(f"Thread {names.get(ident, '?')} ({ident}):\n{stack}")
    return "\n".join(blocks)


class Watchdog:
    """Times activities (steps, saves, evaluations) on a daemon thread; reports one that hangs.

    One activity runs at a time. A disabled watchdog (`factor <= 0`) starts no
    thread and its methods do nothing, so callers need no special case.
    """

    def __init__(
        self,
        *,
        factor: float,
        min_seconds: float,
        window: int = 20,
        log: Callable[[str], None] = _stderr,
        on_hang: Callable[[str], None] | None = None,
        poll_seconds: float | None = None,
    ):
        """
        Args:
          factor: an activity may take this many times the median duration of
            its kind; <= 0 disables the watchdog.
          min_seconds: the limit is never below this.
          window: how many recent durations of a kind the median is taken over.
          log: where the default `on_hang` writes the error line and the stacks.
          on_hang: called (on the watchdog's thread) with the error line when
            an activity passes its limit, at most once per activity. The
            default logs the line and every thread's stack, then ends the
            process with `os._exit(EXIT_HANG)`: a thread stuck in native code
            (a collective, a read) cannot be interrupted from Python.
          poll_seconds: how often the thread checks (default: min(1 s,
            min_seconds / 10)); a hang is reported up to this late.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.factor = factor
        self.min_seconds = min_seconds
        self.window = window
        self._log = log
        self._on_hang = on_hang or self._exit_with_stacks
        self.poll_seconds = poll_seconds or max(0.01, min(1.0, min_seconds / 10))
        self._history: dict[str, collections.deque[float]] = {}
        # (kind, what, start time, limit or None) of the activity in progress.
        self._current: tuple[str, str, float, float | None] | None = None
        # Held while the thread decides to report and while `done` ends an activity,
        # so that an activity finishing at its deadline is either reported or done.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def limit(self, kind: str) -> float | None:
        """Seconds the next activity of `kind` may run; None: no limit (no history yet)."""
        with self._lock:
            return self._limit(kind)

    def _limit(self, kind: str) -> float | None:  # with the lock held
        history = self._history.get(kind)
        if not self.enabled or not history:
            return None
        return max(self.min_seconds, self.factor * statistics.median(history))

    def start(self, kind: str, what: str) -> None:
        """Starts timing an activity: `kind` groups durations ("step"), `what` names this one."""
        if not self.enabled:
            return
        with self._lock:
            if self._current is not None:
                raise RuntimeError(
                    f"watchdog: {what!r} started while {self._current[1]!r} is still running"
                )
            self._current = (kind, what, time.monotonic(), self._limit(kind))

    def done(self) -> None:
        """Ends the activity in progress; its duration joins the history of its kind."""
        self._end(record=True)

    def _end(self, *, record: bool) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._current is None:
                return
            kind, _, started, _ = self._current
            self._current = None
            if record:
                history = self._history.setdefault(kind, collections.deque(maxlen=self.window))
                history.append(time.monotonic() - started)

    @contextlib.contextmanager
    def watch(self, kind: str, what: str) -> Iterator[None]:
        """`start(kind, what)` ... `done()` around a block; a block that raises adds no duration."""
        self.start(kind, what)
        try:
            yield
        except BaseException:
            self._end(record=False)  # a failed attempt's duration says nothing about the next
            raise
        self.done()

    def close(self) -> None:
        """Stops the thread (an activity still in progress is no longer watched)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _overdue(self) -> str | None:
        """The error line for the activity in progress if it is past its limit (once)."""
        with self._lock:
            if self._current is None:
                return None
            kind, what, started, limit = self._current
            elapsed = time.monotonic() - started
            if limit is None or elapsed <= limit:
                return None
            self._current = (kind, what, started, None)  # reported once
            median = statistics.median(self._history[kind])
        return (
            f"error: {what} has run for {_seconds(elapsed)} s, more than {self.factor:g}x the "
            f"median {kind} time of {_seconds(median)} s (limit {_seconds(limit)} s); "
            "thread stacks follow"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            message = self._overdue()
            if message is not None:
                self._on_hang(message)  # outside the lock: it may call back into the watchdog

    def _exit_with_stacks(self, message: str) -> None:
        try:
            self._log(message)
            self._log(thread_stacks())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_HANG)
