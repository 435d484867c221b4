"""`train_and_evaluate`: prepare a run, train it, evaluate it, in named stages.

The step functions are pure and jit-compiled once per shape; the loop does no
per-token Python work. Everything runs on a device mesh from the start (one
device on a laptop), with shardings derived from the parameters' logical axis
names in `parallel/partitioning.py`. The model is reached only through the
model protocol (`models/base.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from flaxformer_lite import datasets
from flaxformer_lite.config import sections
from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.data import batching
from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.data.common import texts
from flaxformer_lite.evaluation import exposure_probe
from flaxformer_lite.models.base import Seq2SeqModel
from flaxformer_lite.models.from_config import build_model, search_from_config
from flaxformer_lite.nn import kernels, precision
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.parallel import distributed, partitioning
from flaxformer_lite.training import checkpoints, optim, train_data
from flaxformer_lite.training import evaluate as evaluate_lib
from flaxformer_lite.training import step as step_lib
from flaxformer_lite.training.early_stopping import EarlyStopping
from flaxformer_lite.training.load_state import saved_param_shapes
from flaxformer_lite.training.metric_writer import MetricWriter
from flaxformer_lite.training.nonfinite import NonFiniteGuard
from flaxformer_lite.training.preemption import Preempted, StopSignals
from flaxformer_lite.training.state import TrainState, create_state, param_shapes
from flaxformer_lite.training.workdir import (
    WorkdirError,
    check_writable,
    claim_workdir,
    state_nbytes,
)

Log = Callable[[str], None]


def _prepare_workdir(planned: RunConfig, workdir: str):
    """Data splits, tokenizer, the run with its vocabularies' sizes, and whether the workdir
    had a run.

    Process 0 prepares the data, trains the vocabulary and claims the workdir;
    the others then read its vocabulary (see `distributed.process_0_first`).
    """
    splits = datasets.load_splits(planned.data)
    if jax.process_index() != 0 and not tokenizer_lib.Vocabularies.exists(workdir):
        raise WorkdirError(
            f"process {jax.process_index()} cannot see the vocabulary in {workdir}, which "
            "process 0 wrote: the workdir must be on a filesystem that every host shares"
        )
    tokenizer, new_vocab = train_data.load_or_train_tokenizer(
        planned.data, workdir, splits["train"]
    )
    run = planned.with_vocab(
        tokenizer.source.vocab_size, None if tokenizer.shared else tokenizer.target.vocab_size
    )
    had_run = claim_workdir(workdir, run, param_shapes(build_model(run)), saved_param_shapes)
    if new_vocab and jax.process_index() == 0:
        tokenizer.save(workdir)
    return splits, tokenizer, run, had_run


@dataclasses.dataclass
class Run:
    """Everything `prepare` sets up; `close` releases what it opened."""

    config: RunConfig  # with the vocabularies' sizes
    log: Log
    mesh: Any
    model: Seq2SeqModel
    tokenizer: Any
    saved: dict  # config.to_json(), stored with every checkpoint
    schedule: Any
    state: TrainState
    train_step: Callable
    eval_step: Callable
    decode_fn: Callable
    train_batches: Any
    eval_sets: dict
    references: dict
    ckpt: checkpoints.Checkpointer
    early_stop: EarlyStopping
    guard: NonFiniteGuard
    signals: StopSignals | None = None
    watchdog: Any = None
    writer: MetricWriter | None = None
    data_id: dict = dataclasses.field(default_factory=dict)
    first_batch: int = 0
    start: int = 0
    validated: tuple[int, Any] | None = None  # (step, result) of a whole-split validation
    # A speech split's source descriptions, printed with its examples (text splits: none).
    descriptions: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def close(self, *, failing: bool = False) -> None:
        """Closes the run once the save in flight is verified; `failing`: see
        `Checkpointer.close`."""
        try:
            self.ckpt.close(failing=failing)
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
            if self.writer is not None:
                self.writer.close()

    def watch(self, kind: str, what: str):
        """The hang watchdog's deadline around one step, evaluation or save."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.watch(kind, what)

    def save(self, step: int, *, force: bool = False, metrics: dict | None = None) -> bool:
        """Checkpoints the state at `step` (if due, or forced), once every step before it is
        known to be finite. Returns whether it saved."""
        self.guard.check(0)
        meta = train_data.checkpoint_meta(
            self.saved, self.data_id, self.first_batch + step - self.start
        )
        meta["early_stop"] = self.early_stop.state()
        with self.watch("save", f"checkpoint {step}"):
            return self.ckpt.save(step, self.state, meta, force=force, metrics=metrics)

    def stop_if_preempted(self, step: int, *, sync: bool = False) -> None:
        """Raises `Preempted` (after a checkpoint at `step`) when a stop signal arrived.

        Between steps it polls (`StopSignals.poll`: with several processes, agreed at
        every `train.preemption_check_every`-th call); with `sync`, every process agrees now.
        """
        if self.signals is None:
            return
        if not (self.signals.requested() if sync else self.signals.poll()):
            return
        saved = step > self.start
        if saved:
            self.save(step, force=True)
            with self.watch("save", f"checkpoint {step}"):
                self.ckpt.wait()  # "checkpoint saved" once it is verified
        raise Preempted(step, saved)

    def evaluate(self, split: str, step: int, max_batches: int | None = None):
        """Evaluates `split`; a stop signal ends it between batches with `Preempted`
        (after the checkpoint of `step`, which `final_evaluation` has already saved)."""
        try:
            with self.watch("eval", f"{split} evaluation at step {step}"):
                result = self._evaluate(split, max_batches)
        except evaluate_lib.Stopped as e:
            self.log(f"step {step} {split} evaluation: {e}")
            self.stop_if_preempted(step, sync=True)
            raise  # (not reached: a stop was agreed on)
        self.writer.write(step, split, result.record())
        self.log(f"step {step} {split}: {evaluate_lib.shown_metrics(result.metrics)}")
        return result

    def _evaluate(self, split: str, max_batches: int | None):
        return evaluate_lib.evaluate(
            self.state.params,
            self.eval_sets[split],
            self.references[split],
            self.tokenizer,
            self.mesh,
            eval_fn=self.eval_step,
            decode_fn=self.decode_fn,
            max_batches=max_batches,
            should_stop=None if self.signals is None else self.signals.poll,
            bleu=self.config.train.eval_bleu,
            wer=datasets.has_features(self.config.data),
            exposure=exposure_probe.Probe.for_search(
                self.model,
                search_from_config(self.config),
                # Re-tokenizing text would lose the copy head's extended ids.
                None
                if self.config.copy is not None
                else tokenizer_lib.Vocabularies.of(self.tokenizer).target,
            )
            if self.config.train.exposure_report
            else None,
        )


