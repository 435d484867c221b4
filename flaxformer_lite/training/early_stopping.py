"""The best validation score so far, and early stopping when it stops improving.

The state is a small JSON dict saved in every checkpoint's meta item, so a
resumed run goes on counting where the interrupted one was.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class EarlyStopping:
    """Tracks `metric` over validation evaluations.

    Attributes:
      metric: the validation metric's name ("loss", "exact_match", "bleu", ...).
      mode: "min" (lower is better) or "max".
      patience: evaluations without a new best that end training (0: never).
      best, best_step: the best value so far and the step it was measured at.
      bad_evals: evaluations since the last new best.
    """

    metric: str
    mode: str
    patience: int = 0
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Records one evaluation; returns whether it is a new best."""
        value = float(metrics[self.metric])
        lower = self.mode == "min"
        better = self.best is None or (value < self.best if lower else value > self.best)
        if better:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        return better

    @property
    def exhausted(self) -> bool:
        """Whether training should stop: `patience` evaluations without a new best."""
        return self.patience > 0 and self.bad_evals >= self.patience

    def message(self, step: int) -> str:
        return (
            f"early stop at step {step}: validation {self.metric} has not improved for "
            f"{self.bad_evals} evaluations (train.early_stop_patience={self.patience}); the "
            f"best, {self.best:.4f}, was at step {self.best_step} (decode it with --step best)"
        )

    def state(self) -> dict[str, Any]:
        """JSON-friendly state for a checkpoint's meta item."""
        return {
            "metric": self.metric,
            "best": self.best,
            "best_step": self.best_step,
            "bad_evals": self.bad_evals,
        }

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Continues from `state()` of a checkpoint (None: a fresh run). A different
        metric than the one saved starts afresh."""
        if not saved or saved.get("metric", self.metric) != self.metric:
            return
        self.best, self.best_step = saved.get("best"), saved.get("best_step")
        self.bad_evals = int(saved.get("bad_evals", 0))
