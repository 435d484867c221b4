"""`train_and_evaluate`: prepare a run, train it, evaluate it, in named stages.

The step functions are pure and jit-compiled once per shape; the loop does no
per-token Python work. Preparing the run (data, workdir, mesh, state, resume) is
`run_setup.py`'s `prepare`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.training import evaluate as evaluate_lib
from flaxformer_lite.training import step as step_lib
from flaxformer_lite.training import train_data
from flaxformer_lite.training.preemption import StopSignals
from flaxformer_lite.training.run_setup import Run, prepare

Log = Callable[[str], None]


def _log_train_metrics(run: Run, sums, done: int, steps: int, elapsed: float) -> dict:
    fetched = jax.device_get(sums)
    metrics = cross_entropy.summarize(fetched)
    # grad_norm is summed over the steps since the last record: report the mean.
    metrics["grad_norm"] = float(fetched["grad_norm"]) / steps
    metrics["tokens_per_sec"] = float(fetched["tokens"]) / elapsed
    metrics["learning_rate"] = float(run.schedule(done - 1))
    if "ss_replaced" in fetched:  # scheduled sampling: the share of inputs fed from predictions
        metrics["ss_replaced"] = float(fetched["ss_replaced"]) / max(fetched["ss_replaceable"], 1)
    if "guided_attention" in fetched:  # mean of A * W over the guided cells
        cells = max(float(fetched["guided_attention_cells"]), 1.0)
        metrics["guided_attention"] = float(fetched["guided_attention"]) / cells
    if run.guard.skipped:
        metrics["nonfinite_skipped"] = run.guard.skipped  # in this run so far
    run.writer.write(done, "train", metrics)
    return metrics


@dataclasses.dataclass
class _LogWindow:
    """The steps since the last train-metrics record: their summed metrics and their clock."""

    start_time: float  # time.perf_counter() when training time began to count
    last_logged: int  # the step of the last record
    sums: Any = None  # summed metric sums of the steps since, None before the first

    def add(self, sums) -> None:
        """Adds one step's metric sums (float32 scalars)."""
        self.sums = sums if self.sums is None else jax.tree.map(jnp.add, self.sums, sums)

    def record(self, run: Run, done: int) -> dict:
        """Writes the window's metrics at step `done`, returns them and opens a new window."""
        elapsed = time.perf_counter() - self.start_time
        metrics = _log_train_metrics(run, self.sums, done, done - self.last_logged, elapsed)
        self.sums, self.start_time, self.last_logged = None, time.perf_counter(), done
        return metrics


def train_loop(run: Run) -> None:
    """Steps from the restored step to `train.num_steps`, with logging, evaluation, checkpoints.

    Between steps it stops for a signal (`Preempted`, after a checkpoint), a
    non-finite step (`NonFiniteError`, see `nonfinite.py`) or, after an
    evaluation, early stopping (it then returns).
    """
    t = run.config.train
    window = _LogWindow(time.perf_counter(), run.start)
    bar = _progress_bar(run)
    run.stop_if_preempted(run.start, sync=True)
    if run.early_stop.exhausted:  # a resumed run that had already stopped
        run.log(run.early_stop.message(run.start))
        return
    device_batches = _device_batches(run)
    for step in range(run.start, t.num_steps):
        done = step + 1
        window.add(_step(run, device_batches, done))
        if done % t.log_every == 0 or done == t.num_steps:
            metrics = window.record(run, done)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_sec']:.0f}")
        bar.update(1)
        interrupted = _evaluate_or_save(run, done)  # evaluated or saved: not training time
        run.stop_if_preempted(done)
        if run.early_stop.exhausted:
            run.log(run.early_stop.message(done))
            break
        if interrupted:  # tokens/s measures training alone
            window.start_time = time.perf_counter()
    bar.close()


def _progress_bar(run: Run) -> tqdm:
    """The training bar (steps), on process 0 when `train.progress_bar`."""
    t = run.config.train
    return tqdm(
        total=t.num_steps,
        initial=run.start,
        desc="train",
        unit="step",
        disable=not t.progress_bar or jax.process_index() != 0,
        dynamic_ncols=True,
    )


def _device_batches(run: Run):
    """The batches of the remaining steps, read ahead on the host and sent ahead to the mesh."""
    t = run.config.train
    batches = train_data.prefetch(
        lambda i: run.train_batches[i], run.first_batch, run.first_batch + t.num_steps - run.start
    )
    return train_data.device_prefetch(batches, lambda host: step_lib.device_batch(host, run.mesh))