def _eval_sets(config: RunConfig, splits, tokenizer) -> tuple[dict, dict]:
    """Ordered, padded batches of the held-out splits, and their reference strings."""
    d, t = config.data, config.train
    sets = {
        name: batching.eval_batches(
            splits[name],
            tokenizer,
            batch_size=t.eval_batch_size,
            max_source_len=d.max_source_len,
            max_target_len=d.max_target_len,
            extended=config.copy is not None,
        )
        for name in ("validation", "test")
        if name in splits
    }
    return sets, {name: texts(splits[name], "target") for name in sets}


def _checkpointer(config: RunConfig, workdir: str, state, log: Log) -> checkpoints.Checkpointer:
    """The run's checkpointer, once the workdir is known to have room for two checkpoints
    (the previous one stays until the next one is written and verified)."""
    t = config.train
    # (orbax adds metadata to the arrays: ~150 KB for configs/tiny.py, hence the MiB)
    check_writable(workdir, 2 * (state_nbytes(state) + (1 << 20)))
    return checkpoints.Checkpointer(
        workdir,
        keep=t.keep_checkpoints,
        save_every=t.checkpoint_every,
        keep_best=t.keep_best_checkpoints,
        best_metric=t.best_metric,
        best_mode=sections.BEST_METRICS[t.best_metric],
        log=log,
        asynchronous=t.async_checkpoints,
    )


