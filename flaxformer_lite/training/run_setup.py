"""`prepare`: a parsed run config made into a `Run` ready to train (data, workdir, state).

Everything runs on a device mesh from the start (one device on a laptop), with
shardings derived from the parameters' logical axis names in
`parallel/partitioning.py`; the model is reached only through the model
protocol (`models/base.py`). The `Run` holds what the loop needs (state, jitted
steps, batches, checkpointer, writers) and the actions around a step: save,
evaluate, stop on preemption.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from flaxformer_lite import datasets
from flaxformer_lite.config import sections
from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.data import batching
from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.data.examples import texts
from flaxformer_lite.evaluation import exposure_probe
from flaxformer_lite.models.base import Seq2SeqModel
from flaxformer_lite.models.from_config import build_model, search_from_config
from flaxformer_lite.nn import kernels, precision
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
            bleu_lang=self.config.data.target_lang,
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
    mesh = _checked_mesh(planned)
    if jax.process_index() == 0:
        on_checked()
    splits, tokenizer, config, had_run = distributed.process_0_first(
        lambda: _prepare_workdir(planned, workdir), "preparing the data and the workdir"
    )
    run = _new_run(config, mesh, splits, tokenizer, workdir, log)
    try:
        _resume(run, had_run, workdir, splits["train"])
    except BaseException:
        run.close(failing=True)
        raise
    return run


def _checked_mesh(planned: RunConfig):
    """The run's device mesh, once the attention kernel suits the platform and the batch
    sizes divide among the mesh's data shards."""
    kernels.check_platform(planned.model.attention_impl)
    t, d = planned.train, planned.data
    mesh = partitioning.mesh_from_config(planned.mesh)
    if not (d.batching == "bucket" and d.max_tokens):
        partitioning.check_batch_size(t.batch_size, mesh, "train.batch_size")
    partitioning.check_batch_size(t.eval_batch_size, mesh, "train.eval_batch_size")
    return mesh


def _new_run(config: RunConfig, mesh, splits, tokenizer, workdir: str, log: Log) -> Run:
    """The `Run` of a fresh state (the model initialised with `train.seed`), its jitted steps,
    batches and checkpointer; `_resume` then restores a saved state into it."""
    t, d = config.train, config.data
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
    return Run(
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


def _resume(run: Run, had_run: bool, workdir: str, train_split) -> None:
    """Restores the newest good checkpoint (if any) into `run`, with its early-stopping
    and data position, and opens the metric writer and the hang watchdog."""
    t, d, log, ckpt = run.config.train, run.config.data, run.log, run.ckpt
    restored_meta: dict[str, Any] = {}
    if ckpt.latest_step() is not None:
        run.state, restored_meta, _ = ckpt.restore_latest_good(run.state)
        log(f"resumed from step {int(run.state.step)} in {ckpt.directory}")
    elif had_run:
        log(f"workdir {workdir} has no checkpoint yet; starting at step 0")
    run.early_stop.restore(restored_meta.get("early_stop"))
    run.writer = MetricWriter(workdir, tensorboard=t.tensorboard)
    run.start = int(run.state.step)
    run.data_id = train_data.data_identity(d, t, train_split)
    run.first_batch = train_data.first_batch(restored_meta.get("data"), run.data_id, run.start, log)
    if t.hang_factor > 0:
        from flaxformer_lite.training import watchdog

        # Every process reports its own hang (the others' logs may be silent).
        run.watchdog = watchdog.Watchdog(factor=t.hang_factor, min_seconds=t.hang_min_seconds)
