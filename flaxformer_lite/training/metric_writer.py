"""Metrics to disk: one JSON object per line and TensorBoard event files.

Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax


class MetricWriter:
    """Appends {"step", "split", "time", metrics...} to `metrics.jsonl` and logs scalars."""

    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self._enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        if not self._enabled:
            return
        path = os.path.join(workdir, "metrics.jsonl")
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, split: str, metrics: dict[str, Any]) -> None:
        if not self._enabled:
            return
        record = {"step": int(step), "split": split, "time": round(time.time(), 3)}
        for k, v in metrics.items():
            v = float(v)
            record[k] = v if math.isfinite(v) else str(v)
            if self._tb is not None:
                self._tb.add_scalar(f"{split}/{k}", v, int(step))
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