def prepare(
    planned: RunConfig,
    workdir: str,
    log: Log,
    on_checked: Callable[[], object] = lambda: None,
) -> Run:
    """Prepares data and workdir, builds (or restores) the state of a parsed run config.

    `on_checked` runs once the config and the mesh passed their checks (train.py
    reports the platform there, after a user mistake's one-line error would be).
    A latest checkpoint that cannot be read or fails its checksums is set aside
    and the newest good one restored (see `Checkpointer.restore_latest_good`).
    """
    kernels.check_platform(planned.model.attention_impl)
    t, d = planned.train, planned.data
    mesh = partitioning.mesh_from_config(planned.mesh)
    if not (d.batching == "bucket" and d.max_tokens):
        partitioning.check_batch_size(t.batch_size, mesh, "train.batch_size")
    partitioning.check_batch_size(t.eval_batch_size, mesh, "train.eval_batch_size")
    if jax.process_index() == 0:
        on_checked()
    splits, tokenizer, config, had_run = distributed.process_0_first(
        lambda: _prepare_workdir(planned, workdir), "preparing the data and the workdir"
    )
    model = build_model(config)
    log(precision.describe(config.model, config.optim.state_dtype))
    schedule, tx = optim.of_run(config)
    state, shardings = create_state(
        model, tx, mesh, seed=t.seed, source_len=d.max_source_len, target_len=d.max_target_len
    )
    # The previous checkpoint stays until the next one is written and verified.
    ckpt = _checkpointer(config, workdir, state, log)
    search = search_from_config(config)
    eval_sets, references = _eval_sets(config, splits, tokenizer)
    run = Run(
        config=config,
        log=log,
        mesh=mesh,
        model=model,
        tokenizer=tokenizer,
        saved=config.to_json(),
        schedule=schedule,
        state=state,
        train_step=step_lib.jit_train_step(
            model, tx, mesh, shardings, grad_accum_steps=t.grad_accum_steps
        ),
        eval_step=step_lib.jit_eval_step(model, mesh),
        decode_fn=lambda params, batch: model.predict(params, batch, search)[0][:, 0],
        train_batches=train_data.make_train_batches(
            d, t, splits["train"], tokenizer, log, extended=config.copy is not None
        ),
        eval_sets=eval_sets,
        references=references,
        descriptions={name: texts(splits[name], "source") for name in eval_sets}
        if datasets.has_features(d)
        else {},
        ckpt=ckpt,
        early_stop=EarlyStopping(t.best_metric, ckpt.best_mode, t.early_stop_patience),
        guard=NonFiniteGuard(t.nonfinite, t.nonfinite_max_skips, log),
    )
    try:
        restored_meta: dict[str, Any] = {}
        if ckpt.latest_step() is not None:
            run.state, restored_meta, _ = ckpt.restore_latest_good(state)
            log(f"resumed from step {int(run.state.step)} in {ckpt.directory}")
        elif had_run:
            log(f"workdir {workdir} has no checkpoint yet; starting at step 0")
        run.early_stop.restore(restored_meta.get("early_stop"))
        run.writer = MetricWriter(workdir, tensorboard=t.tensorboard)
        run.start = int(run.state.step)
        run.data_id = train_data.data_identity(d, t, splits["train"])
        run.first_batch = train_data.first_batch(
            restored_meta.get("data"), run.data_id, run.start, log
        )
        if t.hang_factor > 0:
            from flaxformer_lite.training import watchdog

            # Every process reports its own hang (the others' logs may be silent).
            run.watchdog = watchdog.Watchdog(factor=t.hang_factor, min_seconds=t.hang_min_seconds)
    except BaseException:
        run.close(failing=True)
        raise
    return run


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


def train_loop(run: Run) -> None:
    """Steps from the restored step to `train.num_steps`, with logging, evaluation, checkpoints.

    Between steps it stops for a signal (`Preempted`, after a checkpoint), a
    non-finite step (`NonFiniteError`, see `nonfinite.py`) or, after an
    evaluation, early stopping (it then returns).
    """
    t = run.config.train
    sums_acc = None
    t_log, last_logged = time.perf_counter(), run.start
    bar = tqdm(
        total=t.num_steps,
        initial=run.start,
        desc="train",
        unit="step",
        disable=not t.progress_bar or jax.process_index() != 0,
        dynamic_ncols=True,
    )
    run.stop_if_preempted(run.start, sync=True)
    if run.early_stop.exhausted:  # a resumed run that had already stopped
        run.log(run.early_stop.message(run.start))
        return
    batches = train_data.prefetch(
        lambda i: run.train_batches[i], run.first_batch, run.first_batch + t.num_steps - run.start
    )
    device_batches = train_data.device_prefetch(
        batches, lambda host: step_lib.device_batch(host, run.mesh)
    )
    for step in range(run.start, t.num_steps):
        done = step + 1
        with run.watch("step", f"step {done}"):
            # Sends the next step's batch on its way before this one runs.
            batch = next(device_batches)
            run.state, sums = run.train_step(run.state, batch)
            run.guard.add(done, sums)
            run.guard.check(1)  # the step before: the host stays one step ahead
            run.ckpt.check()  # a background save that failed ends the run here
        sums_acc = sums if sums_acc is None else jax.tree.map(jnp.add, sums_acc, sums)
        if done % t.log_every == 0 or done == t.num_steps:
            elapsed = time.perf_counter() - t_log
            metrics = _log_train_metrics(run, sums_acc, done, done - last_logged, elapsed)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_sec']:.0f}")
            sums_acc, t_log, last_logged = None, time.perf_counter(), done
        bar.update(1)
        interrupted = False  # evaluated or checkpointed: not training time
        if done == t.num_steps:
            pass  # final_evaluation saves and evaluates the last step
        elif t.eval_every and done % t.eval_every == 0:
            run.guard.check(0)
            result = run.evaluate("validation", done, t.eval_max_batches or None)
            run.validated = None if t.eval_max_batches else (done, result)
            run.early_stop.update(done, result.metrics)
            # Every evaluated step is saved, so that the best ones can be kept.
            run.save(done, force=True, metrics=result.metrics)
            interrupted = True
        else:
            interrupted |= run.save(done)
        run.stop_if_preempted(done)
        if run.early_stop.exhausted:
            run.log(run.early_stop.message(done))
            break
        if interrupted:  # tokens/s measures training alone
            t_log = time.perf_counter()
    bar.close()


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
      checkpoints.CheckpointWriteError: a save failed; the previous checkpoint is kept.
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