def _step(run: Run, device_batches, done: int):
    """Runs step `done` (1-based) on the next batch, under the hang watchdog; its metric sums.

    The guard checks the step before (the host stays one step ahead), and a background save
    that failed ends the run here.
    """
    with run.watch("step", f"step {done}"):
        # Sends the next step's batch on its way before this one runs.
        batch = next(device_batches)
        run.state, sums = run.train_step(run.state, batch)
        run.guard.add(done, sums)
        run.guard.check(1)  # the step before: the host stays one step ahead
        run.ckpt.check()  # a background save that failed ends the run here
    return sums


def _evaluate_or_save(run: Run, done: int) -> bool:
    """After step `done`: the validation evaluation when due (then a forced save), else a
    save when due. Returns whether it evaluated or saved."""
    t = run.config.train
    if done == t.num_steps:
        return False  # final_evaluation saves and evaluates the last step
    if t.eval_every and done % t.eval_every == 0:
        run.guard.check(0)
        result = run.evaluate("validation", done, t.eval_max_batches or None)
        run.validated = None if t.eval_max_batches else (done, result)
        run.early_stop.update(done, result.metrics)
        # Every evaluated step is saved, so that the best ones can be kept.
        run.save(done, force=True, metrics=result.metrics)
        return True
    return run.save(done)


def final_evaluation(run: Run) -> dict[str, float]:
    """Saves the last step, evaluates every held-out split, prints examples.

    The checkpoint is written before evaluating (a failed evaluation loses no
    training); the validation metrics are then recorded with it, ranking it
    among the best checkpoints.
    """
    t = run.config.train
    final_step = int(run.state.step)
    run.save(final_step, force=True)
    run.stop_if_preempted(final_step, sync=True)
    results: dict[str, float] = {"step": final_step}
    for split in run.eval_sets:
        if split == "validation" and run.validated and run.validated[0] == final_step:
            result = run.validated[1]  # an early stop right after evaluating the whole split
        else:
            result = run.evaluate(split, final_step)
        results.update({f"{split}_{k}": v for k, v in result.metrics.items()})
        if split == "validation":
            run.ckpt.record_metrics(final_step, result.metrics)
        if split == "test" and t.num_examples_to_print:
            evaluate_lib.print_examples(
                run.eval_sets[split],
                run.tokenizer,
                result.pairs,
                t.num_examples_to_print,
                run.log,
                sources=run.descriptions.get(split),
            )
        if result.bleu_signature:
            run.log(f"{split} BLEU by sacreBLEU, signature {result.bleu_signature}")
        if result.bleu_tok_description:
            run.log(f"{split} bleu_tok: {result.bleu_tok_description}")
        run.stop_if_preempted(final_step)
    if run.eval_sets and result.exposure is not None:  # the test split's, or the last one's
        run.log(f"{split} exposure bias report:\n{result.exposure.table()}")
    return results


def train_and_evaluate(
    config: RunConfig,
    workdir: str,
    log: Log | None = None,
    on_checked: Callable[[], object] = lambda: None,
) -> dict[str, float]:
    """Trains (or resumes) the run of a parsed run config (`config.run.parse`) in `workdir`,
    evaluates, and returns final metrics.

    In a multi-process job every process calls this with the same arguments
    (after `distributed.initialize_distributed`); each feeds its own rows of
    every batch, all of them save and restore checkpoints together, only
    process 0 logs and writes files, and all return the same metrics.

    Raises:
      Preempted: SIGTERM or SIGINT arrived; a checkpoint was saved at the step
        the message names, and the same call resumes from it.
      NonFiniteError: a non-finite loss or gradient ended training; the last
        checkpoint is the last one written before it.
      checkpoint_format.CheckpointWriteError: a save failed; the previous checkpoint is kept.
    """
    # tqdm.write keeps log lines from tearing the progress bar.
    log = log or (lambda s: tqdm.write(s, file=sys.stderr))
    # A signal is reported by the process that got it, whichever that is.
    signals = StopSignals(log) if jax.process_index() == 0 else StopSignals()
    if jax.process_index() != 0:
        log = lambda s: None  # noqa: E731 (one log per job)
    with signals:
        run = prepare(config, workdir, log, on_checked)
        run.signals = signals
        signals.check_every = config.train.preemption_check_every
        try:
            train_loop(run)
            results = final_evaluation(run)
        except BaseException:
            run.close(failing=True)  # a failed background save is logged, not raised over this
            raise
        run.close()  # raises the failure of a save still in flight
        return results
