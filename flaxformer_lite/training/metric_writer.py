"""Metrics to disk: one JSON object per line and TensorBoard event files.

Only process 0 writes; other processes get a writer that does nothing. A record
is appended with one write and rolled back if the write fails (a full disk), so
the file never holds a torn line, and the failure is one `WorkdirError`.

A metric is a number, or a list of counts per integer bin 0, 1, 2, ... (a
histogram, such as the exposure report's first-error positions): the list
goes to metrics.jsonl as it is and to TensorBoard as a histogram. Readers that
want scalars skip list values.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
import numpy as np

from flaxformer_lite.training.workdir import WorkdirError


class MetricWriter:
    """Appends {"step", "split", "time", metrics...} to `metrics.jsonl` and logs scalars."""

    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self._enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        if not self._enabled:
            return
        self._path = os.path.join(workdir, "metrics.jsonl")
        self._jsonl = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, split: str, metrics: dict[str, Any]) -> None:
        if not self._enabled:
            return
        record = {"step": int(step), "split": split, "time": round(time.time(), 3)}
        for k, v in metrics.items():
            if isinstance(v, (list, tuple)):
                record[k] = [int(c) for c in v]
                self._histogram(f"{split}/{k}", record[k], int(step))
                continue
            v = float(v)
            record[k] = v if math.isfinite(v) else str(v)
            if self._tb is not None:
                self._tb.add_scalar(f"{split}/{k}", v, int(step))
        self._append((json.dumps(record) + "\n").encode("utf-8"))

    def _histogram(self, tag: str, counts: list[int], step: int) -> None:
        """Counts per bin 0..n-1 as a TensorBoard histogram with one bucket per bin."""
        if self._tb is None or not sum(counts):  # TensorBoard has no empty histogram
            return
        values = np.repeat(np.arange(len(counts)), counts)  # one sample per counted item
        self._tb.add_histogram(tag, values, step, bins=np.arange(len(counts) + 1))

    def _append(self, data: bytes) -> None:
        start = os.lseek(self._jsonl, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._jsonl, view) :]
        except OSError as e:
            os.ftruncate(self._jsonl, start)  # no torn line
            raise WorkdirError(
                f"could not append to {self._path} ({e.strerror}); the checkpoints are not "
                "affected: free disk space there, then rerun the same command to resume"
            ) from e

    def close(self) -> None:
        if self._jsonl is not None:
            os.close(self._jsonl)
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
